"""Where Ray's own output goes while a command runs: a log file (unless --verbose), with rank 0's
`[mdc] ` notices still on the console."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import ray
import ray.data

from mdc.config import RunConfig
from pipelines.infra import ray_private
from pipelines.infra.console import console

ROUTED_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "mlflow")


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
        so this runs on entering ray_output_to and again after each ray.init (connect_ray)."""
        if cls.handler is None or not ray.is_initialized():
            return
        cls.replaced |= ray_private.has_ray_printer()
        ray_private.set_output_handler("mdc_log_file", cls.handler)

    @classmethod
    def uninstall(cls) -> None:
        ray_private.remove_output_handler("mdc_log_file", restore_ray_printer=cls.replaced)
        cls.handler, cls.replaced = None, False


def install_output_route() -> None:
    """After ray.init: the active route (if any) takes over from the printer Ray just added."""
    _LogRoute.install()


_UNTIL_EXIT: list[contextlib.ExitStack] = []  # the routes a Ctrl-C left in place


@contextlib.contextmanager
def ray_output_to(log_file: Path):
    """While inside, Ray's output goes to `log_file` instead of the console: the workers' forwarded
    stdout/stderr, the raylet's notices, Ray's (and MLflow's) Python loggers in this process, Ray
    Data's progress bars, and what Ray's C++ core writes to this process's stderr (fd 2; Python's
    sys.stderr stays on the console). Lines that workers print with an `[mdc] ` prefix (rank 0's
    notices) still reach the console, once each. Left by Ctrl-C, nothing is undone: the process is
    ending, and what Ray says until it has (its exit handler ending the Ray Train jobs, the runs'
    threads) goes to `log_file`, not after the console's "interrupted" line."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        sink = open(log_file, "a", buffering=1)
        stack.callback(sink.close)
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
        try:
            yield log_file
        except KeyboardInterrupt:
            _UNTIL_EXIT.append(stack.pop_all())  # held: a collected stack's generators would undo the route
            raise


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
