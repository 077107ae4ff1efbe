"""Where a worker is in its data, and the only code that talks to the run's ingest actors."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipelines.data.deal import BlockDeal
from pipelines.data.feed import BatchFeed
from pipelines.data.ingest import IngestActors
from pipelines.data.position import DataPosition, EpochPlan, ShardTally, resume_point
from pipelines.infra.actors import ask

BAD_RECORDS_KEY = "skipped_by_shard"  # the bad-record counts per shard in the cursor's checkpoint state


@dataclass
class StepBlocks:
    """One rank's part of an optimiser step: its blocks (host tensors, one micro-batch each), their
    places in the step's global batch, and `pad`, a block it holds to fill padded passes with."""

    blocks: list[dict]
    chunks: range
    pad: dict

    def tags(self) -> dict:
        """The blocks' row tags (shard, row, ...), concatenated: what callbacks look at."""
        keys = [k for k in self.pad if k not in ("image", "tokens")]
        return {k: torch.cat([b[k] for b in self.blocks]) if self.blocks else self.pad[k][:0] for k in keys}


def every_rank(group) -> Callable[[bool], bool]:
    """`agree(ok)`: whether `ok` holds on every rank of `group` (a CPU group: no device waits)."""

    def agree(ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


class DataCursor:
    """The epoch's plan (its order, and what a resumed epoch passes over), this rank's per-shard
    tally and, through the ingest actors, the bad-record counts. `batches` yields one epoch of
    this rank's `StepBlocks` from `source(epoch)`, a stream of one-micro-batch blocks dealt as
    `deal` says (`what` names a step's batch in errors), through a `BatchFeed` that turns a stall
    into an error and adds up the time spent waiting (`wait_s`). Whether a step exists is agreed
    by every rank (`agree`, by default over a gloo group `start` makes). A `ckpt.Stateful`: its
    checkpoint state is the group's data position (`state_dict`, collective on `device`), which
    `start` goes on from."""

    def __init__(
        self,
        *,
        source: Callable[[int], Iterable[dict]],
        feed: BatchFeed,
        actors: IngestActors | None,
        shard_list_id: str,
        num_shards: int,
        seed: int,
        rank: int,
        deal: BlockDeal,
        device: torch.device | str,
        what: str = "a batch",
        agree: Callable[[bool], bool] | None = None,
    ):
        self.source, self.feed, self.actors, self.deal, self.what = source, feed, actors, deal, what
        self.agree = agree
        self.shard_list_id, self.num_shards, self.seed, self.rank = shard_list_id, num_shards, seed, rank
        self.device = device
        self.plan = EpochPlan()
        self.tally = ShardTally(num_shards)
        self.restored: dict | None = None  # the checkpoint's state, until `start` goes on from it

    @property
    def wait_s(self) -> float:
        return self.feed.wait_s

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def load_state_dict(self, state: dict) -> None:
        self.restored = state

    def start(self) -> None:
        """Collective. Where the run goes on: a run restored from a checkpoint (`load_state_dict`)
        continues its epoch from its next row (pipelines/data/position.py), otherwise it starts from
        scratch. Rank 0 decides (every rank holds the same state, but a changed world size must not
        make ranks disagree) and sets the ingest actors before any rank may start reading."""
        plan, state = [EpochPlan()], self.restored or {}
        if self.rank == 0:
            if self.restored is not None:
                plan[0], why = resume_point(
                    DataPosition.from_state(state), self.seed, self.shard_list_id, self.num_shards
                )
                print(f"[mdc] data position: {why}", flush=True)
            if self.actors is not None:
                ask(
                    [
                        self.actors.epoch_plan.set.remote(plan[0]),
                        self.actors.bad_records.restore.remote(state.get(BAD_RECORDS_KEY, {})),
                    ],
                    "the ingest actors",
                )
        dist.broadcast_object_list(plan, src=0)  # also the barrier: the actors are set
        self.plan, self.restored = plan[0], None
        if self.agree is None:  # its own group: the feed's thread agrees while FSDP uses the default one
            self.agree = every_rank(dist.new_group(backend="gloo"))

    def batches(self) -> Iterator[StepBlocks]:
        """The rest of the current epoch, a step at a time (`steps`, run ahead in the feed's
        thread); then ends the epoch (`_end_epoch`)."""
        self.tally = ShardTally(self.num_shards, self.plan, self.rank)
        step = 0
        for part in self.feed(self.steps(iter(self.source(self.epoch)))):
            for block in part.blocks:
                self.tally.add(block["shard"], block["shard_rows"])  # trained on before any checkpoint sees it
            yield part
            step += 1
        self._end_epoch(step)

    def steps(self, stream: Iterator[dict]) -> Iterator[StepBlocks]:
        """This rank's share of each step of the stream, for as long as every rank holds its share
        (pipelines/data/deal.py): the epoch has then (j+1)K blocks. A rank with no block of a step
        (K < W) pads with the latest one it holds, so it needs one to exist. What is left of the
        stream after the last step (under one global batch) is read and dropped."""
        held, last, step = [], None, 0
        while True:
            chunks = self.deal.chunks(self.rank, step)
            while len(held) < max(len(chunks), last is None) and (block := next(stream, None)) is not None:
                held.append(block)
                last = block
            if not self.agree(len(held) >= len(chunks) and last is not None):
                break
            mine, held = held[: len(chunks)], held[len(chunks) :]
            yield StepBlocks(mine, chunks, pad=last)
            step += 1
        for _ in stream:  # the epoch's rest: Ray ends its epoch once every split is read to its end
            pass

    def _end_epoch(self, batches: int) -> None:
        resumed = bool(self.plan.passed_over or self.plan.rows_done)
        if batches == 0 and not resumed:  # a resumed epoch's rest may not fill a batch
            raise RuntimeError(
                f"no full {self.what} for rank {self.rank}: the dataset is smaller than global_batch_size"
            )
        self.plan = EpochPlan(self.epoch + 1)  # a fresh pass in the next epoch's order
        if self.rank == 0 and self.actors is not None:
            ask(self.actors.epoch_plan.set.remote(self.plan), "the EpochPlanActor")
        dist.barrier()  # no rank reads the next epoch before its plan is set

    def state_dict(self) -> dict:
        """Collective. The data position (its epoch among it) of the whole group (each rank's tally
        summed over ranks) and, on rank 0, the bad-record counts of shards a relaunched run will
        not read again."""
        consumed, partial = self.tally.position(self.device)
        state = DataPosition(self.epoch, self.seed, self.shard_list_id, consumed, partial).to_state()
        if self.rank == 0 and self.actors is not None:
            state[BAD_RECORDS_KEY] = ask(self.actors.bad_records.state.remote(), "the BadRecordLedgerActor")
        return state
