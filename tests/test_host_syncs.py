"""The worker's step loop makes no host sync of any kind, and runs no collective, on the steps it
does not log (docs/design.md §11): a short run of the real `Trainer` in one process, on a
one-process gloo group, under `SyncCounter` (tests/sync_counter.py), which counts every op that
waits for the device — scalar reads, data-dependent shapes, boolean-mask indexing, device-to-host
copies, collectives — over the whole step, the data cursor's work for its batch included. Each
kind has a positive control: put into a step, it is counted in that step."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from helpers import local_trainer
from mlflow.tracking import MlflowClient
from sync_counter import SyncCounter, sync_kind

import mdc.objectives.positions as positions
import mdc.training.step as step_module

pytestmark = pytest.mark.timeout(300)

STEPS, LOG_EVERY = 7, 3


def counted_run(trainer, counter: SyncCounter) -> None:
    """`trainer.run()` under `counter`, each sync charged to the step whose batch it serves: the
    data cursor's work for a batch runs before that step's `train_step`."""
    step_once = trainer.run_step

    def counted_step(batch):
        counter.step = trainer.step + 1
        step_once(batch)
        counter.step = trainer.step + 1  # the cursor's next batch is the next step's

    trainer.run_step = counted_step
    trainer.restore()
    counter.step = 1
    with counter:
        trainer.run()


@pytest.fixture(autouse=True)
def accelerator_path(monkeypatch):
    """The accelerator's path, on the CPU: the losses project every position (on a CPU they project
    only the scored ones, by a boolean index: host and device are one there, nothing waits)."""
    monkeypatch.setattr(positions, "projects_every_position", lambda device: True)


@pytest.mark.parametrize("objective", ["mdc", "cmlm", "bert", "ar", "cappa", "clip"])
def test_no_host_sync_nor_collective_on_steps_that_do_not_log(gloo_process_group, tmp_path, objective):
    trainer = local_trainer(tmp_path, STEPS, LOG_EVERY, "data.augment=crop", f"objective.name={objective}")
    counter = SyncCounter()
    counted_run(trainer, counter)

    logged = [s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS]
    quiet = {s: counter.syncs.get(s, []) for s in range(1, STEPS + 1) if s not in logged}
    assert quiet == {s: [] for s in quiet}
    # a log step that saves nothing: one reduction of every buffered step's metrics, one read back
    assert [op for _, op, _ in counter.syncs[LOG_EVERY]] == ["c10d.allreduce_.default", "Tensor.tolist"]
    assert [r["step"] for r in trainer.session.reports] == logged
    history = MlflowClient(trainer.cfg.mlflow_uri).get_metric_history(trainer.metrics.mlflow.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))  # every step's loss, written at log steps
    assert [e["step"] for e in trainer.events if e["kind"] == "step"] == logged


def isfinite_branch(loss):
    if not torch.isfinite(loss):  # `bool` of a device tensor
        raise FloatingPointError


def meta_to_host(loss):
    """A device-to-host copy: the only device a CPU-only run has is "meta", which cannot be read."""
    with contextlib.suppress(NotImplementedError):
        torch.empty(1, device="meta").to("cpu")


def bool_index_put(loss):
    x = loss.detach().reshape(1).clone()
    x[x > 0] = 0


# each injected into one step's loss, in this order: the kind the counter must charge to that step
INJECTED = [
    ("scalar read", isfinite_branch),
    ("scalar read", lambda loss: [0, 1][(loss > 0).long()]),  # __index__
    ("scalar read", lambda loss: float(loss)),
    ("data-dependent shape", lambda loss: loss.reshape(1).nonzero()),
    ("data-dependent shape", lambda loss: loss.reshape(1).masked_select(loss.reshape(1) > 0)),
    ("boolean index", lambda loss: loss.reshape(1)[loss.reshape(1) > 0]),
    ("boolean index", bool_index_put),
    ("device-to-host copy", meta_to_host),
    ("collective", lambda loss: dist.all_reduce(loss.detach().clone())),
    ("host read", lambda loss: loss.tolist()),
    ("host read", lambda loss: loss.detach().cpu()),
]


class ReadingFeed:
    """The cursor's `BatchFeed`, reading a value of its step number `at` on the training thread."""

    def __init__(self, feed, at: int):
        self.feed, self.at = feed, at

    @property
    def wait_s(self) -> float:
        return self.feed.wait_s

    def __call__(self, batches):
        for i, batch in enumerate(self.feed(batches)):
            if i == self.at:
                int(batch.pad["tokens"][0, 0])
            yield batch


def test_every_kind_of_sync_put_into_a_step_is_counted_in_that_step(gloo_process_group, tmp_path, monkeypatch):
    """Step i + 1 runs INJECTED[i] on its loss; the step after them reads a batch value in the data
    cursor, on the training thread, before the step begins; the last step logs. (The feed's thread,
    one step ahead, is not counted: a sync there — the ranks' agreement that the step exists, on a
    CPU group, pipelines/data/cursor.py — holds up ingest, not the step.)"""
    steps = len(INJECTED) + 2
    trainer = local_trainer(tmp_path, steps, 100)
    compute_loss = step_module.compute_loss

    def injected(model, *args, **kwargs):
        loss, metrics = compute_loss(model, *args, **kwargs)
        if trainer.step <= len(INJECTED):
            INJECTED[trainer.step - 1][1](loss)
        return loss, metrics

    monkeypatch.setattr(step_module, "compute_loss", injected)
    trainer.cursor.feed = ReadingFeed(trainer.cursor.feed, len(INJECTED))
    counter = SyncCounter()
    counted_run(trainer, counter)
    assert [counter.kinds(s) for s in range(1, len(INJECTED) + 2)] == [[kind] for kind, _ in INJECTED] + [
        ["scalar read"]
    ]
    assert counter.syncs[len(INJECTED) + 1][0][2].startswith("tests/test_host_syncs.py")


def test_a_copy_counts_only_from_a_device_to_the_host():
    to_copy, copy = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default
    meta, host = torch.empty(2, device="meta"), torch.empty(2)
    assert sync_kind(to_copy, (meta,), {"device": torch.device("cpu")}) == "device-to-host copy"
    assert sync_kind(copy, (host, meta), {}) == "device-to-host copy"
    assert sync_kind(to_copy, (host,), {"dtype": torch.float16}) is None  # a cast on the host
    assert sync_kind(copy, (meta, host), {}) is None  # host to device: no wait
