"""Where the job runs: the Ray cluster at an address (with this process's token), the one Ray's
current-cluster file names, or a local instance; and a Ray session for a command, its output routed
(pipelines/infra/ray_output.py) and its failures made one line."""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
import warnings
from pathlib import Path

import ray
import typer
from ray.util.annotations import RayDeprecationWarning

from pipelines.infra import ray_private
from pipelines.infra.console import RunFailed, UserError, console, first_line_of, user_error_types
from pipelines.infra.ray_output import install_output_route, ray_output_to

PROBE_TIMEOUT_S = 3.0
FRESH_HINT = "`--address local` (or RAY_ADDRESS=local) starts a fresh local instance instead"


class Joined:
    """The cluster this process joined rather than started (None: its own local instance)."""

    address: str | None = None


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


def _join(address: str, why: str) -> None:
    """ray.init on a cluster that answers, said in one line (`why`: what named it); a refusal (Ray
    says only that it failed, after ~20 s of retries) is one line on how to give the token, since
    the address itself answered."""
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
    Joined.address = address
    console.print(f"joined the Ray cluster at {address} ({why}); {FRESH_HINT}", highlight=False)
    install_output_route()


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
        _join(named, "--address" if address else "RAY_ADDRESS")
        return
    recorded = ray_private.recorded_address()
    if named != "local" and recorded:
        target = _host_port(recorded)
        if target and _answers(*target):
            _join(recorded, "the live cluster Ray's current-cluster file names")
            return
        console.print(
            f"Ray's current-cluster file names {recorded}, where nothing answers: starting a local Ray instance"
        )
    Joined.address = None  # its own instance: it ends with this process, never under it
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=512 * 1024**2, include_dashboard=True)
    install_output_route()


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
            if went_away():
                raise RunFailed(
                    f"the Ray cluster at {Joined.address} went away (traceback in {log_file}); {FRESH_HINT}"
                ) from err
            raise RunFailed(f"{type(err).__name__}: {first_line_of(err)} (traceback in {log_file})") from err


def went_away() -> bool:
    """Whether the cluster this process joined no longer answers (its end, not the run's error,
    is then what the user needs to hear: not an actor's traceback)."""
    target = _host_port(Joined.address) if Joined.address else None
    return target is not None and not _answers(*target, timeout=1.0)
