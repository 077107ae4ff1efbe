"""What a person sees on the console: one shared rich Console, the `--verbose` switch, user errors
as one line with exit code 2 instead of a traceback, and failed runs as one line with exit code 1."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

import typer
from rich.console import Console
from rich.text import Text

from mdc.config import ConfigError
from mdc.data.storage import StorageError

console = Console(soft_wrap=True)


class Settings:
    """Process-wide switches set by the command line."""

    verbose = False  # Ray's own output and full tracebacks on the console


VERBOSE_OPTION = typer.Option(False, "--verbose", help="Ray's own output and full tracebacks on the console")


class UserError(ValueError):
    """Something the user gave that cannot be used: the message names it and what was expected."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The user-error classes; the dataset readers' only once loaded (torchvision: seconds to import,
    and a process that never loaded them cannot have raised their error)."""
    readers = sys.modules.get("mdc.evaluation.readers")
    return UserError, ConfigError, StorageError, *((readers.DatasetFormatError,) if readers else ())


def warn(message: str) -> None:
    console.print(Text.assemble(("warning: ", "yellow"), message))


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM (`kill`, `timeout`, a scheduler cancelling the job) stops a command as Ctrl-C does:
    its runs end KILLED in MLflow instead of being left RUNNING by a process that just died."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def user_errors(*also: type[BaseException]):
    """Turn user errors (and the `also` types) into `error: MESSAGE` on one line and exit code 2;
    with --verbose the traceback is printed first. Ctrl-C, or SIGTERM, is one line too, and exit
    code 130."""
    try:
        with terminate_as_interrupt():
            yield
    except KeyboardInterrupt:
        console.print(
            Text.assemble(
                ("interrupted: ", "red"),
                "runs stopped (MLflow: KILLED); the same command resumes them from their checkpoints",
            )
        )
        raise typer.Exit(130) from None
    except RunFailed as err:
        console.print(Text.assemble(("error: ", "red"), str(err)))
        raise typer.Exit(1) from None
    except (*user_error_types(), *also) as err:
        if Settings.verbose:
            console.print_exception()
        console.print(Text.assemble(("error: ", "red"), str(err)))
        raise typer.Exit(2) from None


def first_line_of(error: object) -> str:
    """The line of an error worth showing: its first, or for an error that carries a traceback (a
    remote one, as Ray reports it) the original exception's line after that traceback."""
    while getattr(error, "cause", None) is not None:  # Ray's task errors wrap the original exception
        error = error.cause
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if any(line.startswith('File "') for line in lines):
        return lines[-1]
    return never_at_a_colon(lines)


def never_at_a_colon(lines: list[str]) -> str:
    """The first line, and when it ends at a colon (Ray's "The last 20 lines of …/dashboard.log (it
    contains the error message from the dashboard):") the cause after it: the next line, or for a
    quoted log the last one, where a log's error is. Nothing after it: the colon goes."""
    head, rest = lines[0], lines[1:]
    if not head.endswith(":"):
        return head
    if not rest:
        return head.rstrip(":") + " (no detail given)"
    return f"{head} {rest[0]}" if len(rest) == 1 else f"{head} [...] {rest[-1]}"


class RunFailed(Exception):
    """A run that started and then failed; the message says how and where its traceback is."""


def report_failures(kind: str, total: int, failures: list[tuple[str, str, str]]) -> None:
    """After a sweep or scaling run: `failures` are (name, error line, where its full error is).
    Every run failed: one error line with the first failure, exit code 1. Some failed: a warning
    with how many and where their errors are."""
    if not failures:
        return
    if len(failures) == total:
        name, line, where = failures[0]
        console.print(
            Text.assemble(
                ("error: ", "red"), f"all {total} {kind}s failed; the first, {name}: {line} (full error: {where})"
            )
        )
        raise typer.Exit(1)
    warn(
        f"{len(failures)} of {total} {kind}s failed: "
        + "; ".join(f"{name}: {line} ({where})" for name, line, where in failures)
    )
