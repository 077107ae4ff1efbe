"""Training to the end on img2dataset's own layouts on a 2-CPU Ray with two training workers (where
parquet and mixed folders used to hang with zero rows), bad records counted by reason, the data
wait logged, and a pipeline that never yields failing with one error that says what it waited for."""

import os
import time

import pytest
from mlflow.tracking import MlflowClient

from mdc.config import load_config
from mdc.data import shards, storage
from mdc.data.img2dataset import damage_folder, generated_rows, write_img2dataset_folder
from pipelines.data.feed import DataStallError
from pipelines.run import driver as train

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]  # ~1 min alone; minutes on a shared machine

ROWS = generated_rows(60, image_size=32)


def run(tmp_path, name, uri, endpoint=None, **overrides):
    """Two steps of 8 per worker: the ~30 good samples of these folders give each worker one batch
    per epoch, so the first epoch, and with it every skip count, is complete before the run ends."""
    cfg = load_config(
        None,
        [
            f"name={name}",
            f"storage_uri={tmp_path / 'ckpt'}",
            f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"data.train_uri={uri}",
            "data.val_uri=null",
            "data.max_length=16",
            "data.shuffle_buffer=0",
            "train.batch_size=8",
            "workers.count=2",
            "train.steps=2",
            "train.log_every=1",
            "checkpoint.every=10",
            "optim.warmup_steps=1",
            *([f"data.endpoint_url={endpoint}"] if endpoint else []),
            *[f"{k.replace('__', '.')}={v}" for k, v in overrides.items()],
        ],
    )
    return train.run_training(cfg)


def upload(local_dir: str, uri: str, endpoint: str) -> None:
    for name in os.listdir(local_dir):
        with open(os.path.join(local_dir, name), "rb") as f:
            storage.write_bytes(storage.join(uri, name), f.read(), endpoint)


def test_webdataset_folder_with_side_files_trains_from_s3(ray_cluster, s3_server, tmp_path):
    local = str(tmp_path / "web")
    write_img2dataset_folder(ROWS, local, "webdataset", samples_per_shard=20)
    damaged = damage_folder(local, "webdataset")
    bucket = s3_server.make_bucket("img2dataset-web")
    upload(local, f"{bucket}/laion", s3_server.endpoint_url)
    summary = run(tmp_path, "web", f"{bucket}/laion", s3_server.endpoint_url)
    assert summary.metrics["step"] == 2
    # truncated tar, corrupt JPEG, empty and non-UTF-8 caption: once each, though both epochs read every shard
    assert summary.bad_records == damaged


def test_parquet_folder_with_failed_rows_trains(ray_cluster, tmp_path):
    out = str(tmp_path / "par")
    write_img2dataset_folder(ROWS, out, "parquet", samples_per_shard=20)
    damaged = damage_folder(out, "parquet")
    summary = run(tmp_path, "par", out)
    assert summary.metrics["step"] == 2
    failed = sum(r.jpg is None for r in ROWS[:40])  # the third shard is cut, so unreadable
    assert summary.bad_records == damaged | {shards.FAILED_DOWNLOAD: failed}


def test_mixed_folder_trains(ray_cluster, tmp_path):
    write_img2dataset_folder(ROWS[:30], str(tmp_path / "mixed" / "web"), "webdataset", samples_per_shard=10)
    write_img2dataset_folder(ROWS[30:], str(tmp_path / "mixed" / "par"), "parquet", samples_per_shard=10)
    summary = run(tmp_path, "mixed", tmp_path / "mixed", train__steps=3)  # two batches a worker per epoch
    assert summary.metrics["step"] == 3
    assert summary.bad_records == {shards.FAILED_DOWNLOAD: sum(r.jpg is None for r in ROWS[30:])}
    waits = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(
        summary.mlflow_run_id, "data_wait_fraction"
    )
    assert [m.step for m in waits] == [1, 2, 3] and all(0 <= m.value <= 1 for m in waits)


def test_a_source_that_never_yields_fails_with_one_error(ray_cluster, tmp_path, monkeypatch):
    import ray

    def never_yields(batch):
        time.sleep(3600)
        return batch

    def silent_dataset(*args, **kwargs):
        return ray.data.from_items([{"x": 0}]).map_batches(never_yields, num_cpus=0.25)

    monkeypatch.setattr(train, "build_dataset", silent_dataset)
    monkeypatch.setattr(train.shards, "list_shards", lambda *args: ["never-read.tar"])
    with pytest.raises(DataStallError) as info:  # within this test's timeout, although the source never ends
        run(tmp_path, "stall", tmp_path, data__stall_timeout_s=5, workers__max_failures=0)
    message = str(info.value)
    assert f"no batch from {tmp_path} reached training worker" in message
    assert "in 5 s (data.stall_timeout_s)" in message
    assert "Ray Data operator MapBatches(never_yields) has produced no rows" in message
    assert "CPU per reader" in message and "of the cluster's 2 CPUs are free, 1 held by the training workers" in message
