"""Where the job runs: an existing Ray cluster, or a local one; a local S3-compatible server.
Also what the driver settles before any worker starts: absolute local paths, and where Ray's own
output goes (a log file, unless --verbose)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import ray
import ray.data
import typer
from ray.util.annotations import RayDeprecationWarning

from mdc.config import RunConfig
from mdc.data import storage
from pipelines import ray_private
from pipelines.console import RunFailed, UserError, console, first_line_of, user_error_types

PROBE_TIMEOUT_S = 3.0
ROUTED_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "mlflow")


def _answers(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


TOKEN_HELP = (
    "give this process the cluster's token: RAY_AUTH_TOKEN=<token>, RAY_AUTH_TOKEN_PATH=<file>, or the file "
    "~/.ray/auth_token (`ray get-auth-token` on the head prints it)"
)


def auth_token() -> str | None:
    """The Ray token this process holds, looked up where Ray looks: RAY_AUTH_TOKEN, the file
    RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    return (path.read_text().strip() or None) if path.is_file() else None


def send_token() -> None:
    """Before joining a cluster: Ray sends its token only under RAY_AUTH_MODE=token and never turns
    that on by itself for an explicit address, so turn it on when this process holds a token. An
    RAY_AUTH_MODE the user set is left as it is."""
    if "RAY_AUTH_MODE" in os.environ or auth_token() is None:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    ray_private.reread_config()  # Ray read its config at import: read it again with the mode set


def _join(address: str) -> None:
    """ray.init on a cluster that answers; a refusal (Ray says only that it failed, after ~20 s of
    retries) is one line on how to give the token, since the address itself answered."""
    send_token()
    try:
        ray.init(address=address)
    except ConnectionError:
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        held = "no token" if auth_token() is None or mode == "disabled" else "a token it does not accept"
        raise UserError(
            f"the Ray cluster at {address} answers but refused to let this driver join (RAY_AUTH_MODE {mode}, "
            f"{held}); it most likely uses token authentication: {TOKEN_HELP}"
        ) from None
    _LogRoute.install()


def connect_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS), or the one Ray's current-cluster file names,
    else start a local instance. Idempotent. Decides in seconds: a named address that does not
    answer is a UserError; a stale current-cluster file (its head is gone) is said in one line
    and a local instance is started. Other clusters merely running on this machine are not joined.
    A joined cluster gets this process's token (`send_token`); a local instance keeps Ray's own
    token authentication (on by default since Ray 2.59)."""
    if ray.is_initialized():
        return
    named = address or os.environ.get("RAY_ADDRESS")
    if named and named not in ("auto", "local"):
        target = _host_port(named)
        if target and not _answers(*target):
            raise UserError(
                f"no Ray cluster answers at {named} (TCP {target[0]}:{target[1]} refused or timed "
                f"out in {PROBE_TIMEOUT_S:.0f} s): start it (`ray start --head`) or drop --address / "
                "RAY_ADDRESS to run on a local instance"
            )
        _join(named)
        return
    recorded = ray_private.recorded_address()
    if named != "local" and recorded:
        target = _host_port(recorded)
        if target and _answers(*target):
            _join(recorded)
            return
        console.print(
            f"Ray's current-cluster file names {recorded}, where nothing answers: starting a local Ray instance"
        )
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=512 * 1024**2, include_dashboard=True)
    _LogRoute.install()


def absolute_uri(uri: str | None) -> str | None:
    """A local path made absolute; URIs (s3://, sqlite://, ...) and None unchanged."""
    if uri is None or "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """The config with every local path absolute (data, storage, MLflow store): workers and Tune
    trials run in other working directories, so a relative path would name another place there."""
    from pipelines import tracking  # MLflow takes seconds to import: not before a user error

    raw = cfg.model_dump()
    raw["storage_uri"] = absolute_uri(raw["storage_uri"])
    raw["mlflow_uri"] = tracking.absolute_tracking_uri(raw["mlflow_uri"])
    for key in ("train_uri", "val_uri"):
        raw["data"][key] = absolute_uri(raw["data"][key])
    raw["eval"]["data_uri"] = absolute_uri(raw["eval"]["data_uri"])
    return RunConfig.model_validate(raw)


def check_inputs(cfg: RunConfig) -> None:
    """Fail in seconds, before any cluster work, when the data or the checkpoint store cannot be
    reached: a StorageError that names the config field, the location and what was expected."""
    data = cfg.data
    shard_folder, held_out = (
        "a folder of .tar or .parquet shards",
        "a folder holding train/, val/ and compositionality/",
    )
    inputs = (
        ("data.train_uri", data.train_uri, shard_folder),
        ("data.val_uri", data.val_uri, shard_folder),
        ("eval.data_uri", cfg.eval.data_uri, held_out),
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


def run_log_path(cfg: RunConfig) -> Path:
    """Where Ray's output for this run goes: beside its checkpoints when they are local, else in
    ./mdc-logs (checkpoints in S3)."""
    folder = Path(cfg.storage_uri) / cfg.name if "://" not in cfg.storage_uri else Path("mdc-logs") / cfg.name
    return folder.resolve() / "ray.log"


class _LogRoute:
    """The active redirection of the workers' forwarded output (at most one per process)."""

    handler = None  # called with each batch of forwarded lines
    replaced = False  # Ray's own printer was taken out and must be put back

    @classmethod
    def install(cls) -> None:
        """Swap Ray's printer of forwarded worker output for ours; Ray adds its printer in ray.init,
        so this runs on entering ray_output_to and again after connect_ray."""
        if cls.handler is None or not ray.is_initialized():
            return
        cls.replaced |= ray_private.has_ray_printer()
        ray_private.set_output_handler("mdc_log_file", cls.handler)

    @classmethod
    def uninstall(cls) -> None:
        ray_private.remove_output_handler("mdc_log_file", restore_ray_printer=cls.replaced)
        cls.handler, cls.replaced = None, False


@contextlib.contextmanager
def ray_output_to(log_file: Path):
    """While inside, Ray's output goes to `log_file` instead of the console: the workers' forwarded
    stdout/stderr, the raylet's notices, Ray's (and MLflow's) Python loggers in this process, Ray
    Data's progress bars, and what Ray's C++ core writes to this process's stderr (fd 2; Python's
    sys.stderr stays on the console). Lines that workers print with an `[mdc] ` prefix (rank 0's
    notices) still reach the console, once each."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a", buffering=1) as sink, contextlib.ExitStack() as stack:
        route = _router(sink)
        stack.enter_context(_loggers_to(sink))
        data_context = ray.data.DataContext.get_current()
        bars, data_context.enable_progress_bars = data_context.enable_progress_bars, False
        stack.callback(setattr, data_context, "enable_progress_bars", bars)
        stack.enter_context(ray_private.raylet_notices_to(route))
        _LogRoute.handler = route
        _LogRoute.install()
        stack.callback(_LogRoute.uninstall)
        stack.enter_context(_fd2_to(sink))
        yield log_file


def _router(sink):
    """Forwarded lines into `sink`; `[mdc] ` ones also on the console, once each."""
    last_shown = [None]

    def route(data: dict) -> None:
        who = data.get("actor_name") or data.get("task_name") or ""
        for line in data.get("lines", []) if not sink.closed else []:
            sink.write(f"({who} pid={data.get('pid')}) {line}\n")
            if line.startswith("[mdc] ") and line != last_shown[0]:  # Train V2 forwards each line twice
                last_shown[0] = line
                console.print(line.removeprefix("[mdc] "), markup=False, highlight=False)

    return route


@contextlib.contextmanager
def _loggers_to(sink):
    """Ray's and MLflow's Python loggers write to `sink` instead of the console."""
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    swapped = []
    for name in ROUTED_LOGGERS:
        logger = logging.getLogger(name)
        for old in [
            h for h in logger.handlers if type(h) in (logging.StreamHandler,) or type(h).__name__ == "PlainRayHandler"
        ]:
            logger.removeHandler(old)
            swapped.append((logger, old))
        if name == "ray" or not logger.propagate:
            logger.addHandler(handler)
            swapped.append((logger, None))
    try:
        yield
    finally:
        for logger, old in swapped:
            if old is None:
                logger.removeHandler(handler)
            else:
                logger.addHandler(old)


@contextlib.contextmanager
def _fd2_to(sink):
    """File descriptor 2 (where Ray's C++ core writes) into `sink`; Python's sys.stderr stays."""
    sys.stderr.flush()
    saved_fd2, real_stderr = os.dup(2), sys.stderr
    os.dup2(sink.fileno(), 2)
    sys.stderr = os.fdopen(os.dup(saved_fd2), "w", buffering=1)
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = real_stderr
        os.dup2(saved_fd2, 2)
        os.close(saved_fd2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_s3_server():
    """A moto S3 server on 127.0.0.1 in a subprocess, always stopped on exit. Yields its endpoint
    URL and sets throwaway credentials in this process's environment (moto accepts any)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"local S3 server did not start on {endpoint}")
            time.sleep(0.2)
        for key, value in {
            "AWS_ACCESS_KEY_ID": "local",
            "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            os.environ.setdefault(key, value)
        yield endpoint
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


def create_bucket(endpoint_url: str, bucket: str) -> None:
    import boto3  # only for the local S3 server of the demo and the tests

    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)


@contextlib.contextmanager
def ray_session(log_file: Path, address: str | None = None, verbose: bool = False, num_cpus: int | None = None):
    """Connected to Ray for the duration, with Ray's output in `log_file` (said on the console
    first) unless `verbose`. Then an error that is not the user's becomes RunFailed, one line,
    its traceback appended to `log_file`."""
    if verbose:
        connect_ray(address, num_cpus)
        yield
        return
    console.print(f"Ray's own output goes to {log_file} (--verbose shows it here)", highlight=False)
    with ray_output_to(log_file), warnings.catch_warnings():
        # Ray Train sets an execution option Ray Data deprecated: Ray's business, not the user's
        warnings.filterwarnings("ignore", r".*exclude_resources", RayDeprecationWarning)
        try:
            connect_ray(address, num_cpus)
            yield
        except Exception as err:
            if isinstance(err, (typer.Exit, *user_error_types())):
                raise
            with open(log_file, "a") as log:
                traceback.print_exc(file=log)
            raise RunFailed(f"{type(err).__name__}: {first_line_of(err)} (traceback in {log_file})") from err
