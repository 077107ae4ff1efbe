"""The main job on a real local Ray (2 CPUs) against a real S3 server: FSDP training from a bucket,
checkpoints in the bucket, bad records counted, resume after a stop, recovery from a killed worker.
The fault tests kill a worker at a chosen point (`Fault`), so the step sequence they assert is exact."""

import io
import math
import tarfile
import time

import boto3
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mdc.config import load_config
from mdc.data import shards, storage
from mdc.data.shapes import write_shapes_dataset
from mdc.training import checkpoint as ckpt
from pipelines.infra.ray_output import ray_output_to
from pipelines.run.driver import run_training
from pipelines.worker.callbacks import Fault

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]


def tiny_config(tmp_path, name, train_uri, val_uri=None, endpoint=None, storage_uri=None, settings=None):
    """A 2-worker tiny run; `settings`: more overrides by dotted path."""
    overrides = [
        f"name={name}",
        f"storage_uri={storage_uri or tmp_path / 'ckpt'}",
        f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"data.train_uri={train_uri}",
        f"data.val_uri={val_uri}" if val_uri else "data.val_uri=null",
        "data.max_length=16",
        "train.batch_size=8",
        "workers.count=2",
        "optim.warmup_steps=5",
    ]
    if endpoint:
        overrides.append(f"data.endpoint_url={endpoint}")
    overrides += [f"{k}={v}" for k, v in (settings or {}).items()]
    return load_config(None, overrides)


def metric_steps(cfg, run_id, key="loss"):
    history = MlflowClient(cfg.mlflow_uri).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


def corrupt_shards(s3_server, bucket_uri) -> None:
    """One truncated tar, one shard with a corrupt JPEG and an empty caption."""
    good = [shards.Sample(f"bad{i:03d}", shards_png(i), "a small red circle", None) for i in range(4)]
    bad = good + [shards.Sample("corrupt", b"\xff\xd8\xff\xe0 not a jpeg", "a caption", None)]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for s in bad:
            for name, data in ((f"{s.key}.jpg", s.image), (f"{s.key}.txt", s.caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("empty.jpg")
        info.size = len(good[0].image)
        tar.addfile(info, io.BytesIO(good[0].image))
        info = tarfile.TarInfo("empty.txt")
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))
    data = buf.getvalue()
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1")
    bucket = bucket_uri.removeprefix("s3://")
    s3.put_object(Bucket=bucket, Key="shapes/train/shard-bad.tar", Body=data)
    s3.put_object(Bucket=bucket, Key="shapes/train/shard-truncated.tar", Body=data[: len(data) // 2 + 100])


def shards_png(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (40 * i % 255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def ingest_actors_alive() -> set[str]:
    from ray.util.state import list_actors

    alive = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return {f"{a.class_name} {a.actor_id}" for a in alive if a.class_name in ("BadRecordLedger", "EpochPlanHolder")}


def test_fsdp_training_from_bucket_counts_bad_records(ray_cluster, s3_server, tmp_path, capfd):
    """Two workers from a bucket, checkpoints uploaded to it in the background
    (checkpoint.background); the fault tests below save synchronously."""
    bucket = s3_server.make_bucket("train-from-s3")
    write_shapes_dataset(f"{bucket}/shapes", num=300, seed=0, endpoint_url=s3_server.endpoint_url, samples_per_shard=50)
    corrupt_shards(s3_server, bucket)
    cfg = tiny_config(
        tmp_path,
        "s3-run",
        f"{bucket}/shapes/train",
        f"{bucket}/shapes/val",
        s3_server.endpoint_url,
        storage_uri=f"{bucket}/checkpoints",
        settings={
            "train.steps": 40,
            "checkpoint.every": 20,
            "train.log_every": 10,
            "validation.every": 20,
            "checkpoint.background": True,
        },
    )
    before = ingest_actors_alive()
    with ray_output_to(tmp_path / "ray.log"):
        summary = run_training(cfg)
        console = "".join(capfd.readouterr())
    deadline = time.monotonic() + 30
    while (left := ingest_actors_alive() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left  # the run's ingest actors ended with it: a study's runs share one driver

    # What a person sees: the progress lines and the warning, none of Ray's internals.
    for internal in ("core_worker.cc", "Reporting training result", "Running Dataset", "RayTrainWorker"):
        assert internal not in console, console
    assert len(console.splitlines()) < 60, console
    assert "s3-run step 40/40" in console and "skipped" in console and "checkpoint at step 20" in console
    assert "Reporting training result" in (tmp_path / "ray.log").read_text()

    losses = [v for _, v in metric_steps(cfg, summary.mlflow_run_id)]
    assert len(losses) == 40
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:5]) / 5
    assert summary.bad_records[shards.UNDECODABLE_IMAGE] >= 1
    assert summary.bad_records[shards.EMPTY_CAPTION] >= 1
    assert summary.bad_records[shards.TRUNCATED_TAR] == 1
    logged = MlflowClient(cfg.mlflow_uri).get_run(summary.mlflow_run_id).data.metrics
    assert logged["skipped/truncated_tar"] == 1
    keys = storage.list_files(f"{bucket}/checkpoints/s3-run", (".distcp", ".safetensors"), s3_server.endpoint_url)
    assert any("checkpoint_00000020" in k for k in keys)
    for step in (20, 40):  # both background uploads finished and were committed, checksums and all
        assert ckpt.problem(f"{bucket}/checkpoints/s3-run/checkpoint_{step:08d}", s3_server.endpoint_url) is None
    assert any(k.endswith("checkpoint_00000040/model.safetensors") for k in keys)


def _param_norm(state: dict) -> float:
    return math.sqrt(sum(float(v.float().pow(2).sum()) for v in state.values()))


def fault_config(tmp_path, name, shapes_dir, max_failures, **train):
    """8 steps, complete checkpoints at steps 3, 6 and 8; `train`: more train.* fields."""
    settings = {"train.steps": 8, "checkpoint.every": 3, "train.log_every": 2, "workers.max_failures": max_failures}
    return tiny_config(
        tmp_path, name, shapes_dir / "train", settings={**settings, **{f"train.{k}": v for k, v in train.items()}}
    )


def resumed_from(cfg, run_id) -> list[float]:
    return [v for _, v in metric_steps(cfg, run_id, "resumed_from_step")]


def test_worker_killed_after_a_checkpoint_resumes_from_it(ray_cluster, shapes_dir, tmp_path):
    """Rank 1 dies once checkpoint 6 is complete but before it is reported (where Ray Train's own
    record of it is lost): the restarted group resumes at 6, no step is repeated, and the run's
    final metrics are its last report, also when the finished run is launched again."""
    cfg = fault_config(tmp_path, "after-ckpt", shapes_dir, max_failures=1)
    cfg.data.augment = "crop"  # augmented batches go through the same resume
    summary = run_training(cfg, callbacks=[Fault(step=6, rank=1, marker=str(tmp_path / "fired"), at="committed")])
    assert (tmp_path / "fired").exists()
    assert summary.metrics["step"] == 8
    assert [s for s, _ in metric_steps(cfg, summary.mlflow_run_id)] == list(range(1, 9))
    assert resumed_from(cfg, summary.mlflow_run_id) == [6]
    tags = MlflowClient(cfg.mlflow_uri).get_run(summary.mlflow_run_id).data.tags
    assert tags["resumed_from"] == str(tmp_path / "ckpt" / "after-ckpt" / "checkpoint_00000006")
    # the final metrics come from Ray Train's Result: the restarted group's last report (step 8's)
    assert summary.metrics["loss"] == pytest.approx(dict(metric_steps(cfg, summary.mlflow_run_id))[8])
    again = run_training(cfg)  # relaunched once finished: it trains nothing and hands back the same
    assert again.metrics == summary.metrics


def test_worker_killed_mid_checkpoint_resumes_from_the_previous_one(ray_cluster, shapes_dir, tmp_path):
    """Rank 1 dies after writing its shard of checkpoint 6, before the checkpoint is complete:
    the incomplete directory is not used, the group resumes at 3 and repeats steps 4-6 only. Each
    step accumulates 2 micro-batches of 8 per worker (global batch 32)."""
    cfg = fault_config(tmp_path, "mid-ckpt", shapes_dir, max_failures=1, global_batch_size=32)
    summary = run_training(cfg, callbacks=[Fault(step=6, rank=1, marker=str(tmp_path / "fired"), at="shard_written")])
    assert (tmp_path / "fired").exists()
    assert [s for s, _ in metric_steps(cfg, summary.mlflow_run_id)] == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert resumed_from(cfg, summary.mlflow_run_id) == [3]
    assert summary.checkpoint_uri == str(tmp_path / "ckpt" / "mid-ckpt" / "checkpoint_00000008")
    assert (tmp_path / "ckpt" / "mid-ckpt" / "checkpoint_00000008" / "model.safetensors").is_file()


def test_relaunch_skips_a_damaged_checkpoint(ray_cluster, shapes_dir, tmp_path):
    """A run stopped at step 7, its newest checkpoint (6) then damaged on disk: launching it again
    resumes from checkpoint 3, with exactly the weights saved there."""
    cfg = fault_config(tmp_path, "damaged", shapes_dir, max_failures=0)
    with pytest.raises(Exception, match="injected fault at step 7"):
        run_training(cfg, callbacks=[Fault(step=7, rank=0, marker=str(tmp_path / "fired"), kill=False)])
    assert (tmp_path / "fired").read_text() == "7"  # the first launch stopped where it was told to
    run_dir = tmp_path / "ckpt" / "damaged"
    newest = run_dir / "checkpoint_00000006"
    assert ckpt.problem(str(newest)) is None  # complete before the flip, so only the flip can reject it
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert ckpt.problem(str(newest)) == "__1_0.distcp does not match its CRC-32 in " + ckpt.MARKER
    summary = run_training(cfg)

    assert [s for s, _ in metric_steps(cfg, summary.mlflow_run_id)] == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert resumed_from(cfg, summary.mlflow_run_id) == [3]
    dcp_to_torch_save(run_dir / "checkpoint_00000003", tmp_path / "k3.pt")
    expected = _param_norm(torch.load(tmp_path / "k3.pt", weights_only=True)["model"])
    [(_, restored)] = metric_steps(cfg, summary.mlflow_run_id, "resumed_param_norm")
    assert restored == pytest.approx(expected, rel=1e-5)


def test_unreachable_storage_fails_fast(ray_cluster, s3_server, tmp_path):
    closed = "http://127.0.0.1:9"  # discard port: nothing listens
    for cfg in (
        tiny_config(tmp_path, "x", "s3://some-bucket/train", endpoint=closed),
        tiny_config(tmp_path, "y", "s3://no-such-bucket/train", endpoint=s3_server.endpoint_url),
    ):
        start = time.monotonic()
        with pytest.raises(storage.StorageError, match=cfg.data.train_uri):
            run_training(cfg)
        assert time.monotonic() - start < 15


def test_ingest_streams_parquet_and_tar_alike(ray_cluster, tmp_path):
    import ray

    from pipelines.data.ingest import BadRecordLedgerActor, build_dataset

    for fmt in ("parquet", "webdataset"):
        write_shapes_dataset(str(tmp_path / fmt), num=120, seed=1, format=fmt, samples_per_shard=40)
    counts = {}
    for fmt in ("parquet", "webdataset"):
        counter = BadRecordLedgerActor.remote()
        ds = build_dataset(str(tmp_path / fmt / "train"), 32, 16, counter, shuffle_seed=None)
        batches = list(ds.iter_batches(batch_size=50, batch_format="numpy"))
        counts[fmt] = sum(len(b["tokens"]) for b in batches)
        assert batches[0]["image"].shape[1:] == (3, 32, 32)
        assert batches[0]["tokens"].shape[1] == 16
        assert ray.get(counter.get.remote()) == {}
    assert (
        counts["parquet"]
        == counts["webdataset"]
        == shards.read_manifest(str(tmp_path / "parquet"))["splits"]["train"]["num_samples"]
    )
