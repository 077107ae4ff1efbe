"""MLflow's Model Registry on the project's SQLite store: a finished run registers its encoder once,
with its run and figures as tags; the best run of a sweep gets the alias `best`; and both
`models:/NAME/VERSION` and `models:/NAME@best` work wherever a checkpoint does."""

import json

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from mdc import export
from mdc.config import RunConfig, dump_config
from mdc.evaluation import probe
from mdc.training.checkpoint import export_weights
from pipelines.cli import app
from pipelines.infra import tracking
from pipelines.run import model_registry

NAME = "shapes-sweep"  # the trials of one sweep: versions of its model


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A SQLite store with two finished training runs of the tiny preset, each with a checkpoint in
    its storage (where the run's parameters say) and its online figures logged; both registered."""
    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cfg = RunConfig.model_validate({"data": {"max_length": 16}, "storage_uri": str(root / "checkpoints")})
    runs = {}
    for seed, (name, accuracy) in enumerate((("run-a", 0.61), ("run-b", 0.74))):
        checkpoint = root / "checkpoints" / name / "checkpoint_00000010"
        run_cfg = cfg.model_copy(update={"name": name, "registered_model": NAME})
        export_weights(checkpoint, probe.random_init(run_cfg, seed=seed).state_dict(), dump_config(run_cfg))
        (checkpoint / "complete.json").write_text(json.dumps({"step": 10, "ranks": [0], "files": {}}))
        run_id = tracking.get_or_create_run(uri, "mdc", name, run_cfg.model_dump())
        figures = {
            "eval/probe/shapes/accuracy": accuracy,
            "eval/compositionality/shapes/macro": 0.5,
            "eval/compositionality/shapes/vg_relation": 0.25,  # not a headline figure: no tag
        }
        tracking.log_metrics(uri, run_id, figures, 10)
        tracking.finish_run(uri, run_id)
        runs[name] = (run_id, str(checkpoint))
        model_registry.register_run(uri, run_id, str(checkpoint), model_registry.registered_name(run_cfg))
    return uri, runs, root


def test_a_finished_run_registers_one_version_with_its_tags(registry):
    uri, runs, _ = registry
    run_id, checkpoint = runs["run-a"]
    client = MlflowClient(uri)
    version = client.get_model_version(NAME, "1")
    assert version.run_id == run_id
    assert version.tags == {
        "run_id": run_id,
        "run_name": "run-a",
        "eval/probe/shapes/accuracy": "0.6100",
        "eval/compositionality/shapes/macro": "0.5000",
    }
    later = {"eval/captions/shapes/N10/cider": 0.125, "eval/captions/shapes/N10/bleu4": 0.5, "loss": 2.0}
    assert model_registry.tag_figures(uri, run_id, later) == f"models:/{NAME}/1"  # the evaluation after training
    assert client.get_model_version(NAME, "1").tags["eval/captions/shapes/N10/cider"] == "0.1250"
    assert "loss" not in client.get_model_version(NAME, "1").tags
    assert model_registry.register_run(uri, run_id, checkpoint, NAME) == (NAME, "1")  # a relaunch: no new version
    assert sorted(str(v.version) for v in client.search_model_versions(f"name = '{NAME}'")) == ["1", "2"]


def test_the_best_run_gets_the_alias_and_both_uris_resolve(registry, tmp_path):
    uri, runs, _ = registry
    assert model_registry.alias_best(uri, {"run-a": 0.61, "run-b": 0.74, "run-c": None}) == f"models:/{NAME}@best"
    assert str(MlflowClient(uri).get_model_version_by_alias(NAME, "best").version) == "2"
    assert model_registry.alias_best(uri, {"run-c": None}) is None
    best = model_registry.resolve(f"models:/{NAME}@best", uri, tmp_path)
    assert best == model_registry.resolve(f"models:/{NAME}/2", uri, tmp_path)
    assert {p.name for p in best.iterdir()} == {"config.json", "model.safetensors", "README.md", "captioner"}
    assert "| MLflow run | " + runs["run-b"][0] in (best / "README.md").read_text()
    with pytest.raises(ValueError, match="models:/nope/3: not in the registry"):
        model_registry.resolve("models:/nope/3", uri, tmp_path)


def probe_json(tmp_path, shapes_dir, uri, checkpoint: str) -> dict:
    out = tmp_path / "probe.json"
    result = CliRunner().invoke(
        app,
        ["eval", "probe", "--checkpoint", checkpoint, "--dataset", "shapes", "--root", str(shapes_dir)]
        + ["--out", str(out), "--mlflow-uri", uri, "--no-baseline"],
    )
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_eval_probe_takes_registered_versions(registry, shapes_dir, tmp_path, monkeypatch):
    uri, runs, _ = registry
    monkeypatch.setenv("HOME", str(tmp_path))  # the download cache, ~/.cache/mdc/models
    model_registry.alias_best(uri, {"run-a": 0.9})
    by_alias = probe_json(tmp_path, shapes_dir, uri, f"models:/{NAME}@best")
    by_version = probe_json(tmp_path, shapes_dir, uri, f"models:/{NAME}/1")
    by_checkpoint = probe_json(tmp_path, shapes_dir, "", runs["run-a"][1])
    assert by_alias["accuracy"] == by_version["accuracy"] == by_checkpoint["accuracy"]


@pytest.mark.parametrize("source", ["models:/{name}/2", "runs:/{run_id}", "{run_id}"])
def test_export_takes_versions_and_runs(registry, tmp_path, source, monkeypatch):
    uri, runs, _ = registry
    monkeypatch.setenv("HOME", str(tmp_path))  # its own download cache: another session's version 2 is not this one
    source = source.format(name=NAME, run_id=runs["run-b"][0])
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", source, "--to", str(out), "--mlflow-uri", uri, "--no-captioner"])
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    assert "| eval/probe/shapes/accuracy | 0.7400 |" in (out / export.MODEL_CARD).read_text()
