"""The worker's `Trainer`: a step loop of calls to components that own their state (pipelines/worker)."""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist

from mdc.data.augment import augment
from mdc.data.images import normalize
from mdc.data.tokenizer import CaptionTokenizer
from mdc.registry import build_model
from mdc.training.fsdp import prepare_model
from mdc.training.step import EMA, build_optimizer, build_scheduler, device_step
from pipelines.data.cursor import DataCursor, StepBlocks
from pipelines.data.deal import BlockDeal
from pipelines.data.feed import BatchFeed, describe_stall
from pipelines.data.seeds import augment_seed, noise_generator
from pipelines.worker.args import WorkerArgs
from pipelines.worker.checkpointer import Checkpointer
from pipelines.worker.metrics import MetricsLogger, rank0_sinks
from pipelines.worker.notice import NoticeSchedule
from pipelines.worker.online import EvaluationHandOver
from pipelines.worker.session import RaySession
from pipelines.worker.validator import Validator


@torch.no_grad()
def param_norm(model) -> float:
    """L2 norm of all parameters, summed over the FSDP shards (collective)."""
    local = sum(
        p.to_local().float().pow(2).sum() if hasattr(p, "to_local") else p.float().pow(2).sum()
        for p in model.parameters()
    )
    dist.all_reduce(local)
    return float(local.sqrt())


class Trainer:
    """Builds and shards the model and its components; `restore` resumes from the newest complete
    checkpoint, if any, and `run` runs the steps. `session` is Ray Train's (session.RaySession).
    A `ckpt.Stateful` itself: its checkpoint state is its progress (`state_dict`)."""

    def __init__(self, args: WorkerArgs, session):
        cfg, tc = args.cfg, args.cfg.train
        self.cfg, self.session, self.rank, self.device = cfg, session, session.rank, session.device
        self.deal = BlockDeal(cfg.micro_batches_per_step, session.world_size)  # the global batch, whatever the size
        self.model = build_model(cfg, CaptionTokenizer, seed=tc.seed).to(self.device)  # the same on every rank
        prepare_model(
            self.model,
            self.device,
            bf16=cfg.workers.use_gpu,
            activation_checkpointing=cfg.compute.activation_checkpointing,
            compile=cfg.compute.compile,
        )
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim.warmup_steps, tc.steps)
        self.ema = EMA(self.model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
        online = args.evaluation_queue and EvaluationHandOver(cfg, args.run_dir, args.evaluation_queue)
        self.callbacks = [*args.callbacks, *([online] if online else [])]
        stall = partial(
            describe_stall,
            cfg.data.train_uri,
            cfg.data.stall_timeout_s,
            self.rank,
            args.ingest,
            session.world_size * cfg.workers.cpus,
        )
        self.cursor = DataCursor(
            source=session.train_batches,
            feed=BatchFeed(cfg.data.stall_timeout_s, stall),
            actors=args.actors,
            shard_list_id=args.shard_list_id,
            num_shards=args.num_shards,
            seed=tc.seed,
            rank=self.rank,
            deal=self.deal,
            device=self.device,
            what=f"global batch of {cfg.global_batch} in {cfg.data.train_uri}",
        )
        sinks = (
            rank0_sinks(args.mlflow_uri, args.mlflow_run_id, args.progress, cfg.name, tc.steps)
            if self.rank == 0
            else None
        )
        self.metrics = MetricsLogger(tc.log_every, tc.steps, session.world_size, cfg.global_batch, sinks)
        self.validator = Validator(
            cfg.validation, session.held_out_batches(), cfg.objective, steps=tc.steps, seed=tc.seed, device=self.device
        )
        self.step, self.val_loss, self.reclaimed_nodes = 0, None, set()
        self.notices = NoticeSchedule(cfg.workers.notice_every_s)  # when the reclaim notice is read
        self.saved_workers: int | None = None  # the group's size at the checkpoint resumed from
        self.reported: dict | None = None  # the last report: the run's final metrics once it ends
        self.checkpointer = Checkpointer(
            cfg,
            args.run_dir,
            self.rank,
            model=self.model,
            optimizer=self.optimizer,
            ema=self.ema,
            states={"train_state": self, "scheduler": self.scheduler, "data": self.cursor},
            callbacks=self.callbacks,
        )

    def state_dict(self) -> dict:
        """The step, the group's size (a resumed group says when its size changed), the latest
        validation loss (every report carries it) and the last report (a relaunch of a finished
        run returns it: `train_loop`)."""
        return {
            "step": self.step,
            "workers": self.session.world_size,
            "global_batch": self.cfg.global_batch,  # a relaunch with another is refused (check_global_batch)
            "val_loss": self.val_loss,
            "reported": self.reported,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.saved_workers, self.val_loss = state["step"], state["workers"], state["val_loss"]
        self.reported = state["reported"]

    def restore(self) -> None:
        """Collective: the checkpoint's weights, progress and data position, or a start from scratch."""
        uri = self.checkpointer.restore()
        self.cursor.start()
        self.notices.start(self.step)
        if uri is not None:
            self.metrics.resumed(self.step, uri, param_norm(self.model))
        self.metrics.workers(self.step, self.session.world_size, self.saved_workers, self.cfg.workers.elastic)
        if self.deal.padded:
            self.metrics.note(self.deal.describe(self.cfg.train.batch_size))

    def run(self) -> None:
        while self.step < self.cfg.train.steps:
            for batch in self.cursor.batches():
                self.run_step(batch)
                if self.step >= self.cfg.train.steps:
                    break

    def run_step(self, part: StepBlocks) -> None:
        """One optimiser step on this rank's part of the global batch, padded to the group's
        passes with weight-0 micro-batches; reads nothing back to the host unless it logs or saves."""
        step = self.step = self.step + 1
        for callback in self.callbacks:
            callback.step_start(step, self.rank)
        images, tokens = self._inputs(part, step)
        noise = [noise_generator(self.cfg.train.seed, step, chunk, self.device) for chunk in self._places(part)]
        real = len(part.chunks)
        metrics = device_step(
            self.model,
            self.optimizer,
            self.scheduler,
            images,
            tokens,
            self.cfg.objective,
            self.cfg.optim.grad_clip,
            generator=noise,
            ema=self.ema,
            micro_batches=self.deal.passes,
            weights=[self.deal.weight] * real + [0.0] * (self.deal.passes - real),
        )
        for callback in self.callbacks:
            callback.trained(step, self.cursor.epoch, self.rank, part.tags())
        self.metrics.record(step, metrics, tokens[: real * self.cfg.train.batch_size], epoch=self.cursor.epoch)
        if self.validator.due(step):
            self.val_loss = self.validator.loss(self.model)
            self.metrics.note_host(step, val_loss=self.val_loss)
            self.metrics.note(f"validation at step {step}: val_loss {self.val_loss:.4f}")
        logged, saved, read = self.metrics.due(step), self.checkpointer.due(step), self.notices.due(step)
        if logged or saved or read:
            reclaimed = (logged or read) and self._reclaimed(step)
            if logged or saved or reclaimed:
                self._log_and_save(step, just_in_time=reclaimed)

    def _reclaimed(self, step: int) -> bool:
        """Collective, on logged steps and those `self.notices` schedules (every rank at the same
        steps; no sync of its own elsewhere): whether a node of the group has been told it is
        reclaimed since the last just-in-time checkpoint. Then this step is saved at once, and
        training goes on until the node goes; the restart resumes from it."""
        notice = self.session.preemption_notice()
        if self.notices.next_step is not None:  # the next read's step, rank 0's
            self.notices.agree(step, self.session.broadcast(self.notices.gap(step)))
        if notice is None or set(notice.preempted_node_ids) <= self.reclaimed_nodes:
            return False
        self.reclaimed_nodes |= set(notice.preempted_node_ids)
        left = (
            f", {max(0.0, notice.deadline_ms / 1000 - time.time()):.0f} s before it goes" if notice.deadline_ms else ""
        )
        self.metrics.note(
            f"reclaim notice for node(s) {', '.join(n[:12] for n in notice.preempted_node_ids)} "
            f"(ranks {notice.preempted_ranks}){left}: checkpoint at step {step}"
        )
        return True

    def _places(self, part: StepBlocks) -> list[int]:
        """Each pass's place in the global batch; padded passes take places past its end."""
        return [*part.chunks, *range(self.deal.blocks_per_step, self.deal.blocks_per_step + self.deal.passes)][
            : self.deal.passes
        ]

    def _inputs(self, part: StepBlocks, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's micro-batches, each cropped from its own place's seed, then the padding."""
        blocks = [*part.blocks, *[part.pad] * (self.deal.passes - len(part.blocks))]
        seed, kind = self.cfg.train.seed, self.cfg.data.augment
        images = []
        for block, place in zip(blocks, self._places(part)):
            pixels = block["image"].to(self.device, non_blocking=True)
            images.append(augment(pixels, kind, augment_seed(seed, step, place)) if kind != "none" else pixels)
        tokens = torch.cat([b["tokens"].to(self.device, non_blocking=True) for b in blocks])
        return normalize(torch.cat(images)), tokens

    def _log_and_save(self, step: int, just_in_time: bool = False) -> None:
        logged = {**self.metrics.log(step, self.cursor.wait_s), "step": step}
        if self.val_loss is not None:  # every report carries the latest, for early stopping
            logged["val_loss"] = self.val_loss
        self.reported = logged
        saving = self.checkpointer.due(step) or just_in_time
        if saving:
            self.checkpointer.save(step, wait=just_in_time)
        self.session.report(logged)
        if saving:
            self.metrics.note(f"checkpoint at step {step}")


def train_loop(config: dict) -> dict | None:
    """Ray Train's training function: `config["args"]` is the driver's WorkerArgs. Returns rank
    0's last report, the run's final metrics, which reach the driver as `Result.return_value`
    (pipelines/run/driver.py says why not `Result.metrics`); for a run relaunched once finished, which
    trains and reports nothing, the last report of the checkpoint it restores."""
    args: WorkerArgs = config["args"]
    trainer = Trainer(args, RaySession(args.cfg))
    trainer.restore()
    trainer.run()
    return trainer.reported if trainer.rank == 0 else None
