"""Every MLflow write goes through here: one run per training run name, so a relaunch logs into the
same run; evaluations into the training run or a run of their own; artifacts; the history reports plot."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

RUN_NAME_TAG = "mdc.run_name"
EVAL_EXPERIMENT = "mdc-eval"  # evaluations of a checkpoint given without a run to log into
_OPEN: dict[str, str] = {}  # run id -> tracking URI: runs this process set RUNNING and has not ended
_INTERRUPTED = threading.Event()  # Ctrl-C: runs this process ends from now on end KILLED


def absolute_tracking_uri(uri: str) -> str:
    """`sqlite:///mlflow.db` relative to where the command runs, made absolute so Ray workers
    (other working directories) write to the same store."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
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
        return (Path(tracking_uri[len(prefix) :]).parent / "mlartifacts").as_uri()
    return None


def _params(params: dict) -> list[Param]:
    return [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]  # MLflow caps a value at 6000


def experiment_id(client: MlflowClient, tracking_uri: str, experiment: str) -> str:
    exp = client.get_experiment_by_name(experiment)
    return (
        exp.experiment_id
        if exp
        else client.create_experiment(experiment, artifact_location=artifact_location(tracking_uri))
    )


def get_or_create_run(
    tracking_uri: str, experiment: str, run_name: str, params: dict, parent_run_id: str | None = None
) -> str:
    """The id of the MLflow run tagged with `run_name` in `experiment`, created if absent."""
    client = MlflowClient(tracking_uri)
    exp_id = experiment_id(client, tracking_uri, experiment)
    found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        _OPEN[found[0].info.run_id] = tracking_uri
        return found[0].info.run_id
    tags = {RUN_NAME_TAG: run_name, "mlflow.runName": run_name}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(exp_id, tags=tags)
    client.log_batch(run.info.run_id, params=_params(params))
    _OPEN[run.info.run_id] = tracking_uri
    return run.info.run_id


class MetricLogger:
    """Buffers per-step metrics and writes them in batches (one SQLite transaction per flush)."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.client, self.run_id, self.pending = MlflowClient(tracking_uri), run_id, []

    def log(self, metrics: dict, step: int) -> None:
        now = int(time.time() * 1000)
        self.pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def flush(self) -> None:
        for i in range(0, len(self.pending), 900):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(self.run_id, metrics=self.pending[i : i + 900])
        self.pending = []


def finish_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Ends the run; after Ctrl-C a run that did not finish is KILLED, not FAILED (its trainer
    was torn down under it), so that MLflow says it was stopped and a relaunch resumes it."""
    if status == "FAILED" and _INTERRUPTED.is_set():
        status = "KILLED"
    MlflowClient(tracking_uri).set_terminated(run_id, status=status)
    _OPEN.pop(run_id, None)


@contextlib.contextmanager
def ended_on_error(tracking_uri: str, run_id: str):
    """A run this block leaves by an error ends FAILED (KILLED on Ctrl-C), never RUNNING."""
    try:
        yield
    except KeyboardInterrupt:
        finish_run(tracking_uri, run_id, "KILLED")
        raise
    except BaseException:
        finish_run(tracking_uri, run_id, "FAILED")
        raise


def kill_open_runs() -> list[str]:
    """On Ctrl-C: every run this process opened and has not ended is marked KILLED (and any it
    ends later as FAILED); returns their ids."""
    _INTERRUPTED.set()
    killed = list(_OPEN.items())
    for run_id, tracking_uri in killed:
        finish_run(tracking_uri, run_id, "KILLED")
    return [run_id for run_id, _ in killed]


def log_metrics(tracking_uri: str, run_id: str, metrics: dict, step: int = 0) -> None:
    logger = MetricLogger(tracking_uri, run_id)
    logger.log(metrics, step)
    logger.flush()


def log_artifacts(tracking_uri: str, run_id: str, paths: Iterable[Path], artifact_path: str | None = None) -> None:
    client = MlflowClient(tracking_uri)
    for path in paths:
        client.log_artifact(run_id, str(path), artifact_path=artifact_path)


def log_evaluation(
    tracking_uri: str,
    metrics: dict,
    artifacts: list[Path],
    run_id: str | None = None,
    run_name: str = "eval",
    params: dict | None = None,
    step: int = 0,
) -> str:
    """Metrics (at `step`) and artifacts (under eval/) into run_id, or into a new finished run of
    mdc-eval. Parameters go to new runs only: a training run's parameters are fixed."""
    tracking_uri = absolute_tracking_uri(tracking_uri)
    created = run_id is None
    if created:
        client = MlflowClient(tracking_uri)
        run_id = client.create_run(experiment_id(client, tracking_uri, EVAL_EXPERIMENT), run_name=run_name).info.run_id
        client.log_batch(run_id, params=_params(params or {}))
    log_metrics(tracking_uri, run_id, metrics, step)
    log_artifacts(tracking_uri, run_id, artifacts, "eval")
    if created:
        finish_run(tracking_uri, run_id)
    return run_id


def kill_children(tracking_uri: str, parent_run_id: str, stopped: set[str]) -> None:
    """Children of a sweep that a scheduler stopped end KILLED: those left RUNNING (their driver
    killed before closing the run) and the FAILED ones named in `stopped` (their trainer torn down
    first); a child that failed on its own stays FAILED."""
    client = MlflowClient(tracking_uri)
    for child in client.search_runs(
        [client.get_run(parent_run_id).info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'"
    ):
        name = child.data.tags.get(RUN_NAME_TAG)
        if child.info.status == "RUNNING" or (child.info.status == "FAILED" and name in stopped):
            client.set_terminated(child.info.run_id, status="KILLED")


def latest_metrics(tracking_uri: str, run_id: str) -> dict[str, float]:
    """Every metric of the run at its latest step, by key."""
    return dict(MlflowClient(tracking_uri).get_run(run_id).data.metrics)


def metric_history(tracking_uri: str, run_id: str, keys: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) pairs of each metric the run logged, by step."""
    client = MlflowClient(tracking_uri)
    history = {key: sorted({m.step: m.value for m in client.get_metric_history(run_id, key)}.items()) for key in keys}
    return {key: points for key, points in history.items() if points}
