"""The main job: Ray Train (FSDP2) over a Ray Data stream of image–caption shards.

`run_training` is the driver: it checks storage, builds the datasets, opens the MLflow run and
launches a `TorchTrainer`. `train_loop` runs on every worker: build and shard the model, restore the
newest complete checkpoint in the run's storage if there is one (a restarted worker group or a
relaunched run with the same name) and go on with its epoch's data where it left it
(pipelines/position.py), train, save DCP checkpoints there (mdc.train.checkpoint) with the data position
and report metrics through `ray.train.report`. Checkpoints are not handed to Ray Train: it records one only
once every rank has reported it, so a group that died in between would lose a checkpoint that is
already written; the completion marker in storage is the one record of what can be resumed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train.torch import TorchConfig, TorchTrainer

from mdc import registry
from mdc.config import ObjectiveConfig, RunConfig, dump_config
from mdc.data import shards, storage
from mdc.data.augment import augment
from mdc.data.images import normalize
from mdc.data.tokenizer import CaptionTokenizer
from mdc.models.captioner import PRESETS
from mdc.registry import build_model, compute_loss
from mdc.train import checkpoint as ckpt
from mdc.train.fsdp import prepare_model
from mdc.train.step import EMA, build_optimizer, build_scheduler, train_step
from pipelines import progress, reports, tracking
from pipelines.console import console
from pipelines.ingest import (
    BatchFeed,
    DataStallError,
    ShardSkips,
    SkipCounter,
    ask,
    build_dataset,
    describe_stall,
    ingest_resources,
)
from pipelines.position import DataPosition, ShardTally, fingerprint, resume_point
from pipelines.runtime import absolute_paths, check_inputs

SKIPPED = "skipped_by_shard"  # rank 0's extra state in a checkpoint: SkipCounts.by_shard


@dataclass
class Fault:
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

    def maybe_fire(self, step: int, rank: int, at: str = "step") -> None:
        if (step, rank, at) == (self.step, self.rank, self.at) and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(step))
            if self.kill:
                os._exit(1)
            raise RuntimeError(f"injected fault at step {step} ({at}) on rank {rank}")


@dataclass
class TrainSummary:
    run_name: str
    mlflow_run_id: str
    checkpoint_uri: str
    metrics: dict
    skipped: dict = field(default_factory=dict)


def image_size(cfg: RunConfig) -> int:
    return cfg.model.image_size or PRESETS[cfg.model.preset].image_size


def _step_generator(seed: int, rank: int, step: int, device) -> torch.Generator:
    """Noise (t, masks) depends only on (seed, rank, step): a resumed run draws what it would have."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + rank * 10_007 + step)


def _augment_seed(seed: int, rank: int, step: int) -> int:
    """The step's crops, apart from its noise: also reproducible on resume."""
    return 2**40 + seed * 1_000_003 + rank * 10_007 + step


def validation_objective(objective: ObjectiveConfig) -> ObjectiveConfig:
    """One yardstick across a sweep, the registry's `validation` of the objective: for every masking
    objective (whatever its training schedule or ratio) the masked-diffusion ELBO over t ∈ [T_MIN, 1]
    per non-pad token, estimated without bias (mdc/objectives/masked.py); exact NLL for AR ones; the
    baselines outside the family (clip, cdlm) are validated on their own loss."""
    fields = registry.objective(objective.name).validation
    return objective if fields is None else ObjectiveConfig(**fields)


@torch.no_grad()
def validation_loss(model, val_batches, objective: ObjectiveConfig, seed: int, device) -> float:
    """Mean validation loss on the held-out batches with fixed noise: comparable over time."""
    model.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(val_batches):
        gen = _step_generator(seed, 0, -1 - i, device)
        loss, _ = compute_loss(model, normalize(batch["image"].to(device)), batch["tokens"].to(device),
                               validation_objective(objective), gen)
        total, count = total + float(loss), count + 1
    model.train()
    return total / max(count, 1)


def param_norm(model) -> float:
    """L2 norm of all parameters, summed over the FSDP shards (collective)."""
    local = sum(p.to_local().float().pow(2).sum() for p in model.parameters())
    dist.all_reduce(local)
    return float(local.sqrt())


def mean_over_ranks(value: float, device) -> float:
    """The global batch's loss rather than rank 0's share of it."""
    tensor = torch.tensor(value, device=device)
    dist.all_reduce(tensor)
    return float(tensor) / dist.get_world_size()


def train_loop(loop_config: dict) -> None:
    cfg = RunConfig.model_validate(loop_config["cfg"])
    fault = Fault(**loop_config["fault"]) if loop_config.get("fault") else None
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    tc = cfg.train

    torch.manual_seed(tc.seed)  # identical initial weights on every rank before sharding
    model = build_model(cfg, CaptionTokenizer).to(device)
    prepare_model(model, device, bf16=tc.use_gpu, activation_checkpointing=tc.activation_checkpointing,
                  compile=tc.compile)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim.warmup_steps, tc.steps)
    ema = EMA(model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None

    run_dir, endpoint = loop_config["run_dir"], cfg.data.endpoint_url
    background = ckpt.Background() if tc.async_checkpoint else None
    shard_list, num_shards, shard_skips = loop_config["shards"], loop_config["num_shards"], loop_config["shard_skips"]
    skip_counter = loop_config["skip_counter"]
    step, state, extra_state = 0, None, {}
    restored = _choose_checkpoint(run_dir, endpoint, rank)
    if restored is not None:
        with ckpt.local_copy(restored, endpoint) as directory:
            state, extra_state = ckpt.load_training_state(directory, model, optimizer, scheduler, ema, rank)
        step = state["step"]
    epoch, skipped = _start_data(state, extra_state, loop_config, tc.seed, rank)

    restored_norm = param_norm(model) if restored is not None else None
    logger = reporter = None
    if rank == 0:
        logger = tracking.MetricLogger(loop_config["mlflow_uri"], loop_config["mlflow_run_id"])
        reporter = progress.Reporter(loop_config["progress"], cfg.name, tc.steps)
        if restored is not None:
            logger.log({"resumed_from_step": step, "resumed_param_norm": restored_norm}, step)
            logger.set_tag("resumed_from", restored)

    val_batches = []
    if cfg.data.val_uri:
        val = ray.train.get_dataset_shard("val")
        val_batches = list(val.iter_torch_batches(batch_size=tc.batch_size, drop_last=False))
    train_data = ray.train.get_dataset_shard("train")
    feed = BatchFeed(cfg.data.stall_timeout_s, partial(describe_stall, cfg.data.train_uri, cfg.data.stall_timeout_s,
                                                       rank, loop_config["ingest"], tc.num_workers * tc.cpus_per_worker))
    tic, images_seen, tokens_seen, waited = time.perf_counter(), 0, 0, 0.0
    last_val = None
    while step < tc.steps:
        batches_this_epoch, tally = 0, ShardTally(num_shards, skipped)
        for batch in feed(train_data.iter_torch_batches(  # one optimiser step's micro-batches at a time
                batch_size=tc.batch_size * tc.accumulation_steps, drop_last=True,
                local_shuffle_buffer_size=cfg.data.shuffle_buffer or None,
                local_shuffle_seed=tc.seed + epoch)):
            batches_this_epoch += 1
            if fault is not None:
                fault.maybe_fire(step + 1, rank)
            step += 1
            pixels = augment(batch["image"].to(device), cfg.data.augment, _augment_seed(tc.seed, rank, step))
            images, tokens = normalize(pixels), batch["tokens"].to(device)
            metrics = train_step(model, optimizer, scheduler, images, tokens, cfg.objective,
                                 cfg.optim.grad_clip, _step_generator(tc.seed, rank, step, device), ema,
                                 micro_batches=tc.accumulation_steps)
            tally.add(batch["shard"], batch["shard_rows"])
            if loop_config.get("trained_rows_dir"):
                _record_trained_rows(loop_config["trained_rows_dir"], rank, epoch, step, batch)
            images_seen += images.shape[0] * world
            tokens_seen += int((tokens != CaptionTokenizer.pad_id).sum()) * world
            metrics["loss"] = mean_over_ranks(metrics["loss"], device)
            metrics["epoch"] = epoch
            if val_batches and (step % tc.val_every == 0 or step == tc.steps):
                last_val = validation_loss(model, val_batches, cfg.objective, tc.seed, device)
                if reporter is not None:
                    reporter.note(f"validation at step {step}: val_loss {last_val:.4f}")
            if last_val is not None:  # every report carries the latest, for early stopping
                metrics["val_loss"] = last_val
            if logger is not None:
                logger.log(metrics, step)
            if step % tc.log_every == 0 or step == tc.steps:
                elapsed = time.perf_counter() - tic
                metrics.update(images_per_s=images_seen / elapsed, tokens_per_s=tokens_seen / elapsed,
                               data_wait_fraction=(feed.wait_s - waited) / elapsed)
                tic, images_seen, tokens_seen, waited = time.perf_counter(), 0, 0, feed.wait_s
                if logger is not None:
                    logger.log({k: metrics[k] for k in ("images_per_s", "tokens_per_s", "data_wait_fraction")}, step)
                    logger.flush()
            if reporter is not None:
                reporter.step(step, metrics, logged=step % tc.log_every == 0 or step == tc.steps)
            if step % tc.checkpoint_every == 0 or step == tc.steps:
                if logger is not None:
                    logger.flush()  # every step up to a checkpoint is in MLflow before it exists
                data_state = DataPosition(epoch, tc.seed, shard_list, tally.consumed(device)).to_state()  # collective
                if rank == 0:  # the skip counts of shards a relaunched run will not read again
                    data_state[SKIPPED] = ask(skip_counter.state.remote(), "the SkipCounter actor")
                _save_checkpoint(cfg, run_dir, model, optimizer, scheduler, ema,
                                 {"step": step, "epoch": epoch, "metrics": {**metrics, "step": step}},
                                 data_state, rank, fault, background)
                ray.train.report({**metrics, "step": step})
                if reporter is not None:
                    reporter.note(f"checkpoint at step {step}")
            elif step % tc.log_every == 0:
                ray.train.report({**metrics, "step": step})
            if step >= tc.steps:
                break
        if batches_this_epoch == 0 and not skipped:  # a resumed epoch's rest may not fill a batch
            raise RuntimeError(f"no full batch of {tc.batch_size * tc.accumulation_steps} in {cfg.data.train_uri} "
                               f"for rank {rank}: the dataset is smaller than global_batch_size")
        epoch += 1
        if skipped:  # the resumed epoch is over: the next ones are fresh passes
            skipped = frozenset()
            if rank == 0:
                ask(shard_skips.set.remote(skipped), "the ShardSkips actor")
            dist.barrier()
    if logger is not None:
        logger.flush()


def _start_data(state: dict | None, extra_state: dict, loop_config: dict, seed: int, rank: int
                ) -> tuple[int, frozenset[int]]:
    """Collective. (epoch, shards it passes over) for a run that starts from checkpoint `state`
    (None: from scratch): a resumed run goes on with its checkpoint's epoch (pipelines/position.py).
    Rank 0 decides, from its own extra state (so a changed world size cannot make ranks disagree),
    and tells the read tasks what to pass over, and the skip counter the counts of shards read
    before a relaunch, before any other rank may start reading."""
    start = [(0, frozenset())]
    if rank == 0:
        if state is not None:
            epoch, skipped, why = resume_point(DataPosition.from_state(extra_state), state["epoch"], seed,
                                               loop_config["shards"], loop_config["num_shards"])
            print(f"[mdc] data position at step {state['step']}: {why}", flush=True)
            start = [(epoch, skipped)]
        ask([loop_config["shard_skips"].set.remote(start[0][1]),
             loop_config["skip_counter"].restore.remote(extra_state.get(SKIPPED, {}))], "the ingest actors")
    dist.broadcast_object_list(start, src=0)  # also the barrier: the actors are set
    return start[0]


def _record_trained_rows(directory: str, rank: int, epoch: int, step: int, batch: dict) -> None:
    """Test hook (loop_config["trained_rows_dir"]): each rank appends "epoch step shard row" for
    every row it trained on, to check what a resumed run trains (tests/test_resume_position.py)."""
    with open(Path(directory, f"rank{rank}.txt"), "a") as f:
        f.writelines(f"{epoch} {step} {s} {r}\n" for s, r in zip(batch["shard"].tolist(), batch["row"].tolist()))


def _choose_checkpoint(run_dir: str, endpoint: str | None, rank: int) -> str | None:
    """The checkpoint every rank resumes from: rank 0 picks the newest complete one in storage,
    says which and why, and tells the others."""
    choice = [None]
    if rank == 0:
        choice[0], skipped = ckpt.newest_complete(run_dir, endpoint)
        for line in skipped:
            print(f"[mdc] {line}", flush=True)
        if choice[0] is not None:
            print(f"[mdc] resuming from {choice[0]}: the newest complete checkpoint in the run's storage",
                  flush=True)
        elif skipped:
            print(f"[mdc] no complete checkpoint in {run_dir}: starting from step 0", flush=True)
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _save_checkpoint(cfg, run_dir, model, optimizer, scheduler, ema, trainer_state, extra_state, rank,
                     fault: Fault | None, background: ckpt.Background | None = None) -> None:
    """Collective. Each rank stages its DCP shard locally and copies it into the run's storage;
    then rank 0 marks the checkpoint complete and deletes the ones no longer kept. With
    `background` (train.async_checkpoint) training resumes once the shards are staged, and the
    copy and commit finish in a thread. The last checkpoint, finished before returning, also
    carries the exported full weights for evaluation."""
    step, endpoint = trainer_state["step"], cfg.data.endpoint_url
    uri = ckpt.checkpoint_dir(run_dir, step)
    final = step == cfg.train.steps
    if background is not None:
        background.wait()  # one checkpoint in flight at a time
    weights = ckpt.full_weights(model, ema) if final else None  # collective: every rank calls
    if rank == 0:
        ckpt.remove(uri, endpoint)  # what an interrupted attempt at this step left
    dist.barrier()
    directory = tempfile.mkdtemp(prefix="mdc-checkpoint-")
    ckpt.stage_training_state(directory, model, optimizer, scheduler, ema, trainer_state, extra_state, rank)
    if final and rank == 0:
        ckpt.export_weights(directory, weights, dump_config(cfg))

    def finish() -> None:
        try:
            written = ckpt.upload_shard(directory, uri, endpoint)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if fault is not None:
            fault.maybe_fire(step, rank, "shard_written")
        ckpt.commit(uri, step, written, rank, endpoint, group=background.group if background else None)
        if rank == 0:
            ckpt.prune(run_dir, step, cfg.train.keep_checkpoints, endpoint)
        if fault is not None:
            fault.maybe_fire(step, rank, "committed")

    if background is None:
        finish()
    else:
        background.submit(finish)
        if final:
            background.wait()


def storage_for(uri: str, endpoint_url: str | None):
    """(storage_path, filesystem) for Ray's RunConfig: an absolute local path, or bucket/prefix."""
    if uri.startswith("s3://"):
        fs, path = storage.open_fs(uri, endpoint_url)
        return path, fs
    return str(Path(uri).resolve()), None


def run_training(cfg: RunConfig, fault: Fault | None = None, parent_run_id: str | None = None,
                 callbacks: list | None = None, channel=None, trained_rows_dir: str | None = None) -> TrainSummary:
    """Driver: fails fast on bad inputs, then trains and returns where everything went.
    `parent_run_id` nests the MLflow run under a sweep; `callbacks` go to Ray Train (e.g. Tune's).
    `channel` (a progress.ProgressChannel) is given by a caller that shows several runs at once (a
    sweep); without one, the run draws its own progress display on the console.
    `fault` and `trained_rows_dir` (where each rank writes the rows it trained on) are for tests."""
    cfg = absolute_paths(cfg)
    check_inputs(cfg)
    own_display = channel is None
    channel = channel or progress.open_channel()
    with progress.ProgressDisplay(channel, console) if own_display else contextlib.nullcontext():
        summary = _train(cfg, fault, parent_run_id, callbacks, channel, trained_rows_dir)
        log_training_report(cfg, summary, progress.Reporter(channel, cfg.name, cfg.train.steps))
    return summary


def log_training_report(cfg: RunConfig, summary: TrainSummary, reporter: progress.Reporter) -> None:
    """The loss curves and a page of held-out captions, as artifacts of the run's MLflow run. A
    failure here is reported and leaves the finished training as it is."""
    try:
        with tempfile.TemporaryDirectory() as directory:
            paths = reports.training_report(cfg, summary, Path(directory))
            tracking.log_artifacts(tracking.absolute_tracking_uri(cfg.mlflow_uri), summary.mlflow_run_id, paths, "report")
    except Exception as err:
        reporter.note(f"no training report: {type(err).__name__}: {err}", warning=True)


def _train(cfg: RunConfig, fault: Fault | None, parent_run_id: str | None, callbacks: list | None,
           channel, trained_rows_dir: str | None = None) -> TrainSummary:
    data = cfg.data
    driver = progress.Reporter(channel, cfg.name, cfg.train.steps)
    driver.note(f"preparing data ({data.train_uri}) and {cfg.train.num_workers} training workers")
    mlflow_uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    run_id = tracking.get_or_create_run(mlflow_uri, cfg.experiment, cfg.name, cfg.model_dump(), parent_run_id)

    ray.data.DataContext.get_current().enable_operator_progress_bars = False  # one bar per dataset
    counter, shard_skips = SkipCounter.remote(), ShardSkips.remote()
    train_shards = shards.list_shards(data.train_uri, data.format, data.endpoint_url)
    size = image_size(cfg)
    training_cpus = cfg.train.num_workers * cfg.train.cpus_per_worker
    cluster_cpus = ray.cluster_resources().get("CPU", 0.0)
    resources = ingest_resources(cluster_cpus, training_cpus, data.ingest_cpus,
                                 held_cpus=cluster_cpus - ray.available_resources().get("CPU", 0.0))
    datasets = {"train": build_dataset(data.train_uri, size, data.max_length, counter, data.endpoint_url,
                                       resources, shuffle_seed=cfg.train.seed, subset_fraction=data.subset_fraction,
                                       subset_salt=data.subset_salt, format=data.format, skips=shard_skips,
                                       files=train_shards)}
    if data.val_uri:
        n_val = cfg.train.val_batches * cfg.train.batch_size
        datasets["val"] = build_dataset(data.val_uri, size, data.max_length, counter, data.endpoint_url,
                                        shuffle_seed=None, format=data.format).limit(n_val).materialize()

    storage_path, filesystem = storage_for(cfg.storage_uri, data.endpoint_url)
    run_dir = storage.join(cfg.storage_uri if storage.is_s3(cfg.storage_uri) else storage_path, cfg.name)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"cfg": cfg.model_dump(), "mlflow_uri": mlflow_uri, "mlflow_run_id": run_id,
                           "run_dir": run_dir, "fault": fault.__dict__ if fault else None, "progress": channel,
                           "ingest": resources, "shards": fingerprint(train_shards), "num_shards": len(train_shards),
                           "shard_skips": shard_skips, "skip_counter": counter, "trained_rows_dir": trained_rows_dir},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
            resources_per_worker={"CPU": cfg.train.cpus_per_worker, **({"GPU": 1} if cfg.train.use_gpu else {})}),
        run_config=ray.train.RunConfig(
            name=cfg.name, storage_path=storage_path, storage_filesystem=filesystem,
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures), callbacks=callbacks),
        datasets=datasets,
        dataset_config=ray.train.DataConfig(datasets_to_split=["train"]),
        torch_config=TorchConfig(backend="nccl" if cfg.train.use_gpu else "gloo"),
    )
    try:
        trainer.fit()
    except Exception as err:
        tracking.finish_run(mlflow_uri, run_id, "FAILED")
        stall = next((e for e in getattr(err, "worker_failures", {}).values() if isinstance(e, DataStallError)), None)
        if stall is not None:
            raise DataStallError(str(stall.args[0] if stall.args else stall)) from None
        raise
    skipped = ray.get(counter.get.remote())
    if skipped:
        driver.note(f"skipped {sum(skipped.values())} bad records: "
                    + ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())), warning=True)
    logger = tracking.MetricLogger(mlflow_uri, run_id)
    logger.log({f"skipped/{reason}": n for reason, n in skipped.items()} | {"skipped/total": sum(skipped.values())},
               cfg.train.steps)
    logger.flush()
    tracking.finish_run(mlflow_uri, run_id)
    final = ckpt.checkpoint_dir(run_dir, cfg.train.steps)
    return TrainSummary(cfg.name, run_id, final, ckpt.read_trainer_state(final, data.endpoint_url)["metrics"],
                        skipped)
