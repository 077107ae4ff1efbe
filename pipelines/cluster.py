"""How runs fill a cluster: how many train at once, running them so, and where the driver's own
helpers live.

- `fitting_runs`: as many runs at once as the cluster's free CPUs and GPUs hold, each run needing
  its training workers (num_workers × cpus_per_worker, and a GPU each with use_gpu) plus its ingest
  CPUs (data.ingest_cpus, else one reader's CPU). A 2-core machine with the default config fits 1.
- `run_all`: calls the runs' functions, at most N at once, each in its own driver thread; every
  run is still its own Ray Train job (its own `TorchTrainer.fit`, its own MLflow child run) and
  Ray places each worker group where it fits. Results come back in the order given, whatever the
  order of finishing.
- `share_ingest`: a run's ingest CPUs when N runs share the cluster (what its share leaves beside
  its workers), so that N runs never ask for more than the cluster has.
- `on_driver_node`: the scheduling strategy that keeps a driver-side actor (progress channel,
  bad-record ledger, passed-over shards) on the driver's node: a lost worker node must not take
  them along, since the run they serve goes on.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mdc.config import ConfigError, RunConfig, derive

READER_CPUS = 1.0  # what a run's ingest needs at least when data.ingest_cpus is not set: one reader
EPS = 1e-9
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Pins an actor to the node this driver runs on (hard affinity: never elsewhere)."""
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def run_resources(cfg: RunConfig) -> dict[str, float]:
    """What one run holds while it trains: CPUs for its workers and its ingest, GPUs for its workers."""
    train = cfg.train
    ingest = cfg.data.ingest_cpus if cfg.data.ingest_cpus is not None else READER_CPUS
    workers = train.max_workers  # an elastic run grows to its largest group when it can
    return {"CPU": workers * train.cpus_per_worker + ingest, "GPU": float(workers * train.use_gpu)}


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
    left = cpus / max_concurrent - cfg.train.max_workers * cfg.train.cpus_per_worker
    if left < 0.01:
        raise ConfigError(
            f"--max-concurrent {max_concurrent}: {cpus:g} CPUs shared by {max_concurrent} runs leave no CPU for "
            f"data ingest beside {cfg.train.max_workers} × {cfg.train.cpus_per_worker:g} CPUs of workers; "
            "run fewer at once, or set data.ingest_cpus"
        )
    return math.floor(left * 100) / 100


def plan_concurrency(cfgs: dict[K, RunConfig], requested: int | None) -> tuple[int, dict[K, RunConfig]]:
    """(runs at once, each run's config with its ingest share) for the runs still to train, and a
    line on the console saying how many and why."""
    from pipelines.console import console  # rich: only where a line is said

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
    """Every call's result, by key, in the order given. One at a time in this thread when
    `max_concurrent` is 1; else at most `max_concurrent` at once in driver threads. The first
    error stops the calls not started yet, lets the running ones finish (their results are kept
    where they keep them) and is raised."""
    if max_concurrent <= 1 or len(calls) <= 1:
        return {key: call() for key, call in calls.items()}
    pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="mdc-run")
    try:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures.values() if f in done and f.exception() is not None), None)
        if failed is not None:
            for future in futures.values():
                future.cancel()
            wait(futures.values())
            raise failed.exception()
        return {key: future.result() for key, future in futures.items()}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # an interrupt leaves: the running runs' threads end with them


_LOCK = threading.Lock()


def serialized() -> threading.Lock:
    """One lock for work in the driver that must not overlap between runs (in-process evaluations
    seed torch's global generator)."""
    return _LOCK
