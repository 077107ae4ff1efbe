"""What the driver settles before any cluster work: every local path absolute, and the data and
checkpoint store reachable (an error naming the config field otherwise)."""

from __future__ import annotations

from pathlib import Path

from mdc.config import RunConfig
from mdc.data import storage


def absolute_uri(uri: str | None) -> str | None:
    """A local path made absolute; URIs (s3://, sqlite://, ...) and None unchanged."""
    if uri is None or "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """The config with every local path absolute (data, storage, MLflow store): workers and Tune
    trials run in other working directories, so a relative path would name another place there."""
    from pipelines.infra import tracking  # MLflow takes seconds to import: not before a user error

    raw = cfg.model_dump()
    raw["storage_uri"] = absolute_uri(raw["storage_uri"])
    raw["mlflow_uri"] = tracking.absolute_tracking_uri(raw["mlflow_uri"])
    for key in ("train_uri", "val_uri"):
        raw["data"][key] = absolute_uri(raw["data"][key])
    return RunConfig.model_validate(raw)


def check_inputs(cfg: RunConfig) -> None:
    """Fail in seconds, before any cluster work, when the data or the checkpoint store cannot be
    reached: a StorageError that names the config field, the location and what was expected."""
    from mdc.evaluation import suite  # the evaluation stack: seconds to import, not before a config error

    data = cfg.data
    shard_folder = "a folder of .tar or .parquet shards"
    inputs = (
        ("data.train_uri", data.train_uri, shard_folder),
        ("data.val_uri", data.val_uri, shard_folder),
    )
    for field_name, uri, expected in inputs:
        if uri is None:
            continue
        try:
            storage.check_reachable(uri, data.endpoint_url)
        except storage.StorageError as err:
            raise storage.StorageError(f"{field_name}: {err} (expected {expected})") from None
    if storage.is_s3(cfg.storage_uri):
        try:
            storage.check_reachable(cfg.storage_uri, data.endpoint_url, must_exist=False)
        except storage.StorageError as err:
            raise storage.StorageError(f"storage_uri: {err}") from None
    suite.check_section(cfg.eval, data.endpoint_url)  # the probe, benchmark and caption folders
