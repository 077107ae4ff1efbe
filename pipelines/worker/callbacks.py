"""Optional hooks the trainer calls at fixed points, instead of branches in its loop: fault
injection, row recording, worker-group logging and holds, all for tests."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import ray
import torch.distributed as dist


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


@dataclass
class GroupLog(Callback):
    """For the multi-node tests: each rank appends "STEP WORLD_SIZE NODE_ID" to DIRECTORY/rankR.txt
    at the first step its process trains, so every worker group (a restart, a resize) adds a line.
    At each of `holds`, (world size, step, rank), that rank stops once (DIRECTORY/held_W_S holds
    its node id) and waits for the test to change the cluster under it, which ends the group; a
    hold that lasts `timeout_s` raises, so a test whose node change never comes fails."""

    directory: str
    holds: tuple[tuple[int, int, int], ...] = ()
    timeout_s: float = 300.0
    _started: bool = field(default=False, repr=False)

    def step_start(self, step: int, rank: int) -> None:
        world, node = dist.get_world_size(), ray.get_runtime_context().get_node_id()
        if not self._started:
            self._started = True
            with open(Path(self.directory, f"rank{rank}.txt"), "a") as f:
                f.write(f"{step} {world} {node}\n")
        held = Path(self.directory, f"held_{world}_{step}")
        if (world, step, rank) in self.holds and not held.exists():
            held.write_text(node)
            time.sleep(self.timeout_s)
            raise RuntimeError(
                f"rank {rank} of {world} held at step {step} for {self.timeout_s:g} s: no node came or went"
            )


@dataclass
class HoldAfterJustInTime(Callback):
    """For the reclaim test: once a checkpoint at a step that is not a multiple of `every` (a
    just-in-time one) is committed, every rank writes the step to DIRECTORY/held_RANK and waits
    there for the test to take a node away, so no step is trained after that checkpoint; a hold
    that lasts `timeout_s` raises."""

    directory: str
    every: int
    timeout_s: float = 300.0

    def checkpoint(self, step: int, rank: int, at: str) -> None:
        held = Path(self.directory, f"held_{rank}")
        if at == "committed" and step % self.every and not held.exists():
            held.write_text(str(step))
            time.sleep(self.timeout_s)
            raise RuntimeError(f"rank {rank} held after checkpoint {step} for {self.timeout_s:g} s: no node went")


@dataclass
class HoldUntilFile(Callback):
    """For the online-evaluation test: every rank waits at the start of `step` until `path`
    exists (the test writes it once an evaluation of an earlier step is logged), so what the test
    sees does not depend on how fast the machine is; a hold that lasts `timeout_s` raises."""

    step: int
    path: str
    timeout_s: float = 240.0

    def step_start(self, step: int, rank: int) -> None:
        if step != self.step:
            return
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} held at step {step} for {self.timeout_s:g} s: {self.path} never came")
            time.sleep(0.5)


def group_lines(directory: str | Path, rank: int) -> list[tuple[int, int, str]]:
    """(first step, world size, node id) of each process that `rank` ran in, in order (GroupLog)."""
    rows = Path(directory, f"rank{rank}.txt").read_text().split("\n")
    return [(int(step), int(world), node) for step, world, node in (row.split() for row in rows if row)]
