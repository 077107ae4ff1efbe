"""MLflow and the registry tell the truth (issue 52): a run that fails ends FAILED (KILLED on
Ctrl-C), never RUNNING; a run that failed after registering holds no version; the registered name
says what was trained and the version's tags its data and objective. Ray-free, on a local SQLite store."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from mdc.config import load_config
from pipelines.infra import tracking
from pipelines.run import evaluation, model_registry
from pipelines.run.driver import TrainSummary


@pytest.fixture
def store(tmp_path):
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def status(uri: str, run_id: str) -> str:
    return MlflowClient(uri).get_run(run_id).info.status


@pytest.mark.parametrize("raised, expected", [(RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_a_run_left_by_an_error_ends_failed_or_killed(store, raised, expected):
    run_id = tracking.get_or_create_run(store, "mdc", "run-a", {})
    with pytest.raises(type(raised)), tracking.ended_on_error(store, run_id):
        raise raised
    assert status(store, run_id) == expected
    finished = tracking.get_or_create_run(store, "mdc", "run-b", {})
    with tracking.ended_on_error(store, finished):
        pass
    assert status(store, finished) == "RUNNING"  # ended by whoever finishes it, FINISHED


def test_a_run_whose_evaluation_fails_ends_failed_and_registers_nothing(store, monkeypatch):
    cfg = load_config(None, ["name=trial-1", f"mlflow_uri={store}"])
    run_id = tracking.get_or_create_run(store, "mdc", cfg.name, {})
    client = MlflowClient(store)
    client.create_registered_model("sweep")
    client.create_model_version("sweep", "file:///nowhere", run_id)  # what register_training_run made
    tracking.finish_run(store, run_id)
    monkeypatch.setattr(evaluation, "run_training", lambda cfg, **kw: TrainSummary(cfg.name, run_id, "/ck", {}))

    def broken(cfg, summary):
        raise OSError("probe folder gone")

    monkeypatch.setattr(evaluation, "evaluate_run", broken)
    with pytest.raises(OSError):
        evaluation.train_and_evaluate(cfg)
    assert status(store, run_id) == "FAILED"
    assert client.search_model_versions("name = 'sweep'") == []


def test_the_registered_name_says_what_was_trained_and_the_tags_its_data():
    cfg = load_config(None, ["name=birds-mdc", "data.train_uri=/data/birds"])
    assert model_registry.registered_name(cfg) == "birds-mdc"  # not one shared mdc-mdc-tiny
    assert model_registry.registered_name(cfg.model_copy(update={"registered_model": "birds"})) == "birds"
    assert model_registry.version_tags(cfg) == {"data": "/data/birds", "objective": "mdc", "preset": "tiny"}


def test_a_run_whose_data_holds_no_shards_opens_no_mlflow_run(store, tmp_path):
    """The driver lists the shards before it opens the run: such a run was left RUNNING for good."""
    from types import SimpleNamespace

    from mdc.data.storage import StorageError
    from pipelines.run import driver

    channel = SimpleNamespace(push=SimpleNamespace(remote=lambda message: None))  # the console's, unread

    (tmp_path / "jpgs").mkdir()
    (tmp_path / "jpgs" / "a.jpg").write_bytes(b"jpeg")
    cfg = load_config(None, [f"data.train_uri={tmp_path / 'jpgs'}", f"mlflow_uri={store}"])
    with pytest.raises(StorageError, match="it holds 1 .jpg"):
        driver._train(cfg, parent_run_id=None, ray_callbacks=None, channel=channel, callbacks=())
    client = MlflowClient(store)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
