"""Which micro-batches of a step's global batch each rank trains, for any world size.

Ingest cuts the epoch's one order into blocks of exactly `batch_size` rows and Ray Data, told to
preserve order, deals block k of the stream to rank k mod W (pipelines/data/ingest.py). A step is K =
global_batch_size / batch_size consecutive blocks, so in step j of the stream rank r holds the
blocks k of [jK, (j+1)K) with k ≡ r (mod W): ⌈K/W⌉ or ⌊K/W⌋ of them (none when K < W). Every rank
runs `passes` = ⌈K/W⌉ micro-batches, a short share padded with passes of loss weight 0 (FSDP's
collectives need as many on every rank, and the slowest rank sets the step's time anyway), and
weighs each real one W/K: FSDP's mean over ranks then makes the gradient the mean over the K
chunks, the global batch's, whatever W is. With W dividing K nothing is padded.

Every block of the epoch is dealt (Ray's split is told `equal=False`: its equal split would drop the
epoch's last round of blocks, so an epoch's length would depend on W), so step j exists iff the
epoch has (j+1)K blocks, for every W: the rows an epoch drops are only those that cannot fill a
last global batch. No rank can tell that alone (the blocks of step j are spread over the ranks, and
a rank's stream may end before or after its share of a step), so before each step the ranks agree
on it: each says whether it holds its blocks of the step, and the step runs iff every rank does
(`pipelines/data/cursor.py`, one all-reduce of a flag on a CPU group, in the feed's thread ahead of
the step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockDeal:
    blocks_per_step: int  # K
    world_size: int  # W

    @property
    def passes(self) -> int:
        """Micro-batches every rank runs a step."""
        return -(-self.blocks_per_step // self.world_size)

    @property
    def padded(self) -> int:
        """Padding passes a step, over all ranks: 0 when W divides K."""
        return self.passes * self.world_size - self.blocks_per_step

    def describe(self, batch_size: int) -> str:
        return (
            f"{self.world_size} workers share {self.blocks_per_step} micro-batches of {batch_size}: "
            f"{self.passes} passes each, {self.padded} of {self.passes * self.world_size} padded with weight 0"
        )

    @property
    def weight(self) -> float:
        """Each real micro-batch's loss weight: FSDP averages over W ranks, the step means over K."""
        return self.world_size / self.blocks_per_step

    def chunks(self, rank: int, step: int) -> range:
        """The places in step `step`'s global batch (counted from the stream's start, which is
        always a step's) of the blocks rank `rank` holds, in the order it receives them."""
        first = (rank - step * self.blocks_per_step) % self.world_size
        return range(first, self.blocks_per_step, self.world_size)
