"""One order of the data, whatever spreads the work (pipelines/data/ingest.py, pipelines/data/seeds.py):
the rows a step trains depend on the seed and the step, not on the number of readers or workers."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray.train
from helpers import epoch_order, rows_by_step
from mlflow.tracking import MlflowClient

from mdc.config import load_config
from mdc.data.img2dataset import generated_rows, write_img2dataset_folder
from pipelines.data.ingest import IngestResources, ShuffleWindow, build_dataset, in_order_split, validation_dataset
from pipelines.infra import tracking


def test_a_shuffle_window_is_its_seed_and_shard():
    samples = list(range(10))
    first = list(ShuffleWindow(4, seed=1)(iter(samples), 3))
    assert sorted(first[:4]) == [0, 1, 2, 3] and sorted(first[4:8]) == [4, 5, 6, 7] and sorted(first[8:]) == [8, 9]
    assert first == list(ShuffleWindow(4, seed=1)(iter(samples), 3)) and first != samples
    assert first != list(ShuffleWindow(4, seed=1)(iter(samples), 4))  # another shard, another order
    assert list(ShuffleWindow(0, seed=1)(iter(samples), 3)) == samples


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """6 tar shards of 20 rows (32-px JPEGs, no failed rows)."""
    out = tmp_path_factory.mktemp("order")
    write_img2dataset_folder(generated_rows(120, image_size=32, failed_every=0), str(out), "webdataset", 20)
    return out


def row_order(folder, readers: int, world_size: int, block: int = 8) -> list[list[list[tuple[int, int]]]]:
    """(shard, row) of the rows of each block each of `world_size` training splits receives, through
    the split training uses, with `readers` read tasks at once (a thread per split, as each worker
    reads its own)."""
    resources = IngestResources(readers * 0.25, 0.25, readers)
    ds = build_dataset(str(folder), 32, 16, resources=resources, shuffle_seed=3, shuffle_window=7, rows_per_block=block)
    splits = in_order_split().configure({"train": ds}, world_size, None, None)

    def blocks(split) -> list[list[tuple[int, int]]]:
        batches = split["train"].iter_batches(batch_size=block, batch_format="numpy", drop_last=True)
        return [list(zip(b["shard"].tolist(), b["row"].tolist())) for b in batches]

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(blocks, splits))


@pytest.mark.timeout(600)
def test_the_rows_come_in_one_order_for_any_readers_and_workers(ray_cluster, folder):
    """One reader or four: the same order, block by block. Two workers: worker r gets blocks r, r + 2,
    … of it, so the global batch of a step is the same rows as with one worker. (Without Ray Data's
    order preserved, four readers gave another order.)"""
    [alone] = row_order(folder, readers=1, world_size=1)
    assert sorted(r for block in alone for r in block) == sorted((s, r) for s in range(6) for r in range(20))
    assert [s for block in alone for s, _ in block][:20] != [0] * 20  # shards shuffled, rows in windows
    assert row_order(folder, readers=4, world_size=1) == [alone]
    pair = row_order(folder, readers=4, world_size=2)
    assert [len(blocks) for blocks in pair] == [8, 7]  # every block dealt (Ray's equal split dropped the 15th)
    assert [pair[i % 2][i // 2] for i in range(15)] == alone


@pytest.mark.timeout(600)
def test_readers_that_finish_out_of_order_still_give_the_one_order(ray_cluster, tmp_path):
    """Shard 0 is 60 large images, shards 1-5 four small ones each: four readers finish the small
    ones first, yet the rows leave in the shards' order (sorted here: no seed), and the validation
    set is the first 64 rows of that order."""
    data, small = tmp_path / "data", tmp_path / "small"
    write_img2dataset_folder(generated_rows(60, image_size=384, failed_every=0), str(data), "webdataset", 60)
    write_img2dataset_folder(generated_rows(20, image_size=32, seed=1, failed_every=0), str(small), "webdataset", 4)
    for i in range(5):
        (small / f"{i:05d}.tar").rename(data / f"{i + 1:05d}.tar")
    readers = IngestResources(1.0, 0.25, 4)
    ds = build_dataset(str(data), 32, 16, resources=readers, shuffle_seed=None, rows_per_block=4)
    [split] = in_order_split().configure({"train": ds}, 1, None, None)
    rows = [(s, r) for b in split["train"].iter_batches(batch_format="numpy") for s, r in zip(b["shard"], b["row"])]
    assert rows == [(0, r) for r in range(60)] + [(s, r) for s in range(1, 6) for r in range(4)]
    # The validation set is the folder's first rows in that order too, not the first to be read
    # (unordered, `limit` kept the small shards' rows).
    val = validation_dataset(str(data), 32, 16, 64, resources=readers)
    rows = [(s, r) for b in val.iter_batches(batch_format="numpy") for s, r in zip(b["shard"], b["row"])]
    assert rows == [(0, r) for r in range(60)] + [(1, r) for r in range(4)]


GLOBAL_BATCH, STEPS, EPOCH_STEPS = 16, 9, 7


def run_config(tmp_path, name: str, workers: int, *overrides: str):
    """9 steps of global batch 16 (micro-batches of 8) on `workers` workers, crops on, over an
    epoch of 112 rows: 14 micro-batches, which 3 workers do not divide, so 7 steps an epoch."""
    if not (tmp_path / "data").exists():
        write_img2dataset_folder(
            generated_rows(112, image_size=32, failed_every=0), str(tmp_path / "data"), "webdataset", 40
        )
    return load_config(
        None,
        [
            f"name={name}",
            f"storage_uri={tmp_path / 'ckpt'}",
            f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"data.train_uri={tmp_path / 'data'}",
            "data.val_uri=null",
            "data.max_length=16",
            "data.augment=crop",
            "train.batch_size=8",
            f"train.global_batch_size={GLOBAL_BATCH}",
            f"workers.count={workers}",
            f"train.steps={STEPS}",
            "train.log_every=1",
            "checkpoint.every=3",
            *overrides,
        ],
    )


def rows_and_losses(tmp_path, cfg, run_id: str) -> tuple[dict, list[float]]:
    """The (shard, row) keys each step trained (all ranks, all launches) and the logged losses."""
    history = MlflowClient(tracking.absolute_tracking_uri(cfg.mlflow_uri)).get_metric_history(run_id, "loss")
    rows = {step: sorted(keys) for step, (keys, _) in rows_by_step(tmp_path / "rows").items()}
    return rows, [m.value for m in sorted(history, key=lambda m: m.step)]


@pytest.mark.timeout(1200)
def test_the_same_rows_and_losses_on_one_worker_two_three_and_after_a_resize(ray_cluster, tmp_path):
    """Global batch 16, crops on, 9 steps over two epochs of 7. One worker × 2 micro-batches,
    against two workers × 1 that stop after checkpoint 3 (a worker dies, no retry) and a relaunch
    on one worker, which resumes at step 4 (the checkpoint resharded 2 → 1), and against three
    workers, which the 2 micro-batches do not split over (each step one worker holds none and runs
    a weight-0 pass) and the epoch's 14 micro-batches do not divide (Ray's equal split gave them 12:
    epoch 0 ended after 6 steps, pipelines/data/deal.py): every step the same 16 rows, none twice,
    in both epochs, and the same losses but for float summation order (the same noise and crops for
    every chunk, pipelines/data/seeds.py)."""
    from pipelines.run.driver import run_training
    from pipelines.worker.callbacks import Fault, RowRecorder

    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    (one_dir / "rows").mkdir(parents=True)
    (two_dir / "rows").mkdir(parents=True)
    three_dir = tmp_path / "three"
    (three_dir / "rows").mkdir(parents=True)
    one = run_config(one_dir, "one-worker", 1)
    summary = run_training(one, callbacks=[RowRecorder(str(one_dir / "rows"))])
    rows_one, losses_one = rows_and_losses(one_dir, one, summary.mlflow_run_id)

    fault = Fault(step=3, rank=1, marker=str(two_dir / "fired"), at="committed")
    with pytest.raises(ray.train.TrainingFailedError):
        run_training(
            run_config(two_dir, "resized", 2, "workers.max_failures=0"),
            callbacks=[fault, RowRecorder(str(two_dir / "rows"))],
        )
    assert (two_dir / "fired").exists()
    resized = run_config(two_dir, "resized", 1)
    summary = run_training(resized, callbacks=[RowRecorder(str(two_dir / "rows"))])
    rows_two, losses_two = rows_and_losses(two_dir, resized, summary.mlflow_run_id)

    three = run_config(three_dir, "three-workers", 3, "workers.cpus=0.4")
    summary = run_training(three, callbacks=[RowRecorder(str(three_dir / "rows"))])
    rows_three, losses_three = rows_and_losses(three_dir, three, summary.mlflow_run_id)

    # step s trains rows 16(s - 1) … 16s - 1 of epoch 0's one order, then epoch 1's from its start
    order = epoch_order(one)[: GLOBAL_BATCH * EPOCH_STEPS] + epoch_order(one, 1)
    assert rows_one == {s: sorted(order[GLOBAL_BATCH * (s - 1) : GLOBAL_BATCH * s]) for s in range(1, STEPS + 1)}
    assert rows_two == rows_one  # steps 1-3 on two workers, 4-6 on one after the resume: no row twice
    assert rows_three == rows_one
    assert len(losses_one) == len(losses_two) == len(losses_three) == STEPS
    for losses in (losses_two, losses_three):
        difference = np.max(np.abs(np.array(losses_one) - np.array(losses)) / np.array(losses_one))
        print(f"largest relative difference of the per-step losses: {difference:.2e}")
        assert difference <= 1e-5
