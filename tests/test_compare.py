"""`mdc compare` at CI size: two objectives, a few steps each, one table in three places, and a
relaunch that reruns nothing."""

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from mdc.data import shards
from mdc.evaluation import captioning, probe
from mdc.evaluation import compositionality as comp
from mdc.training.checkpoint import load_pretrained
from pipelines.cli import app
from pipelines.commands import compare
from pipelines.commands.compare import COLUMNS, run_compare
from pipelines.infra import tracking

TINY = [
    "data.max_length=16",
    "train.batch_size=8",
    "workers.count=1",
    "train.steps=4",
    "train.log_every=4",
    "checkpoint.every=4",
    "optim.warmup_steps=1",
]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_compare_trains_both_and_writes_one_table(ray_cluster, shapes_dir, tmp_path, monkeypatch):
    launch = dict(data_uri=str(shapes_dir), overrides=TINY, name="ci-compare", caption_length=8, limit=8, samples=2)
    rows = run_compare(["clip", "cdlm"], tmp_path, **launch)

    clip, cdlm = rows
    assert (clip.objective, cdlm.objective) == ("clip", "cdlm")
    for row in rows:  # the table's figures are those of each run's own exported checkpoint
        model, cfg = load_pretrained(row.checkpoint)
        assert cfg.objective.name == row.objective and cfg.train.steps == 4
        assert row.probe_accuracy == probe.probe_shapes(model, str(shapes_dir))["accuracy"]
        composition = comp.evaluate_shapes(model, row.objective, str(shapes_dir), samples=2, limit=8)
        assert row.compositionality_accuracy == composition["macro_accuracy"]
        assert row.compositionality_blind_accuracy == composition["macro_blind_accuracy"]
        assert row.text_biased == (", ".join(composition["text_biased"]) or "none")
        assert row.train_images_per_s > 0
    assert clip.bleu4 is None and clip.captions_per_s is None  # CLIP writes no captions
    images = captioning.group_by_image(shards.read_shards(str(shapes_dir / "val")), 8)
    written = captioning.evaluate_captions(load_pretrained(cdlm.checkpoint)[0], "cdlm", images, (8,), seed=0)
    assert cdlm.bleu4 == written["lengths"]["8"]["bleu4"]  # sampled from noise drawn from the run's seed

    markdown = (tmp_path / "compare.md").read_text().splitlines()
    assert markdown[2].startswith("| " + " | ".join(title for title, _ in COLUMNS.values()))
    assert [line.split("|")[1].strip() for line in markdown[4:]] == ["clip", "cdlm"]
    assert "n/a" in markdown[4] and "<td>cdlm</td>" in (tmp_path / "compare.html").read_text()

    client = MlflowClient(tracking.absolute_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"))
    [parent] = client.search_runs(
        [client.get_experiment_by_name("mdc").experiment_id], filter_string="tags.`mdc.run_name` = 'ci-compare'"
    )
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["cdlm/bleu4"] == pytest.approx(cdlm.bleu4)
    assert parent.data.metrics["clip/probe_accuracy"] == pytest.approx(clip.probe_accuracy)
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "eval")} == {
        "eval/compare.md",
        "eval/compare.html",
    }
    for row in rows:
        child = client.get_run(row.mlflow_run_id)
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.metrics["compare/probe_accuracy"] == pytest.approx(row.probe_accuracy)

    def refuse(*args, **kwargs):
        raise AssertionError("a relaunch trained or evaluated a row that was done")

    monkeypatch.setattr(compare, "run_training", refuse)
    monkeypatch.setattr(compare, "evaluate_checkpoint", refuse)
    assert run_compare(["clip", "cdlm"], tmp_path, **launch) == rows  # every row read back from runs/RUN/row.json


def test_compare_rejects_an_unknown_objective_before_starting_ray(tmp_path):
    result = CliRunner().invoke(app, ["compare", "--objectives", "mdc,gpt", "--workdir", str(tmp_path)])
    assert result.exit_code == 2 and "gpt" in result.output
    assert not (tmp_path / "mlflow.db").exists()
