"""MLflow's Model Registry: every finished training run registers its encoder, so "the encoder of
sweep trial 7" is `models:/SWEEP/7`, not a path someone wrote down. One registered model per thing
a user asks for by name: `registered_model`, else the run's name (a sweep's trials: the sweep's).

A version's artifacts are the folder `mdc export` writes (the timm folder, its model card and the
captioner in `captioner/`), logged as the run's `encoder` artifact; its tags are the run id, the
data, objective and preset it was trained with, and the run's headline figures under their metric keys (mdc/evaluation/suite.py `headline`:
eval/probe/NAME/accuracy, ...). Sweeps and plans give their best run's version the alias
`best`. `resolve` turns `models:/NAME/VERSION` or `models:/NAME@ALIAS` into a local folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mdc import export
from mdc.config import RunConfig
from mdc.data import storage
from mdc.evaluation import suite
from mdc.training import checkpoint as ckpt
from pipelines.infra import progress, tracking
from pipelines.infra.console import UserError

ARTIFACT_PATH = "encoder"  # the run's artifact folder a version points at
BEST = "best"
MODELS_PREFIX = "models:/"
RUN_ID_TAG, RUN_NAME_TAG = "run_id", "run_name"
_MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))")


def registered_name(cfg: RunConfig) -> str:
    """`registered_model` in the config, else the run's name: one registered model per thing a
    user asks for by name (a sweep's trials are versions of the sweep's, `mdc tune`)."""
    return cfg.registered_model or cfg.name


def version_tags(cfg: RunConfig) -> dict[str, str]:
    """What a version was trained on and how, beside its run: `version 7` says what it is."""
    return {"data": cfg.data.train_uri, "objective": cfg.objective.name, "preset": cfg.model.preset}


def withdraw(tracking_uri: str, run_id: str) -> None:
    """The version a run registered deleted: a run that failed after registering (its evaluation)
    is no model anyone should load."""
    client = MlflowClient(tracking_uri)
    version = version_of_run(client, run_id)
    if version is not None:
        client.delete_model_version(version.name, version.version)


def is_model_uri(uri: str) -> bool:
    return uri.startswith(MODELS_PREFIX)


def figures(metrics: dict[str, float]) -> dict[str, float]:
    """The headline figures among a run's latest metrics (its online evaluation's, or what the
    evaluation after training or `mdc eval --run-id` logged into it), under their keys."""
    return suite.headline(metrics)


def version_of_run(client: MlflowClient, run_id: str):
    """The version a run registered, or None."""
    found = client.search_model_versions(f"run_id = '{run_id}'")
    return max(found, key=lambda v: int(v.version)) if found else None


def register_run(
    tracking_uri: str,
    run_id: str,
    checkpoint_uri: str,
    name: str,
    endpoint_url: str | None = None,
    extra_tags: dict[str, str] | None = None,
) -> tuple[str, str]:
    """Export `checkpoint_uri`, log it as the run's `encoder` artifact and register it under `name`;
    a run registers once (a relaunch gets the version it made). Returns (name, version)."""
    client = MlflowClient(tracking_uri)
    existing = version_of_run(client, run_id)
    if existing is not None:
        return existing.name, str(existing.version)
    run = client.get_run(run_id)
    found = figures(run.data.metrics)
    facts = {"MLflow run": run_id, "checkpoint": checkpoint_uri, **found}
    with tempfile.TemporaryDirectory() as scratch:
        folder = export.export_checkpoint(checkpoint_uri, Path(scratch, ARTIFACT_PATH), facts, True, endpoint_url)
        client.log_artifacts(run_id, str(folder), ARTIFACT_PATH)
    try:
        client.create_registered_model(name, description="mdc encoders: timm folders from `mdc export`")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = {RUN_ID_TAG: run_id, RUN_NAME_TAG: run.data.tags.get(tracking.RUN_NAME_TAG, run.info.run_name)}
    tags |= {k: f"{v:.4f}" for k, v in found.items()} | (extra_tags or {})
    version = client.create_model_version(name, f"{run.info.artifact_uri}/{ARTIFACT_PATH}", run_id, tags=tags)
    return name, str(version.version)


def register_training_run(cfg: RunConfig, mlflow_run_id: str, checkpoint_uri: str, reporter: progress.Reporter):
    """After a run finished: its encoder registered, and where, said. A failure here is reported and
    leaves the finished training as it is."""
    try:
        name, version = register_run(
            tracking.absolute_tracking_uri(cfg.mlflow_uri),
            mlflow_run_id,
            checkpoint_uri,
            registered_name(cfg),
            cfg.data.endpoint_url,
            version_tags(cfg),
        )
        reporter.note(f"encoder registered as models:/{name}/{version}")
    except Exception as err:
        reporter.note(f"encoder not registered: {type(err).__name__}: {err}", warning=True)


def tag_figures(tracking_uri: str, run_id: str, measured: dict[str, float]) -> str | None:
    """The headline figures measured after the run registered (its evaluation after training) onto
    its version's tags; returns
    the version's `models:/NAME/VERSION`, or None when the run registered nothing."""
    client = MlflowClient(tracking_uri)
    version = version_of_run(client, run_id)
    if version is None:
        return None
    for key, value in figures(measured).items():
        client.set_model_version_tag(version.name, version.version, key, f"{value:.4f}")
    return f"{MODELS_PREFIX}{version.name}/{version.version}"


def alias_best(tracking_uri: str, scores: dict[str, float | None], alias: str = BEST) -> str | None:
    """Give the version registered by the best-scoring run of a sweep or plan (`scores`: by run
    name; None for a run without the figure) the alias; returns its `models:/NAME@ALIAS`, or None
    when no scored run registered a version."""
    best = max((name for name, score in scores.items() if score is not None), key=scores.get, default=None)
    if best is None:
        return None
    client = MlflowClient(tracking.absolute_tracking_uri(tracking_uri))
    found = client.search_model_versions(f"tags.{RUN_NAME_TAG} = '{best}'")
    if not found:
        return None
    version = max(found, key=lambda v: int(v.version))
    client.set_registered_model_alias(version.name, alias, version.version)
    return f"{MODELS_PREFIX}{version.name}@{alias}"


def run_checkpoint(tracking_uri: str, run: str, endpoint_url: str | None = None) -> tuple[str, dict]:
    """(the newest complete checkpoint of MLflow run `run` (`runs:/ID` or the id), the facts its
    model card shows): found in its storage by the parameters it was logged with."""
    run_id = run.removeprefix("runs:/").strip("/")
    client = MlflowClient(tracking.absolute_tracking_uri(tracking_uri))
    try:
        found = client.get_run(run_id)
    except MlflowException as err:
        raise UserError(f"MLflow run {run_id!r}: not in {tracking_uri} ({err.message.splitlines()[0]})") from None
    params = found.data.params
    if "storage_uri" not in params or "name" not in params:
        raise UserError(f"MLflow run {run_id} has no storage_uri/name parameters: not an mdc training run")
    run_dir = storage.join(params["storage_uri"], params["name"])
    logged_endpoint = params.get("data.endpoint_url")
    endpoint_url = endpoint_url or (logged_endpoint if logged_endpoint not in (None, "None") else None)
    checkpoint, _ = ckpt.newest_complete(run_dir, endpoint_url)
    if checkpoint is None:
        raise UserError(f"MLflow run {run_id}: no complete checkpoint in {run_dir}")
    return checkpoint, {"MLflow run": run_id, "checkpoint": checkpoint, **figures(found.data.metrics)}


def resolve(uri: str, tracking_uri: str, cache_dir: str | Path | None = None) -> Path:
    """The local folder of `models:/NAME/VERSION` or `models:/NAME@ALIAS`, downloaded once into
    `cache_dir` (default ~/.cache/mdc/models; a version's files never change)."""
    match = _MODEL_URI.fullmatch(uri.rstrip("/"))
    if match is None:
        raise UserError(f"{uri!r} is not models:/NAME/VERSION or models:/NAME@ALIAS")
    if not tracking_uri:
        raise UserError(f"{uri} needs an MLflow tracking URI (--mlflow-uri) to look it up")
    client = MlflowClient(tracking.absolute_tracking_uri(tracking_uri))
    name = match["name"]
    try:
        version = (
            client.get_model_version(name, match["version"])
            if match["version"]
            else client.get_model_version_by_alias(name, match["alias"])
        )
    except MlflowException as err:
        raise UserError(f"{uri}: not in the registry at {tracking_uri} ({err.message.splitlines()[0]})") from None
    local = Path(cache_dir or Path.home() / ".cache" / "mdc" / "models") / name / str(version.version)
    if not (local / export.TIMM_CONFIG).is_file():
        local.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=local.parent) as partial:
            with _no_progress_bar():
                mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=partial)
            shutil.rmtree(local, ignore_errors=True)  # what an interrupted download left
            Path(partial, ARTIFACT_PATH).rename(local)
    return local


@contextlib.contextmanager
def _no_progress_bar():
    """MLflow draws a download bar per folder; the console has its own lines."""
    previous = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"]
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = previous
