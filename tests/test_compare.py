"""`mdc compare` at CI size: two objectives trained a few steps on an unlabelled img2dataset folder,
judged on a probe of CIFAR-10's python batches, ARO-format pairs and captions under the keys every
command logs; one table in three places, and a relaunch that reruns nothing."""

import json

import pytest
from helpers import EVAL_KEYS, eval_overrides
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.commands import compare, experiment
from pipelines.commands.compare import run_compare
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
@pytest.mark.timeout(420)
def test_compare_on_unlabelled_data_judges_both_on_the_eval_section(
    ray_cluster, img2dataset_dir, cifar10_dir, shapes_dir, tmp_path, monkeypatch
):
    overrides = [*TINY, *eval_overrides(cifar10_dir, shapes_dir)]
    launch = dict(data_uri=str(img2dataset_dir), overrides=overrides, name="ci-compare")
    rows, failures = run_compare(["clip", "cdlm"], tmp_path, **launch)

    assert failures == [] and [row["objective"] for row in rows] == ["clip", "cdlm"]
    clip, cdlm = (row["metrics"] for row in rows)
    assert {k for k in cdlm if k.startswith("eval/")} == EVAL_KEYS  # the keys every command logs
    assert {k for k in clip if k.startswith("eval/")} == {k for k in EVAL_KEYS if "/captions/" not in k}  # no captions
    client = MlflowClient(tracking.absolute_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"))
    for row in rows:  # the row's figures are those its run logged, and those `mdc eval all` measures again
        child = client.get_run(row["mlflow_run_id"])
        assert {k: v for k, v in child.data.metrics.items() if k.startswith("eval/")} == {
            k: v for k, v in row["metrics"].items() if k.startswith("eval/")
        }
        out = tmp_path / f"{row['objective']}.json"
        result = CliRunner().invoke(
            app, ["eval", "all", "--checkpoint", row["checkpoint"], "--out", str(out), "--mlflow-uri", ""]
        )
        assert result.exit_code == 0, result.output
        again = json.loads(out.read_text())["metrics"]
        assert {k: v for k, v in again.items() if "per_s" not in k} == {
            k: v for k, v in row["metrics"].items() if k.startswith("eval/") and "per_s" not in k
        }
        assert row["metrics"]["images_per_s"] > 0

    markdown = (tmp_path / "compare.md").read_text().splitlines()
    header = [cell.strip() for cell in markdown[2].split("|")[1:-1]]
    assert header[:3] == ["objective", "eval/probe/cifar10/accuracy", "eval/compositionality/aro/macro"]
    assert [line.split("|")[1].strip() for line in markdown[4:]] == ["clip", "cdlm"]
    assert "n/a" in markdown[4] and "<td>cdlm</td>" in (tmp_path / "compare.html").read_text()

    [parent] = client.search_runs(
        [client.get_experiment_by_name("mdc").experiment_id], filter_string="tags.`mdc.run_name` = 'ci-compare'"
    )
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "eval")} == {
        "eval/compare.md",
        "eval/compare.html",
    }
    for row in rows:
        assert client.get_run(row["mlflow_run_id"]).data.tags["mlflow.parentRunId"] == parent.info.run_id

    def refuse(*args, **kwargs):
        raise AssertionError("a relaunch trained or evaluated a row that was done")

    monkeypatch.setattr(experiment, "train_and_evaluate", refuse)
    again, _ = run_compare(["clip", "cdlm"], tmp_path, **launch)
    assert again == rows  # every row read back from runs/RUN/row.json
    assert compare.RESULT == "row.json"


def test_compare_rejects_an_unknown_objective_before_starting_ray(tmp_path):
    result = CliRunner().invoke(app, ["compare", "--objectives", "mdc,gpt", "--workdir", str(tmp_path)])
    assert result.exit_code == 2 and "gpt" in result.output
    assert not (tmp_path / "mlflow.db").exists()
