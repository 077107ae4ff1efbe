"""Live training progress on the driver's console, one line per run.

Rank 0 of each run pushes its step metrics and its notices (checkpoint, validation, warnings) to a
small actor, `ProgressChannel`; the driver's `ProgressDisplay` polls it and draws a rich progress bar
per run on a terminal, or prints one line per logged step elsewhere (CI, pipes, log files). One
channel can serve several runs at once (the trials of a sweep, the sizes of a scaling run, a study):
the driver creates it, hands it to every run, and keeps one display open over all of them.
"""

from __future__ import annotations

import contextlib
import threading
import time

import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

POLL_S = 0.5
DATA_WAIT_WARNING = 0.10  # share of step time spent waiting for batches worth telling the user about


@ray.remote(num_cpus=0)
class ProgressChannel:
    """A mailbox: workers push events, the driver drains them."""

    def __init__(self):
        self.events = []

    def push(self, event: dict) -> None:
        self.events.append(event)

    def drain(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def open_channel():
    """A channel on the driver's node: a lost worker node does not take the display with it."""
    from pipelines.infra.actors import on_driver_node  # here: the channel's own process loads no model stack

    return ProgressChannel.options(scheduling_strategy=on_driver_node()).remote()


@contextlib.contextmanager
def shared(max_concurrent: int, console: Console):
    """For runs that train at once: one channel they all report to and one display of them all
    (yielded); None when they go one at a time and each draws its own."""
    if max_concurrent <= 1:
        yield None
        return
    channel = open_channel()
    with ProgressDisplay(channel, console):
        yield channel


class Reporter:
    """Rank 0's side of a channel for one run; sends without waiting (a lost event costs nothing)."""

    def __init__(self, channel, run: str, total: int):
        self.channel, self.run, self.total, self.first = channel, run, total, True

    def step(self, step: int, metrics: dict, logged: bool) -> None:
        """Every step moves the bar; the first and the `logged` steps also print a line where there
        is no live bar (so the wait for the workers ends visibly)."""
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self.channel.push.remote(
            {
                "run": self.run,
                "kind": "step",
                "step": step,
                "total": self.total,
                "metrics": numbers,
                "logged": logged or self.first,
            }
        )
        self.first = False

    def note(self, text: str, warning: bool = False) -> None:
        self.channel.push.remote({"run": self.run, "kind": "note", "text": text, "warning": warning})


def stats_text(metrics: dict) -> str:
    """`loss 5.2301  lr 1.00e-03  12.3 img/s  data wait 4%`, with the fields the metrics hold."""
    parts = []
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    if "lr" in metrics:
        parts.append(f"lr {metrics['lr']:.2e}")
    if "images_per_s" in metrics:
        parts.append(f"{metrics['images_per_s']:.1f} img/s")
    if "data_wait_fraction" in metrics:
        parts.append(f"data wait {metrics['data_wait_fraction']:.0%}")
    return "  ".join(parts)


def step_line(run: str, step: int, total: int, metrics: dict, eta_s: float | None) -> str:
    """The line printed per logged step where there is no live bar."""
    eta = f"ETA {int(eta_s) // 60}:{int(eta_s) % 60:02d}" if eta_s is not None else ""
    return "  ".join(filter(None, [f"{run} step {step}/{total}", stats_text(metrics), eta]))


class ProgressDisplay:
    """Driver side: polls the channel in a thread while the runs train. Use as a context manager."""

    def __init__(self, channel, console: Console):
        self.channel, self.console = channel, console
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.tasks, self.started, self.latest, self.warned = {}, {}, {}, set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="mdc-progress", daemon=True)

    def __enter__(self) -> ProgressDisplay:
        if self.live:
            self.progress.start()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        try:
            self._show(ray.get(self.channel.drain.remote(), timeout=10))
        except Exception as err:  # the display's last events are not worth failing a finished run
            self.print(f"(progress display: last events lost: {type(err).__name__})")
        if self.live:
            self.progress.stop()

    def print(self, text: str | Text) -> None:
        (self.progress.console if self.live else self.console).print(text, highlight=False)

    def _poll(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                self._show(ray.get(self.channel.drain.remote(), timeout=10))
            except Exception as err:  # a display must never kill the run it shows
                self.print(f"(progress display stopped: {err})")
                return

    def _show(self, events: list[dict]) -> None:
        for event in events:
            run = event["run"]
            if event["kind"] == "note":
                style = "yellow" if event["warning"] else "cyan"
                self.print(Text.assemble((f"{run}: ", style), event["text"]))
                continue
            step, total, metrics = event["step"], event["total"], event["metrics"]
            self.latest.setdefault(run, {}).update(metrics)
            first_time, first_step = self.started.setdefault(run, (time.monotonic(), step))
            eta = None
            if step > first_step:
                eta = (total - step) * (time.monotonic() - first_time) / (step - first_step)
            self._warn_data_wait(run, metrics)
            if self.live:
                if run not in self.tasks:
                    self.tasks[run] = self.progress.add_task(run, total=total, stats="")
                self.progress.update(self.tasks[run], completed=step, stats=stats_text(self.latest[run]))
            elif event["logged"]:
                self.print(step_line(run, step, total, self.latest[run], eta))

    def _warn_data_wait(self, run: str, metrics: dict) -> None:
        wait = metrics.get("data_wait_fraction")
        if wait is not None and wait > DATA_WAIT_WARNING and run not in self.warned:
            self.warned.add(run)
            self.print(
                Text.assemble(
                    (f"{run}: ", "yellow"),
                    f"waiting for data {wait:.0%} of the step time: the "
                    "input pipeline is the bottleneck (more CPUs for ingest: docs/clusters.md, cores per GPU)",
                )
            )
