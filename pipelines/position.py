"""Where a run is in its data: the shards the ranks have trained on in full this epoch.

The read tasks tag every row with its shard's index in the sorted shard list and its row in the
shard, and the rows of a shard's last batch with the shard's row count (`ingest.read_shards`).
Each rank tallies the rows it trained on per shard (`ShardTally`); at a checkpoint the tallies
are summed over ranks, since a shard's rows go to any rank, and a shard is *consumed* once every
one of its rows has been trained on. Rows still in prefetch or local-shuffle buffers are not.
The checkpoint stores the `DataPosition` (epoch, shard-order seed, the shard list's fingerprint,
the consumed shards); a resumed run continues that epoch, its read tasks passing over the consumed
shards without reading them (`ingest.PassedOverShardsActor`).

Guarantee, for the weights resumed from a checkpoint (steps after it are lost and trained anew):
no shard is lost; the shards in flight at the checkpoint (partly trained on) are read again in
full, so at most their rows are trained on twice; after the resumed epoch, epochs are fresh
passes. Rows an epoch cannot fill a last batch with are dropped, as in any epoch.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

STATE_KEY = "data_position"  # its key in a checkpoint's extra state


def fingerprint(files: list[str]) -> str:
    """Names the shard list: a position holds shard indices, which mean nothing for another list."""
    return hashlib.sha1("\n".join(files).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    shard_seed: int | None  # the seed Ray Data reseeds every pass's shard order from (train.seed)
    shards: str  # fingerprint of the sorted shard list
    consumed: tuple[int, ...]  # shard indices trained on in full this epoch, by all ranks together

    def to_state(self) -> dict:
        return {STATE_KEY: {**asdict(self), "consumed": list(self.consumed)}}

    @classmethod
    def from_state(cls, extra_state: dict) -> DataPosition | None:
        raw = extra_state.get(STATE_KEY)
        return None if raw is None else cls(**{**raw, "consumed": tuple(raw["consumed"])})


def resume_point(
    position: DataPosition | None, epoch: int, shard_seed: int | None, shards: str, num_shards: int
) -> tuple[int, frozenset[int], str]:
    """(epoch to train, shards it passes over, why) for a run resumed at checkpoint epoch `epoch`.
    The checkpoint's epoch goes on with what it had not consumed, unless the position is missing
    or belongs to other data or another seed; an epoch consumed in full is over."""
    if position is None:
        return epoch + 1, frozenset(), "the checkpoint has no data position: a fresh pass"
    if (position.shards, position.shard_seed) != (shards, shard_seed):
        return epoch + 1, frozenset(), "the shard list or train.seed changed since the checkpoint: a fresh pass"
    if len(position.consumed) >= num_shards:
        return position.epoch + 1, frozenset(), f"epoch {position.epoch} was consumed in full: a fresh pass"
    return (
        position.epoch,
        frozenset(position.consumed),
        f"epoch {position.epoch} goes on with the "
        f"{num_shards - len(position.consumed)} of its {num_shards} shards not yet consumed",
    )


def consumed_shards(trained: np.ndarray, totals: np.ndarray) -> set[int]:
    """Shards whose every row was trained on: `trained` rows per shard summed over ranks equal the
    shard's row count, known (> 0) once a rank trained a row of its last batch."""
    return {int(i) for i in np.flatnonzero((totals > 0) & (trained == totals))}


class ShardTally:
    """One rank's rows trained on per shard in this epoch, since this process started it; `passed_over`
    are the shards it passes over, consumed before a resume. Counted in torch on the host, from
    the batch's host tensors: a step adds to it without reading anything back from a device."""

    def __init__(self, num_shards: int, passed_over: frozenset[int] = frozenset()):
        self.trained = torch.zeros(num_shards, dtype=torch.int64)
        self.totals = torch.zeros(num_shards, dtype=torch.int64)
        self.passed_over = passed_over

    def add(self, shard: torch.Tensor, shard_rows: torch.Tensor) -> None:
        self.trained += torch.bincount(shard, minlength=len(self.trained))
        self.totals.scatter_reduce_(0, shard, shard_rows, reduce="amax")

    def consumed(self, device) -> tuple[int, ...]:
        """Collective: the shards consumed this epoch by all ranks together."""
        # copies: the tally must not take the reduction in place
        trained, totals = (a.to(device, copy=True) for a in (self.trained, self.totals))
        dist.all_reduce(trained)
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        return tuple(sorted(self.passed_over | consumed_shards(trained.cpu().numpy(), totals.cpu().numpy())))
