"""Where a worker is in its data, and the only code that talks to the run's ingest actors."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch.distributed as dist

from pipelines.ingest import BatchFeed, ask
from pipelines.position import DataPosition, EpochPlan, ShardTally, resume_point
from pipelines.worker.args import IngestActors

BAD_RECORDS_KEY = "skipped_by_shard"  # rank 0's bad-record counts per shard in a checkpoint's extra state


class DataCursor:
    """The epoch's plan (its order, and what a resumed epoch passes over), this rank's per-shard
    tally and, through the ingest actors, the bad-record counts. `batches` yields one epoch of
    optimiser-step batches from `source(epoch)` (`what` names them in errors), through a
    `BatchFeed` that turns a stall into an error and adds up the time spent waiting (`wait_s`).
    Its checkpoint part is `state`."""

    def __init__(
        self,
        source: Callable[[int], Iterable[dict]],
        feed: BatchFeed,
        actors: IngestActors | None,
        shard_list_id: str,
        num_shards: int,
        seed: int,
        rank: int,
        what: str = "a batch",
    ):
        self.source, self.feed, self.actors, self.what = source, feed, actors, what
        self.shard_list_id, self.num_shards, self.seed, self.rank = shard_list_id, num_shards, seed, rank
        self.plan = EpochPlan()
        self.tally = ShardTally(num_shards)

    @property
    def wait_s(self) -> float:
        return self.feed.wait_s

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def start(self, trainer_state: dict | None, extra_state: dict) -> None:
        """Collective. Where a run that starts from checkpoint `trainer_state` (None: from
        scratch) goes on: a resumed run continues its checkpoint's epoch from its next row
        (pipelines/position.py). Rank 0 decides, from its own extra state (so a changed world size
        cannot make ranks disagree), and sets the ingest actors before any rank may start reading."""
        plan = [EpochPlan()]
        if self.rank == 0:
            if trainer_state is not None:
                plan[0], why = resume_point(
                    DataPosition.from_state(extra_state),
                    trainer_state["epoch"],
                    self.seed,
                    self.shard_list_id,
                    self.num_shards,
                )
                print(f"[mdc] data position at step {trainer_state['step']}: {why}", flush=True)
            if self.actors is not None:
                ask(
                    [
                        self.actors.epoch_plan.set.remote(plan[0]),
                        self.actors.bad_records.restore.remote(extra_state.get(BAD_RECORDS_KEY, {})),
                    ],
                    "the ingest actors",
                )
        dist.broadcast_object_list(plan, src=0)  # also the barrier: the actors are set
        self.plan = plan[0]

    def batches(self) -> Iterator[dict]:
        """The rest of the current epoch; ends it (`_end_epoch`) when it runs out."""
        self.tally, count = ShardTally(self.num_shards, self.plan, self.rank), 0
        for batch in self.feed(self.source(self.epoch)):
            count += 1
            self.tally.add(batch["shard"], batch["shard_rows"])  # trained on before any checkpoint sees it
            yield batch
        self._end_epoch(count)

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

    def state(self, device) -> dict:
        """Collective. This cursor's part of a checkpoint's extra state: the data position and, on
        rank 0, the bad-record counts of shards a relaunched run will not read again."""
        consumed, partial = self.tally.position(device)
        extra = DataPosition(self.epoch, self.seed, self.shard_list_id, consumed, partial).to_state()
        if self.rank == 0 and self.actors is not None:
            extra[BAD_RECORDS_KEY] = ask(self.actors.bad_records.state.remote(), "the BadRecordLedgerActor")
        return extra
