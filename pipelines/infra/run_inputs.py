"""What the driver settles before any cluster work: every local path absolute, and the data and
checkpoint store reachable and fit for the config (an error naming the config field otherwise).
Torch-free, Ray-free: every check answers in seconds."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from mdc.config import ConfigError, RunConfig
from mdc.data import shards, storage

SHARD_FOLDER = "a folder of .tar or .parquet shards"


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


def check_s3_host(field_name: str, uri: str | None, endpoint_url: str | None) -> None:
    """A StorageError naming data.endpoint_url when the S3 host `uri` is read from has no address:
    in a second, instead of pyarrow's "Could not resolve host" after its retries."""
    if not uri or not storage.is_s3(uri):
        return
    endpoint = storage.resolve_endpoint(endpoint_url)
    host = (
        urlparse(endpoint if endpoint and "://" in endpoint else f"https://{endpoint}").hostname if endpoint else None
    )
    try:
        socket.getaddrinfo(host or "s3.amazonaws.com", None)
    except (socket.gaierror, UnicodeError):
        where = f"{host!r} ({endpoint})" if endpoint else "AWS (data.endpoint_url unset)"
        raise storage.StorageError(
            f"data.endpoint_url: {field_name} {uri} is read from {where}, whose host name does not resolve: set "
            "data.endpoint_url=http://HOST:PORT to your S3 server (or AWS_ENDPOINT_URL; `mdc demo` prints its local one)"
        ) from None


def check_data(cfg: RunConfig) -> None:
    """Everything the config and the data's side files tell, in seconds and before Ray starts: the
    S3 host resolves, each location exists, the training folder holds shards, and holds at least one
    global batch when `_stats.json` or the Parquet footers say its size. Each a StorageError or
    ConfigError naming the field and the fix."""
    data = cfg.data
    inputs = (("data.train_uri", data.train_uri), ("data.val_uri", data.val_uri))
    for field_name, uri in (*inputs, ("storage_uri", cfg.storage_uri)):
        check_s3_host(field_name, uri, data.endpoint_url)
    for field_name, uri in inputs:
        if uri is None:
            continue
        try:
            storage.check_reachable(uri, data.endpoint_url)
        except storage.StorageError as err:
            raise storage.StorageError(f"{field_name}: {err} (expected {SHARD_FOLDER})") from None
        try:
            files = shards.list_shards(uri, data.format, data.endpoint_url)
        except storage.StorageError as err:
            raise storage.StorageError(f"{field_name}: {err}") from None
        if field_name == "data.train_uri":
            check_size(cfg, files)
    if storage.is_s3(cfg.storage_uri):
        try:
            storage.check_reachable(cfg.storage_uri, data.endpoint_url, must_exist=False)
        except storage.StorageError as err:
            raise storage.StorageError(f"storage_uri: {err}") from None


def check_size(cfg: RunConfig, files: list[str]) -> None:
    """A ConfigError when the training folder's side files say it holds fewer samples than one
    global batch (a step could never fill)."""
    known = shards.known_size(cfg.data.train_uri, files, cfg.data.endpoint_url)
    if known is None or known[0] >= cfg.global_batch:
        return
    size, source = known
    raise ConfigError(
        f"data.train_uri {cfg.data.train_uri} holds {size} samples ({source}), fewer than one global batch of "
        f"{cfg.global_batch} (train.global_batch_size, default train.batch_size {cfg.train.batch_size} x "
        f"{cfg.workers.max} workers): lower train.batch_size or train.global_batch_size to at most {size}, "
        "or train on more data"
    )


def config_warnings(cfg: RunConfig) -> list[str]:
    """Settings that run but not as meant: said once, on the console, before Ray starts."""
    warnings = []
    if cfg.optim.warmup_steps >= cfg.train.steps:
        warnings.append(
            f"optim.warmup_steps {cfg.optim.warmup_steps} >= train.steps {cfg.train.steps}: the learning rate "
            f"never reaches optim.lr; set optim.warmup_steps below {cfg.train.steps} (e.g. {cfg.train.steps // 10})"
        )
    return warnings


def check_inputs(cfg: RunConfig) -> None:
    """Fail in seconds, before any cluster work, when the data or the checkpoint store cannot be
    reached (`check_data`) or a set of the eval section cannot be read."""
    check_data(cfg)
    from mdc.evaluation import suite  # the evaluation stack: seconds to import, not before a data error

    suite.check_section(cfg.eval, cfg.data.endpoint_url)  # the probe, benchmark and caption folders
