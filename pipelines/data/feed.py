"""The worker's end of ingest: batches handed over one ahead by a thread, the time spent waiting
for them (the data wait), and a stall turned into an error that says which Ray Data operator has
produced nothing and what it asks for, instead of a silent hang."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import ray

from pipelines.data.ingest import IngestResources
from pipelines.infra import ray_private


class DataStallError(RuntimeError):
    """No batch reached a training worker within data.stall_timeout_s; the message says why."""


def stalled_operator() -> str:
    """The first operator of the newest running training dataset that has completed no task,
    from Ray Data's own progress records (what its progress bar shows)."""
    try:
        stats = ray_private.data_stats_actor()
        datasets = ray.get(stats.get_datasets.remote(), timeout=10)
    except Exception as e:  # a diagnosis must never hide the stall it explains
        return f"Ray Data's progress is unavailable ({type(e).__name__})"
    # PENDING too: Ray Data publishes progress every 5 s, so a young dataset may not show RUNNING yet
    running = [d for tag, d in datasets.items() if d.get("state") in ("PENDING", "RUNNING") and tag.startswith("train")]
    if not running:
        return "no training dataset is running in Ray Data"
    newest = max(running, key=lambda d: d.get("start_time", 0))
    for tag, op in newest["operators"].items():
        name = op.get("name") or tag.rsplit("_", 1)[0]  # tags are NAME_INDEX
        if op.get("progress", 0) == 0 and not name.startswith("Input"):
            return f"Ray Data operator {name} has produced no rows ({op.get('queued_blocks', 0)} input blocks queued)"
    return "every Ray Data operator has produced rows, but none reached this worker"


def describe_stall(uri: str, timeout_s: float, rank: int, resources: IngestResources, training_cpus: float) -> str:
    total, free = ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0)
    return (
        f"no batch from {uri} reached training worker {rank} in {timeout_s:g} s (data.stall_timeout_s): "
        f"{stalled_operator()}; ingest requests {resources.cpus_per_reader:g} CPU per reader "
        f"(up to {resources.max_readers}, budget {resources.budget:g}) and {free:g} of the cluster's "
        f"{total:g} CPUs are free, {training_cpus:g} held by the training workers"
    )


class BatchFeed:
    """Batches handed over one ahead by a thread. A pipeline that yields nothing for `timeout_s`
    raises DataStallError(describe()) instead of waiting for ever, and `wait_s` adds up the time
    the consumer spent waiting for batches: its data wait."""

    def __init__(self, timeout_s: float, describe: Callable[[], str]):
        self.timeout_s, self.describe, self.wait_s = timeout_s, describe, 0.0

    def __call__(self, batches: Iterable) -> Iterator:
        handoff: queue.Queue = queue.Queue(maxsize=1)
        stop, end = threading.Event(), object()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=1.0)
                    return True
                except queue.Full:
                    continue
            return False

        def pull() -> None:
            try:
                for batch in batches:
                    if not put(batch):
                        return
                put(end)
            except BaseException as e:  # re-raised in the consumer
                put(e)

        threading.Thread(target=pull, name="batch-feed", daemon=True).start()
        try:
            while True:
                start = time.perf_counter()
                try:
                    item = handoff.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise DataStallError(self.describe()) from None
                finally:
                    self.wait_s += time.perf_counter() - start
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
