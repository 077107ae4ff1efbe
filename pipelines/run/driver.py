"""The main job: Ray Train (FSDP2) over a Ray Data stream of image–caption shards.

`run_training` is the driver: it checks storage, builds the datasets, opens the MLflow run and
launches a `TorchTrainer`. Every worker runs `pipelines.worker.trainer.train_loop`: it restores the newest complete
checkpoint in the run's storage if there is one (a restarted worker group or a relaunched run with
the same name), goes on with its epoch's data where it left it (pipelines/data/position.py), trains,
saves DCP checkpoints there and reports metrics through `ray.train.report`.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from mdc.config import RunConfig, WorkersConfig
from mdc.data import shards, storage
from mdc.evaluation import suite
from mdc.models.captioner import PRESETS
from mdc.training import checkpoint as ckpt
from pipelines.data.feed import DataStallError
from pipelines.data.ingest import (
    BadRecordLedgerActor,
    EpochPlanActor,
    IngestActors,
    IngestResources,
    build_dataset,
    in_order_split,
    ingest_resources,
    validation_dataset,
)
from pipelines.data.position import fingerprint
from pipelines.infra import progress, tracking
from pipelines.infra.actors import on_driver_node
from pipelines.infra.console import console
from pipelines.infra.run_inputs import absolute_paths, check_inputs
from pipelines.run import model_registry, online_eval, reports
from pipelines.run.online_eval import EvaluationQueueActor
from pipelines.worker.args import WorkerArgs
from pipelines.worker.callbacks import Callback
from pipelines.worker.checkpointer import check_global_batch
from pipelines.worker.trainer import train_loop


@dataclass
class TrainSummary:
    run_name: str
    mlflow_run_id: str
    checkpoint_uri: str
    metrics: dict
    bad_records: dict = field(default_factory=dict)  # records skipped, by reason
    online: list = field(default_factory=list)  # the online evaluations' figures by step (online_eval)


def image_size(cfg: RunConfig) -> int:
    return cfg.model.image_size or PRESETS[cfg.model.preset].image_size


def storage_for(uri: str, endpoint_url: str | None):
    """(storage_path, filesystem) for Ray's RunConfig: an absolute local path, or bucket/prefix."""
    if uri.startswith("s3://"):
        fs, path = storage.open_fs(uri, endpoint_url)
        return path, fs
    return str(Path(uri).resolve()), None


def run_training(
    cfg: RunConfig,
    *,
    parent_run_id: str | None = None,
    ray_callbacks: list | None = None,
    channel=None,
    callbacks: tuple[Callback, ...] = (),
) -> TrainSummary:
    """Driver: fails fast on bad inputs, then trains and returns where everything went.
    `parent_run_id` nests the MLflow run under a sweep; `ray_callbacks` go to Ray Train (e.g. Tune's).
    `channel` (a progress.ProgressChannel) is given by a caller that shows several runs at once (a
    sweep); without one, the run draws its own progress display on the console.
    `callbacks` (pipelines/worker/callbacks.py: fault injection, row recording, worker-group logs)
    go to every worker's trainer; they are for tests."""
    cfg = suite.resolve_section(absolute_paths(cfg))  # what it evaluates, in the config it exports
    check_inputs(cfg)
    own_display = channel is None
    channel = channel or progress.open_channel()
    with progress.ProgressDisplay(channel, console) if own_display else contextlib.nullcontext():
        summary = _train(
            cfg, parent_run_id=parent_run_id, ray_callbacks=ray_callbacks, channel=channel, callbacks=tuple(callbacks)
        )
        log_training_report(cfg, summary, progress.Reporter(channel, cfg.name, cfg.train.steps))
        model_registry.register_training_run(
            cfg, summary.mlflow_run_id, summary.checkpoint_uri, progress.Reporter(channel, cfg.name, cfg.train.steps)
        )
    return summary


def log_training_report(cfg: RunConfig, summary: TrainSummary, reporter: progress.Reporter) -> None:
    """The loss curves and a page of held-out captions, as artifacts of the run's MLflow run. A
    failure here is reported and leaves the finished training as it is."""
    try:
        with tempfile.TemporaryDirectory() as directory:
            paths = reports.training_report(cfg, summary, Path(directory))
            tracking.log_artifacts(
                tracking.absolute_tracking_uri(cfg.mlflow_uri), summary.mlflow_run_id, paths, "report"
            )
    except Exception as err:
        reporter.note(f"no training report: {type(err).__name__}: {err}", warning=True)


def _train(
    cfg: RunConfig,
    *,
    parent_run_id: str | None,
    ray_callbacks: list | None,
    channel,
    callbacks: tuple[Callback, ...],
) -> TrainSummary:
    data = cfg.data
    driver = progress.Reporter(channel, cfg.name, cfg.train.steps)
    driver.note(f"preparing data ({data.train_uri}) and {workers_text(cfg.workers)} training workers")
    storage_path, filesystem = storage_for(cfg.storage_uri, data.endpoint_url)
    run_dir = storage.join(cfg.storage_uri if storage.is_s3(cfg.storage_uri) else storage_path, cfg.name)
    check_global_batch(cfg, run_dir)  # before the MLflow run: a refused relaunch leaves it as it was
    mlflow_uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    train_shards = shards.list_shards(data.train_uri, data.format, data.endpoint_url)
    run_id = tracking.get_or_create_run(mlflow_uri, cfg.experiment, cfg.name, cfg.model_dump(), parent_run_id)
    with tracking.ended_on_error(mlflow_uri, run_id), _run_actors() as actors:  # never left RUNNING
        resources, datasets = _datasets(cfg, actors, train_shards)
        with online_eval.reserved(cfg) as evaluation:  # before the worker group asks for its resources
            evaluator = _evaluator(cfg, mlflow_uri, run_id, evaluation)
            args = WorkerArgs(
                cfg=cfg,
                run_dir=run_dir,
                mlflow_uri=mlflow_uri,
                mlflow_run_id=run_id,
                progress=channel,
                ingest=resources,
                shard_list_id=fingerprint(train_shards),
                num_shards=len(train_shards),
                actors=actors,
                callbacks=callbacks,
                evaluation_queue=evaluator,
            )
            trainer = TorchTrainer(
                train_loop,
                train_loop_config={"args": args},
                scaling_config=scaling_config(cfg.workers),
                run_config=ray.train.RunConfig(
                    name=cfg.name,
                    storage_path=storage_path,
                    storage_filesystem=filesystem,
                    failure_config=ray.train.FailureConfig(
                        max_failures=cfg.workers.max_failures,
                        max_preemption_failures=cfg.workers.max_preemption_failures,
                    ),
                    callbacks=ray_callbacks,
                ),
                datasets=datasets,
                dataset_config=in_order_split(),
                torch_config=TorchConfig(backend="nccl" if cfg.workers.use_gpu else "gloo"),
            )
            try:
                result = trainer.fit()
            except Exception as err:  # the run ends FAILED (ended_on_error)
                stall = next(
                    (e for e in getattr(err, "worker_failures", {}).values() if isinstance(e, DataStallError)), None
                )
                if stall is not None:
                    raise DataStallError(str(stall.args[0] if stall.args else stall)) from None
                raise
            online = _online_results(cfg, evaluator, driver)
            bad_records = ray.get(actors.bad_records.get.remote())
            return _finish(cfg, mlflow_uri, run_id, run_dir, final_metrics(result), bad_records, driver, online)


def final_metrics(result: ray.train.Result) -> dict:
    """The run's final metrics: rank 0's last report, which `train_loop` returns. Not
    `Result.metrics`: Ray Train V2 fills that only from reports that carried a checkpoint, and mdc
    hands Ray none (pipelines/worker/checkpointer.py). The return value is the one of the group that
    finished, so it holds after a worker-group restart; a relaunched finished run returns the last
    report of the checkpoint it restored."""
    return result.return_value


def scaling_config(workers: WorkersConfig) -> ray.train.ScalingConfig:
    """The worker group: N workers, or with an elastic [MIN, MAX] as many as fit in that range."""
    return ray.train.ScalingConfig(
        num_workers=(workers.min, workers.max) if workers.elastic else workers.min,
        use_gpu=workers.use_gpu,
        resources_per_worker={
            "CPU": workers.cpus,
            **({"GPU": 1} if workers.use_gpu else {}),
            **workers.resources,
        },
        placement_strategy=workers.placement,
        elastic_resize_monitor_interval_s=workers.resize_check_s,
    )


def workers_text(workers: WorkersConfig) -> str:
    return f"{workers.min} to {workers.max} (elastic)" if workers.elastic else str(workers.min)


@contextlib.contextmanager
def _run_actors() -> Iterator[IngestActors]:
    """The run's ingest actors: on the driver's node, so they stay with the driver when a worker
    node is lost. They end with the run: the runs of a study or sweep share one driver, which
    would otherwise keep every finished run's actors (a process each) until it exits."""
    here = on_driver_node()
    actors = IngestActors(
        bad_records=BadRecordLedgerActor.options(scheduling_strategy=here).remote(),
        epoch_plan=EpochPlanActor.options(scheduling_strategy=here).remote(),
    )
    try:
        yield actors
    finally:
        for actor in (actors.bad_records, actors.epoch_plan):
            ray.kill(actor)


def _evaluator(cfg: RunConfig, mlflow_uri: str, run_id: str, evaluation):
    """With online evaluation, the run's evaluator (on the driver's node, like the ingest actors),
    which runs its tasks in the `evaluation` bundle."""
    if not cfg.eval.enabled:
        return None
    return EvaluationQueueActor.options(scheduling_strategy=on_driver_node()).remote(
        cfg, mlflow_uri, run_id, evaluation
    )


def _online_results(cfg: RunConfig, evaluator, driver: progress.Reporter) -> list[dict]:
    """The online evaluations, once the last has finished (at most eval.timeout_s from now)."""
    if evaluator is None:
        return []
    driver.note("waiting for the online evaluations of the last checkpoints")
    results = ray.get(evaluator.results.remote(cfg.eval.timeout_s))
    driver.note(online_eval.summary_line(results), warning=any("error" in r for r in results))
    return results


def _datasets(cfg: RunConfig, actors: IngestActors, train_shards: list[str]) -> tuple[IngestResources, dict]:
    """What ingest may use beside the training workers, and the train (streamed, split over the
    workers) and val (a few batches, materialised) datasets."""
    data, size = cfg.data, image_size(cfg)
    ray.data.DataContext.get_current().enable_operator_progress_bars = False  # one bar per dataset
    training_cpus = cfg.workers.max * cfg.workers.cpus  # room for the group at its largest
    cluster_cpus = ray.cluster_resources().get("CPU", 0.0)
    resources = ingest_resources(
        cluster_cpus,
        training_cpus,
        data.ingest_cpus,
        held_cpus=cluster_cpus - ray.available_resources().get("CPU", 0.0),
        eval_cpus=cfg.eval.cpus if cfg.eval.enabled else 0.0,
    )
    datasets = {
        "train": build_dataset(
            data.train_uri,
            size,
            data.max_length,
            actors.bad_records,
            data.endpoint_url,
            resources,
            shuffle_seed=cfg.train.seed,
            subset_fraction=data.subset_fraction,
            subset_salt=data.subset_salt,
            format=data.format,
            epoch_plan=actors.epoch_plan,
            files=train_shards,
            shuffle_window=data.shuffle_buffer,
            rows_per_block=cfg.train.batch_size,
        )
    }
    if data.val_uri:
        datasets["val"] = validation_dataset(
            data.val_uri,
            size,
            data.max_length,
            cfg.validation.batches * cfg.train.batch_size,
            actors.bad_records,
            data.endpoint_url,
            format=data.format,
        )
    return resources, datasets


def _finish(
    cfg: RunConfig,
    mlflow_uri: str,
    run_id: str,
    run_dir: str,
    metrics: dict,
    bad_records: dict,
    driver: progress.Reporter,
    online: list[dict],
) -> TrainSummary:
    """The bad-record counts said and logged, the MLflow run closed, and where the run ended."""
    if bad_records:
        driver.note(
            f"skipped {sum(bad_records.values())} bad records: "
            + ", ".join(f"{n} {reason}" for reason, n in sorted(bad_records.items())),
            warning=True,
        )
    tracking.log_metrics(
        mlflow_uri,
        run_id,
        {f"skipped/{reason}": n for reason, n in bad_records.items()} | {"skipped/total": sum(bad_records.values())},
        cfg.train.steps,
    )
    tracking.finish_run(mlflow_uri, run_id)
    return TrainSummary(cfg.name, run_id, ckpt.checkpoint_dir(run_dir, cfg.train.steps), metrics, bad_records, online)
