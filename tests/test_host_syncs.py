"""The worker's step loop reads nothing back from the device and runs no collective of its own on
the steps it does not log (docs/design.md §11): a short run of the real `Trainer` in one process,
on a one-process gloo group, counting every host read made by the project's code and every
collective outside FSDP's gradient reduction, step by step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import local_trainer
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
PROJECT_CODE = (str(REPO / "mdc") + "/", str(REPO / "pipelines") + "/")  # not the venv, which may sit inside
HOST_READS = ("item", "__float__", "tolist", "cpu", "numpy")
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "all_gather",
    "all_gather_object",
    "reduce",
    "gather",
    "scatter",
)
STEPS, LOG_EVERY = 7, 3


class Counter:
    """Counts the calls of the patched functions while `on`, by step."""

    def __init__(self):
        self.on, self.step, self.calls = False, 0, {}

    def wrap(self, name, original, only_repo: bool):
        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.on and (not only_repo or caller.startswith(PROJECT_CODE)):
                self.calls.setdefault(self.step, []).append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
            return original(*args, **kwargs)

        return counted


@pytest.fixture
def trainer(gloo_process_group, tmp_path):
    return local_trainer(tmp_path, STEPS, LOG_EVERY)


def test_no_host_sync_nor_collective_on_steps_that_do_not_log(trainer, monkeypatch):
    counter = Counter()
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(name, getattr(torch.Tensor, name), only_repo=True))
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, counter.wrap(name, getattr(dist, name), only_repo=False))
    step_once = trainer.train_step

    def counted_step(batch):
        counter.step, counter.on = trainer.step + 1, True
        try:
            step_once(batch)
        finally:
            counter.on = False

    monkeypatch.setattr(trainer, "train_step", counted_step)
    trainer.restore()
    trainer.train()

    logged = [s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS]
    quiet = {s: counter.calls.get(s, []) for s in range(1, STEPS + 1) if s not in logged}
    assert quiet == {s: [] for s in quiet}
    # a log step that saves nothing reads back once: every buffered step's metrics in one tensor
    assert [c for c in counter.calls[LOG_EVERY] if c.split()[0] in HOST_READS] == [
        next(c for c in counter.calls[LOG_EVERY] if c.startswith("tolist"))
    ]
    assert [r["step"] for r in trainer.session.reports] == logged
    history = MlflowClient(trainer.cfg.mlflow_uri).get_metric_history(trainer.metrics.mlflow.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))  # every step's loss, written at log steps
    assert [e["step"] for e in trainer.events if e["kind"] == "step"] == logged
