"""What the trainer needs from Ray Train: its rank, world and device, its dataset shards, and the
report. A test hands the trainer an object of the same shape instead (tests/test_host_syncs.py)."""

from __future__ import annotations

import ray.train
import ray.train.collective
import ray.train.torch

from mdc.config import RunConfig


class RaySession:
    def __init__(self, cfg: RunConfig):
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.cfg = cfg
        self.train = ray.train.get_dataset_shard("train")

    def train_batches(self, epoch: int):
        """This rank's micro-batch blocks in turn, on the host, pinned for a GPU: the trainer moves
        the model's inputs without waiting (non_blocking) and tallies the tags where they are. The
        rows come in the dataset's one order (shuffled upstream, pipelines/data/ingest.py), cut into
        blocks of exactly batch_size: no local shuffle, which would make them the rank's."""
        return self.train.iter_torch_batches(
            batch_size=self.cfg.train.batch_size,
            drop_last=True,
            device="cpu",
            pin_memory=self.cfg.workers.use_gpu,
        )

    def held_out_batches(self) -> list[dict]:
        if not self.cfg.data.val_uri:
            return []
        return list(
            ray.train.get_dataset_shard("val").iter_torch_batches(
                batch_size=self.cfg.train.batch_size, drop_last=False, device="cpu"
            )
        )

    def report(self, metrics: dict) -> None:
        ray.train.report(metrics)

    def preemption_notice(self):
        """Ray Train's notice that a node of this group is being reclaimed (a spot preemption, a
        drain), or None. Collective over the group (every rank calls it at the same steps)."""
        return ray.train.get_preemption_info()

    def broadcast(self, value):
        """Rank 0's `value`, on every rank. Collective."""
        return ray.train.collective.broadcast_from_rank_zero(value)
