"""The checkpointer: when to save, the save itself (local staging, the copy into the run's storage,
in the background with checkpoint.background, the completion marker, pruning) and the restore."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping

import torch.distributed as dist

from mdc.config import RunConfig, dump_config
from mdc.data import storage
from mdc.training import checkpoint as ckpt
from pipelines.worker.callbacks import Callback


class Checkpointer:
    """Saves and restores, in checkpoints under `run_dir`, `model`, `optimizer` and `ema` (DCP
    shards) and each component of `states` (`ckpt.Stateful`, by name: the trainer's progress, the
    scheduler, the data cursor), which it is given once, here. Checkpoints are not handed to Ray
    Train, which records one only once every rank has reported it, so a group that died in between
    would lose a checkpoint that is already written: the completion marker in storage is the one
    record of what can be resumed."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str,
        rank: int,
        *,
        model,
        optimizer,
        ema,
        states: Mapping[str, ckpt.Stateful],
        callbacks: list[Callback] = (),
    ):
        self.cfg, self.run_dir, self.rank, self.endpoint = cfg, run_dir, rank, cfg.data.endpoint_url
        self.model, self.optimizer, self.ema, self.states = model, optimizer, ema, dict(states)
        self.callbacks = list(callbacks)
        self.background = ckpt.Background() if cfg.checkpoint.background else None  # collective

    def due(self, step: int) -> bool:
        """Every checkpoint.every steps, the last step, and each step evaluated online."""
        return step % self.cfg.checkpoint.every == 0 or step == self.cfg.train.steps or self.exports(step)

    def exports(self, step: int) -> bool:
        """Checkpoints that also carry the full weights: the last (for evaluation) and those
        evaluated online."""
        return step == self.cfg.train.steps or bool(self.cfg.eval.evaluations_at(step))

    def restore(self) -> str | None:
        """Collective. Loads the newest complete checkpoint in the run's storage into the model,
        optimiser, EMA and every component; returns its uri, or None (nothing loaded) when there
        is none."""
        uri = self._choose()
        if uri is not None:
            with ckpt.local_copy(uri, self.endpoint) as directory:
                ckpt.load_training_state(directory, self.model, self.optimizer, self.ema, self.states)
        return uri

    def _choose(self) -> str | None:
        """Rank 0 picks the newest complete checkpoint, says which and why, and tells the others."""
        choice = [None]
        if self.rank == 0:
            choice[0], passed = ckpt.newest_complete(self.run_dir, self.endpoint)
            for line in passed:
                print(f"[mdc] {line}", flush=True)
            if choice[0] is not None:
                print(
                    f"[mdc] resuming from {choice[0]}: the newest complete checkpoint in the run's storage", flush=True
                )
            elif passed:
                print(f"[mdc] no complete checkpoint in {self.run_dir}: starting from step 0", flush=True)
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def save(self, step: int, wait: bool = False) -> None:
        """Collective. Each rank stages its DCP shard locally (rank 0 also every component's
        state) and copies it into the run's storage; then rank 0 marks the checkpoint complete and deletes the ones no longer kept. In the
        background, training resumes once the shards are staged, and the copy and commit finish in
        a thread. The last checkpoint, finished before returning, and those evaluated online also
        carry the exported full weights. `wait`: finished before returning, as the last is (a
        just-in-time checkpoint: its node is about to go)."""
        uri, final = ckpt.checkpoint_dir(self.run_dir, step), step == self.cfg.train.steps
        if self.background is not None:
            self.background.wait()  # one checkpoint in flight at a time
        weights = (
            ckpt.full_weights(self.model, self.ema) if self.exports(step) else None
        )  # collective: every rank calls
        if self.rank == 0:
            ckpt.remove(uri, self.endpoint)  # what an interrupted attempt at this step left
        dist.barrier()
        directory = tempfile.mkdtemp(prefix="mdc-checkpoint-")
        ckpt.stage_training_state(directory, self.model, self.optimizer, self.ema, self.states, self.rank)
        if weights is not None and self.rank == 0:
            ckpt.export_weights(directory, weights, dump_config(self.cfg))
        if self.background is None:
            self._finish(directory, uri, step)
        else:
            self.background.submit(lambda: self._finish(directory, uri, step))
            if final or wait:
                self.background.wait()

    def _finish(self, directory: str, uri: str, step: int) -> None:
        try:
            written = ckpt.upload_shard(directory, uri, self.endpoint)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self._at(step, "shard_written")
        ckpt.commit(
            uri, step, written, self.rank, self.endpoint, group=self.background.group if self.background else None
        )
        if self.rank == 0:
            ckpt.prune(self.run_dir, step, self.cfg.checkpoint.keep, self.endpoint)
        self._at(step, "committed")

    def _at(self, step: int, point: str) -> None:
        for callback in self.callbacks:
            callback.checkpoint(step, self.rank, point)


def saved_global_batch(run_dir: str, endpoint_url: str | None = None) -> tuple[str, int] | None:
    """(uri, global batch) of the run's newest complete checkpoint (names and sizes checked, no
    reads of the shards), or None when there is none or it predates the record."""
    for _, uri in ckpt._checkpoints(run_dir, endpoint_url):
        if ckpt.problem(uri, endpoint_url, checksums=False) is None:
            states = json.loads(storage.read_bytes(storage.join(uri, ckpt.STATES), endpoint_url))
            batch = states.get("train_state", {}).get("global_batch")
            return None if batch is None else (uri, int(batch))
    return None


def check_global_batch(cfg: RunConfig, run_dir: str) -> None:
    """Before a run resumes: its global batch is the one its checkpoint trained with. Another one
    would change the optimiser's batch, the rows of every step and the noise chunks, so a relaunch
    with another `workers.count` and no `train.global_batch_size` is refused, not resumed."""
    saved = saved_global_batch(run_dir, cfg.data.endpoint_url)
    if saved is not None and saved[1] != cfg.global_batch:
        uri, batch = saved
        raise ValueError(
            f"{uri} trained with a global batch of {batch} rows, this launch would train {cfg.global_batch} "
            f"(train.global_batch_size {cfg.train.global_batch_size}, train.batch_size {cfg.train.batch_size} "
            f"× workers.max {cfg.workers.max}): set train.global_batch_size: {batch} to resume it, or train "
            "under a new run name"
        )
