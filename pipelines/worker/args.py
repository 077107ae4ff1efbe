"""The typed arguments the driver hands every worker (Ray pickles them into `train_loop_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mdc.config import RunConfig
from pipelines.data.ingest import IngestActors, IngestResources
from pipelines.worker.callbacks import Callback


@dataclass(frozen=True, kw_only=True)
class WorkerArgs:
    cfg: RunConfig
    run_dir: str  # where checkpoints go: a local folder or s3://bucket/prefix
    mlflow_uri: str
    mlflow_run_id: str
    progress: Any  # progress.ProgressChannel, or anything with .push.remote(event)
    ingest: IngestResources  # what a data stall report says ingest was given
    shard_list_id: str  # position.fingerprint of the sorted shard list
    num_shards: int
    actors: IngestActors | None  # None: no ingest actors (a run outside Ray Data, e.g. a test)
    callbacks: tuple[Callback, ...] = ()  # tests: fault injection, row recording, worker-group logs and holds
    evaluation_queue: Any = None  # online_eval.EvaluationQueueActor when eval.probe_every / compositionality_every
