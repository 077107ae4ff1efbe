"""Optional hooks the trainer calls at fixed points, instead of branches in its loop: fault
injection and row recording, both for tests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


class Callback:
    """The points a callback may act at; each does nothing unless overridden."""

    def step_start(self, step: int, rank: int) -> None:
        """Before step `step` reads its batch's tensors."""

    def trained(self, step: int, epoch: int, rank: int, batch: dict) -> None:
        """After step `step` trained on `batch`."""

    def checkpoint(self, step: int, rank: int, at: str) -> None:
        """During checkpoint `step`'s save: "shard_written" (this rank's shard is in storage,
        the checkpoint not yet complete) or "committed" (complete, not yet reported)."""


@dataclass
class Fault(Callback):
    """Stop one worker once (`marker` records that it fired), at a point of `step`: its start
    ("step"), after this rank's checkpoint shard is in storage but before the checkpoint is
    complete ("shard_written"), or once it is complete but not yet reported ("committed"). With
    `kill` its process dies as if the node were lost, otherwise the training function raises.
    Used to test recovery from a dead worker and resumption of a relaunched run."""

    step: int
    rank: int
    marker: str
    kill: bool = True
    at: Literal["step", "shard_written", "committed"] = "step"

    def step_start(self, step: int, rank: int) -> None:
        self.maybe_fire(step, rank)

    def checkpoint(self, step: int, rank: int, at: str) -> None:
        self.maybe_fire(step, rank, at)

    def maybe_fire(self, step: int, rank: int, at: str = "step") -> None:
        if (step, rank, at) == (self.step, self.rank, self.at) and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(step))
            if self.kill:
                os._exit(1)
            raise RuntimeError(f"injected fault at step {step} ({at}) on rank {rank}")


@dataclass
class RowRecorder(Callback):
    """Each rank appends "epoch step shard row" for every row it trained on, to check what a
    resumed run trains (tests/test_resume_position.py)."""

    directory: str

    def trained(self, step: int, epoch: int, rank: int, batch: dict) -> None:
        with open(Path(self.directory, f"rank{rank}.txt"), "a") as f:
            f.writelines(f"{epoch} {step} {s} {r}\n" for s, r in zip(batch["shard"].tolist(), batch["row"].tolist()))
