"""Where a run is in its data: the rows of its epoch's one order that the ranks have trained.

An epoch's order is a function of (train.seed, epoch): its shards in a seeded order
(`shard_order`), each shard's rows in seeded windows (`ingest.ShuffleWindow`), and step s trains
the next global_batch_size rows of it (pipelines/data/ingest.py). The read tasks tag every row with its
shard's index in the sorted shard list and its row in the shard (in that order), and the rows of
a shard's last batch with the shard's row count. Each rank tallies the rows it trained per shard
(`ShardTally`); at a checkpoint the tallies are summed over ranks. Since the steps trained are a
prefix of the epoch's order, the shards it covers are *consumed* (every row trained) but for at
most one, of which the first `partial[shard]` rows were trained. The checkpoint stores the
`DataPosition` (epoch, seed, the shard list's fingerprint, consumed shards, partial rows); a
resumed run — on any number of workers — reads the same epoch in the same order, its read tasks
passing over the consumed shards unread and over the partial shard's trained rows
(`ingest.EpochPlanActor`).

Guarantee, for the weights resumed from a checkpoint (steps after it are lost and trained anew):
the resumed run trains, from the next row of the epoch's order on, the rows the uninterrupted run
would have: no row twice, none skipped. Rows an epoch cannot fill a last global batch with are
dropped, as in any epoch. A changed shard list or seed starts a fresh pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

STATE_KEY = "data_position"  # its key in a checkpoint's extra state


def fingerprint(files: list[str]) -> str:
    """Names the shard list: a position holds shard indices, which mean nothing for another list."""
    return hashlib.sha1("\n".join(files).encode()).hexdigest()[:16]


def shard_order(seed: int | None, epoch: int, num_shards: int) -> list[int]:
    """The shards' order in `epoch`: a permutation of (seed, epoch), or sorted with no seed."""
    if seed is None:
        return list(range(num_shards))
    return np.random.default_rng([seed, epoch]).permutation(num_shards).tolist()


@dataclass(frozen=True)
class EpochPlan:
    """What the read tasks of an epoch do: the epoch (its shard order), the shards they pass over
    unread and, of a shard the resumed epoch had begun, how many rows were already trained."""

    epoch: int = 0
    passed_over: frozenset[int] = frozenset()
    rows_done: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    shard_seed: int | None  # the seed of the epoch's order (train.seed)
    shards: str  # fingerprint of the sorted shard list
    consumed: tuple[int, ...]  # shard indices trained on in full this epoch, by all ranks together
    partial: dict[int, int] = field(default_factory=dict)  # shard index -> its first rows trained

    def to_state(self) -> dict:
        partial = {str(k): v for k, v in self.partial.items()}
        return {STATE_KEY: {**asdict(self), "consumed": list(self.consumed), "partial": partial}}

    @classmethod
    def from_state(cls, state: dict) -> DataPosition:
        raw = state[STATE_KEY]
        partial = {int(k): v for k, v in raw.get("partial", {}).items()}
        return cls(**{**raw, "consumed": tuple(raw["consumed"]), "partial": partial})


def resume_point(position: DataPosition, shard_seed: int | None, shards: str, num_shards: int) -> tuple[EpochPlan, str]:
    """(the plan of the epoch to train, why) for a run resumed at `position`. Its epoch goes on from
    its next row, unless the position belongs to other data or another seed; an epoch consumed in
    full is over."""
    if (position.shards, position.shard_seed) != (shards, shard_seed):
        return EpochPlan(position.epoch + 1), "the shard list or train.seed changed since the checkpoint: a fresh pass"
    if len(position.consumed) >= num_shards:
        return EpochPlan(position.epoch + 1), f"epoch {position.epoch} was consumed in full: a fresh pass"
    rows = sum(position.partial.values())
    return (
        EpochPlan(position.epoch, frozenset(position.consumed), dict(position.partial)),
        f"epoch {position.epoch} goes on after {len(position.consumed)} of its {num_shards} shards"
        + (f" and {rows} rows of the next" if rows else ""),
    )


def trained_shards(trained: np.ndarray, totals: np.ndarray) -> tuple[set[int], dict[int, int]]:
    """(consumed, partial): shards whose every row was trained on — `trained` rows per shard summed
    over ranks equal the shard's row count, known (> 0) once a rank trained a row of its last
    batch — and, of the others, those some rows of which were."""
    consumed = {int(i) for i in np.flatnonzero((totals > 0) & (trained == totals))}
    partial = {int(i): int(trained[i]) for i in np.flatnonzero(trained > 0) if int(i) not in consumed}
    return consumed, partial


class ShardTally:
    """One rank's rows trained on per shard in this epoch, since this process started it, beside
    what its `plan` says was trained before a resume (rank 0 carries that: summed over ranks it is
    counted once). Counted in torch on the host, from the batch's host tensors: a step adds to it
    without reading anything back from a device."""

    def __init__(self, num_shards: int, plan: EpochPlan = EpochPlan(), rank: int = 0):
        self.trained = torch.zeros(num_shards, dtype=torch.int64)
        self.totals = torch.zeros(num_shards, dtype=torch.int64)
        self.passed_over = plan.passed_over
        if rank == 0:
            for shard, rows in plan.rows_done.items():
                self.trained[shard] = rows

    def add(self, shard: torch.Tensor, shard_rows: torch.Tensor) -> None:
        self.trained += torch.bincount(shard, minlength=len(self.trained))
        self.totals.scatter_reduce_(0, shard, shard_rows, reduce="amax")

    def position(self, device) -> tuple[tuple[int, ...], dict[int, int]]:
        """Collective: (consumed, partial) this epoch by all ranks together (`trained_shards`)."""
        # copies: the tally must not take the reduction in place
        trained, totals = (a.to(device, copy=True) for a in (self.trained, self.totals))
        dist.all_reduce(trained)
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        consumed, partial = trained_shards(trained.cpu().numpy(), totals.cpu().numpy())
        return tuple(sorted(self.passed_over | consumed)), partial
