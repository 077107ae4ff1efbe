"""How runs fill a cluster: how many train at once, running them so, and where the driver's own
helpers live.

- `fitting_runs`: as many runs at once as the cluster's free CPUs and GPUs hold, each run needing
  its training workers (workers.count × workers.cpus, and a GPU each with workers.use_gpu), its ingest
  CPUs (data.ingest_cpus, else one reader's CPU) and its online evaluation's bundle (eval.cpus,
  eval.gpus). A 2-core machine with the default config fits 1.
- `run_all`: calls the runs' functions, at most N at once (one too), each in a driver thread; every
  run is still its own Ray Train job (its own `TorchTrainer.fit`, its own MLflow child run) and
  Ray places each worker group where it fits. Results come back in the order given, whatever the
  order of finishing. Ctrl-C stops them all at once: the runs not started are cancelled, the
  MLflow runs end KILLED, and the process exits without waiting for the running ones, whose Ray
  Train jobs end with this driver; the same command resumes them from their checkpoints.
  `interruptible` is one call so (`mdc train`, the demo).
- `share_ingest`: a run's ingest CPUs when N runs share the cluster (what its share leaves beside
  its workers and its evaluation bundle), so that N runs never ask for more than the cluster has.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import TypeVar

import ray

from mdc.config import ConfigError, RunConfig, derive
from pipelines.run import online_eval

READER_CPUS = 1.0  # what a run's ingest needs at least when data.ingest_cpus is not set: one reader
EPS = 1e-9
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def run_resources(cfg: RunConfig) -> dict[str, float]:
    """What one run holds while it trains: CPUs for its workers, its ingest and its online
    evaluation's bundle, GPUs for its workers and that bundle."""
    workers, evaluation = cfg.workers, online_eval.bundle(cfg)
    ingest = cfg.data.ingest_cpus if cfg.data.ingest_cpus is not None else READER_CPUS
    largest = workers.max  # an elastic run grows to its largest group when it can
    return {
        "CPU": largest * workers.cpus + ingest + evaluation.get("CPU", 0.0),
        "GPU": largest * workers.use_gpu + evaluation.get("GPU", 0.0),
    }


def fitting_runs(cfgs: Sequence[RunConfig], available: dict[str, float] | None = None) -> int:
    """How many of these runs the cluster's free resources hold at once (at least 1, at most all of
    them); `available` defaults to `ray.available_resources()`."""
    if not cfgs:
        return 1
    free = ray.available_resources() if available is None else available
    needs = [run_resources(cfg) for cfg in cfgs]
    fits = len(cfgs)
    for resource in ("CPU", "GPU"):
        need = max(n[resource] for n in needs)
        if need > 0:
            fits = min(fits, math.floor(free.get(resource, 0.0) / need + EPS))
    return max(1, fits)


def resolve_max_concurrent(requested: int | None, cfgs: Sequence[RunConfig]) -> int:
    """The --max-concurrent given, else what fits the cluster; never more than there are runs."""
    if requested is not None and requested < 1:
        raise ConfigError(f"--max-concurrent must be >= 1, got {requested}")
    n = requested if requested is not None else fitting_runs(cfgs)
    return max(1, min(n, len(cfgs) or 1))


def share_ingest(cfg: RunConfig, max_concurrent: int, cluster_cpus: float | None = None) -> float | None:
    """data.ingest_cpus for one of `max_concurrent` runs sharing the cluster: the set value, else
    what 1/max_concurrent of the cluster's CPUs leaves beside the run's workers (None, the
    default, when the run has the cluster to itself)."""
    if max_concurrent <= 1 or cfg.data.ingest_cpus is not None:
        return cfg.data.ingest_cpus
    cpus = ray.cluster_resources().get("CPU", 0.0) if cluster_cpus is None else cluster_cpus
    evaluation = online_eval.bundle(cfg).get("CPU", 0.0)
    left = cpus / max_concurrent - cfg.workers.max * cfg.workers.cpus - evaluation
    if left < 0.01:
        beside = f" and {evaluation:g} for online evaluation (eval.cpus)" if evaluation else ""
        raise ConfigError(
            f"--max-concurrent {max_concurrent}: {cpus:g} CPUs shared by {max_concurrent} runs leave no CPU for "
            f"data ingest beside {cfg.workers.max} × {cfg.workers.cpus:g} CPUs of workers{beside}; "
            "run fewer at once, or set data.ingest_cpus"
        )
    return math.floor(left * 100) / 100


def plan_concurrency(cfgs: dict[K, RunConfig], requested: int | None) -> tuple[int, dict[K, RunConfig]]:
    """(runs at once, each run's config with its ingest share) for the runs still to train, and a
    line on the console saying how many and why."""
    from pipelines.infra.console import console  # rich: only where a line is said

    n = resolve_max_concurrent(requested, list(cfgs.values()))
    if cfgs:
        free = ray.available_resources()
        need = run_resources(next(iter(cfgs.values())))
        how = "--max-concurrent" if requested is not None else "what fits"
        console.print(
            f"{n} run(s) at once ({how}: {free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs free; "
            f"a run needs {need['CPU']:g} CPUs, {need['GPU']:g} GPUs)",
            highlight=False,
        )
    if n > 1:
        cfgs = {key: derive(cfg, {"data.ingest_cpus": share_ingest(cfg, n)}) for key, cfg in cfgs.items()}
    return n, cfgs


def run_all(calls: dict[K, Callable[[], T]], max_concurrent: int) -> dict[K, T]:
    """Every call's result, by key, in the order given, at most `max_concurrent` at once in driver
    threads (one at a time too: in the main thread, Ray Train's fit would take Ctrl-C and end the
    run FAILED or leave it RUNNING, its parent FAILED). The first
    error stops the calls not started yet, lets the running ones finish (their results are kept
    where they keep them) and is raised. Ctrl-C (KeyboardInterrupt, which reaches the main thread
    only) cancels the calls not started, marks the MLflow runs this process opened KILLED and is
    raised at once: the threads are daemons, so the interpreter exits without waiting for them,
    and Ray's exit handler then ends this driver's Ray Train jobs."""
    futures = {key: Future() for key in calls}
    queue = list(calls.items())
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                key, call = queue.pop(0)  # atomic: each call is taken once
            except IndexError:
                return
            if futures[key].set_running_or_notify_cancel():
                try:
                    futures[key].set_result(call())
                except BaseException as err:
                    futures[key].set_exception(err)

    for i in range(
        max(1, min(max_concurrent, len(calls)))
    ):  # daemons: a ThreadPoolExecutor's threads are joined before exit
        threading.Thread(target=work, name=f"mdc-run-{i}", daemon=True).start()
    try:
        failed, pending = None, True
        while failed is None and pending:  # waits of 1 s: Ctrl-C is raised here whichever thread took the signal
            done, pending = wait(futures.values(), timeout=1.0, return_when=FIRST_EXCEPTION)
            failed = next((f for f in done if not f.cancelled() and f.exception() is not None), None)
        if failed is not None:
            _interrupt(stop, futures.values(), kill_runs=False)
            wait([f for f in futures.values() if not f.cancelled()])  # the running ones
            raise failed.exception()
    except KeyboardInterrupt:
        _interrupt(stop, futures.values())
        raise
    return {key: future.result() for key, future in futures.items()}


def interruptible(call: Callable[[], T]) -> T:
    """`call()` in a driver thread, as `run_all` runs it: Ctrl-C ends its MLflow runs KILLED and
    returns at once."""
    return run_all({0: call}, 1)[0]


def _interrupt(stop: threading.Event, futures, kill_runs: bool = True) -> None:
    """No call starts any more; with `kill_runs` (Ctrl-C) the open MLflow runs end KILLED."""
    stop.set()
    for future in futures:
        future.cancel()
    if kill_runs:
        from pipelines.infra import tracking  # MLflow: imported where runs are marked

        tracking.kill_open_runs()


_LOCK = threading.Lock()


def serialized() -> threading.Lock:
    """One lock for work in the driver that runs better one at a time: in-process evaluations,
    which would share the driver's cores."""
    return _LOCK
