"""MLflow helpers: one run per training run name, so a relaunch logs into the same run."""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

RUN_NAME_TAG = "mdc.run_name"


def absolute_tracking_uri(uri: str) -> str:
    """`sqlite:///mlflow.db` relative to where the command runs, made absolute so Ray workers
    (other working directories) write to the same store."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store live beside the database, not in ./mlruns of whoever ran first."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix):
        return (Path(tracking_uri[len(prefix):]).parent / "mlartifacts").as_uri()
    return None


def get_or_create_run(tracking_uri: str, experiment: str, run_name: str, params: dict,
                      parent_run_id: str | None = None) -> str:
    """The id of the MLflow run tagged with `run_name` in `experiment`, created if absent."""
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        experiment, artifact_location=artifact_location(tracking_uri))
    found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
                               max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id
    tags = {RUN_NAME_TAG: run_name, "mlflow.runName": run_name}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(exp_id, tags=tags)
    client.log_batch(run.info.run_id, params=[mlflow.entities.Param(k, str(v)[:6000])
                                              for k, v in flatten(params).items()])
    return run.info.run_id


class MetricLogger:
    """Buffers per-step metrics and writes them in batches (one SQLite transaction per flush)."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.client, self.run_id, self.pending = MlflowClient(tracking_uri), run_id, []

    def log(self, metrics: dict, step: int) -> None:
        now = int(time.time() * 1000)
        self.pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]

    def flush(self) -> None:
        for i in range(0, len(self.pending), 900):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(self.run_id, metrics=self.pending[i:i + 900])
        self.pending = []


def finish_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    MlflowClient(tracking_uri).set_terminated(run_id, status=status)

