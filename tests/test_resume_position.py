"""Exact data position on resume (pipelines/data/position.py): the position arithmetic, the tagged
rows the read tasks yield, and one run killed after a checkpoint and resumed, whose rows trained
are compared with a whole epoch's."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from mdc.config import load_config
from mdc.data.img2dataset import damage_folder, generated_rows, write_img2dataset_folder
from mdc.training import checkpoint as ckpt
from pipelines.data import ingest
from pipelines.data.ingest import BadRecordLedger, EpochPlanHolder, Subset, read_shards
from pipelines.data.position import (
    DataPosition,
    EpochPlan,
    ShardTally,
    fingerprint,
    resume_point,
    shard_order,
    trained_shards,
)


def test_shards_consumed_and_the_one_begun_from_rows_summed_over_ranks():
    # shard 0: 10 rows, all trained (6 + 4 on two ranks); shard 1: 10 rows, 9 trained;
    # shard 2: its last batch not trained yet (row count unknown); shard 3: never reached
    trained = np.array([6, 5, 3, 0]) + np.array([4, 4, 0, 0])
    totals = np.maximum(np.array([10, 10, 0, 0]), np.array([10, 0, 0, 0]))
    assert trained_shards(trained, totals) == ({0}, {1: 9, 2: 3})


def test_tally_counts_rows_per_shard_and_keeps_what_was_trained_before(gloo_process_group):
    plan = EpochPlan(1, passed_over=frozenset({3}), rows_done={2: 4})
    tally = ShardTally(4, plan)
    tally.add(torch.tensor([0, 0, 1, 2]), torch.tensor([0, 0, 0, 0]))
    tally.add(torch.tensor([0, 1, 1, 2]), torch.tensor([0, 3, 3, 6]))  # last batches: 3 and 6 rows in all
    assert tally.trained.tolist() == [3, 3, 6, 0] and tally.totals.tolist() == [0, 3, 6, 0]
    assert tally.position("cpu") == ((1, 2, 3), {0: 3})  # shard 0's count is not known yet: begun
    assert ShardTally(4, plan, rank=1).trained.tolist() == [0, 0, 0, 0]  # rank 0 alone carries the rows before


def test_resume_point_goes_on_after_the_last_row_unless_the_position_does_not_fit():
    files = fingerprint(["a.tar", "b.tar", "c.tar"])
    position = DataPosition(epoch=2, shard_seed=0, shards=files, consumed=(0, 2), partial={1: 5})
    assert DataPosition.from_state(position.to_state()) == position
    assert DataPosition.from_state(json.loads(json.dumps(position.to_state()))) == position
    assert resume_point(position, 0, files, 3)[0] == EpochPlan(2, frozenset({0, 2}), {1: 5})
    assert resume_point(position, 1, files, 3)[0] == EpochPlan(3)  # another seed
    assert resume_point(position, 0, fingerprint(["a.tar", "b.tar"]), 2)[0] == EpochPlan(3)
    whole = DataPosition(epoch=2, shard_seed=0, shards=files, consumed=(0, 1, 2))
    assert resume_point(whole, 0, files, 3)[0] == EpochPlan(3)


def test_an_epochs_shard_order_is_its_seed_and_epoch():
    assert shard_order(None, 5, 4) == [0, 1, 2, 3]
    assert shard_order(7, 1, 50) == shard_order(7, 1, 50) != shard_order(7, 2, 50)
    assert sorted(shard_order(7, 1, 50)) == list(range(50))


class Actor:
    """Stands in for a Ray actor handle: `actor.method.remote(...)` calls the object's method."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        return type("Method", (), {"remote": staticmethod(getattr(self.obj, name))})


def two_shards(tmp_path, damaged=False):
    write_img2dataset_folder(
        generated_rows(20, image_size=32, failed_every=0), str(tmp_path), "webdataset", samples_per_shard=10
    )
    counts = damage_folder(str(tmp_path), "webdataset") if damaged else {}
    return (str(tmp_path / "00000.tar"), str(tmp_path / "00001.tar")), counts


PLACES = {"place": np.array([0, 1])}  # one read task for both places of the order


@pytest.fixture
def no_ray_get(monkeypatch):
    """The stand-in actors answer at once: ray.get passes their answers through."""
    monkeypatch.setattr(ingest.ray, "get", lambda answer, timeout: answer)


def test_read_tasks_tag_rows_with_their_shard_row_and_the_shards_row_count(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "DECODE_BATCH", 4)  # 10 rows a shard: batches of 4, 4 and 2
    files, _ = two_shards(tmp_path)
    out = list(read_shards(PLACES, files, 32, 16, None, None, Subset(None, "")))
    assert [len(b["tokens"]) for b in out] == [4, 4, 2, 4, 4, 2]
    assert np.concatenate([b["shard"] for b in out]).tolist() == [0] * 10 + [1] * 10
    assert np.concatenate([b["row"] for b in out]).tolist() == list(range(10)) * 2
    assert [b["shard_rows"].tolist() for b in out][:3] == [[0] * 4, [0] * 4, [10, 10]]  # on the last batch only


def test_skipped_shards_are_not_read_and_bad_records_are_counted_once(tmp_path, no_ray_get):
    """Shard 0 has a corrupt JPEG, an empty and a non-UTF-8 caption; shard 1 is cut short. A
    resumed epoch that passes over shard 0 reads shard 1 again: every count stays what one pass
    counted, in the live counter and in one restored from a checkpoint."""
    files, damaged = two_shards(tmp_path, damaged=True)
    counts, plan = BadRecordLedger(), EpochPlanHolder()
    first = list(read_shards(PLACES, files, 32, 16, Actor(counts), None, Subset(None, ""), Actor(plan)))
    assert counts.get() == damaged and set(np.concatenate([b["shard"] for b in first])) == {0, 1}

    plan.set(EpochPlan(0, passed_over=frozenset({0})))
    again = list(read_shards(PLACES, files, 32, 16, Actor(counts), None, Subset(None, ""), Actor(plan)))
    assert set(np.concatenate([b["shard"] for b in again])) == {1}
    assert counts.get() == damaged

    relaunched = BadRecordLedger()
    relaunched.restore(json.loads(json.dumps(counts.state())))  # as a checkpoint carries it
    list(read_shards(PLACES, files, 32, 16, Actor(relaunched), None, Subset(None, ""), Actor(plan)))
    assert relaunched.get() == damaged


def test_a_resumed_epoch_reads_its_order_from_the_next_row(tmp_path, monkeypatch, no_ray_get):
    """Epoch 3's order (shards seeded by (seed, epoch), rows in seeded windows); resumed after shard
    order[0] and 6 rows of order[1], the read tasks yield the rest of that order and nothing else."""
    monkeypatch.setattr(ingest, "DECODE_BATCH", 4)
    files, _ = two_shards(tmp_path)
    plan = EpochPlanHolder()
    plan.set(EpochPlan(3))
    options = (None, Subset(None, ""), Actor(plan), 11, 4)
    whole = [r for b in read_shards(PLACES, files, 32, 16, None, *options) for r in zip(b["shard"], b["row"])]
    first, second = shard_order(11, 3, 2)
    assert [s for s, _ in whole] == [first] * 10 + [second] * 10
    plan.set(EpochPlan(3, passed_over=frozenset({first}), rows_done={second: 6}))
    rest = [r for b in read_shards(PLACES, files, 32, 16, None, *options) for r in zip(b["shard"], b["row"])]
    assert rest == whole[16:]


# ------------------------------------------------------------------------------------- on Ray

SHARDS, ROWS_PER_SHARD = 8, 16  # one step trains 2 workers x 8 rows: an epoch is 8 steps


def trained_rows(directory) -> list[tuple[int, int, int, int, int]]:
    """(rank, epoch, step, shard, row) of every row a rank trained on (train.py's test hook)."""
    rows = []
    for rank in (0, 1):
        for line in (directory / f"rank{rank}.txt").read_text().splitlines():
            rows.append((rank, *map(int, line.split())))
    return rows


@pytest.mark.ray
@pytest.mark.timeout(600)  # ~1.5 min alone; minutes on a shared machine
def test_a_resumed_run_trains_the_rest_of_its_epoch(ray_cluster, tmp_path):
    """Rank 1 dies once checkpoint 3 is complete (48 rows trained: 3 of the 8 shards and no more).
    The restarted group goes on with epoch 0 from its next row: epoch 0 trains every row exactly
    once, as epoch 1 does, and every checkpoint holds the shards consumed and the rows begun that
    the rows trained say."""
    from pipelines.run.driver import run_training
    from pipelines.worker.callbacks import Fault, RowRecorder

    write_img2dataset_folder(
        generated_rows(SHARDS * ROWS_PER_SHARD, image_size=32, failed_every=0),
        str(tmp_path / "data"),
        "webdataset",
        samples_per_shard=ROWS_PER_SHARD,
    )
    cfg = load_config(
        None,
        [
            "name=resume",
            f"storage_uri={tmp_path / 'ckpt'}",
            f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"data.train_uri={tmp_path / 'data'}",
            "data.val_uri=null",
            "data.max_length=16",
            "train.batch_size=8",
            "workers.count=2",
            "train.steps=17",
            "train.log_every=1",
            "checkpoint.every=3",
            "checkpoint.keep=10",
            "workers.max_failures=1",
            "optim.warmup_steps=1",
        ],
    )
    (tmp_path / "rows").mkdir()
    summary = run_training(
        cfg,
        callbacks=[
            Fault(step=3, rank=1, marker=str(tmp_path / "fired"), at="committed"),
            RowRecorder(str(tmp_path / "rows")),
        ],
    )
    assert (tmp_path / "fired").exists() and summary.metrics["step"] == 17

    rows = trained_rows(tmp_path / "rows")
    steps = Counter((rank, step) for rank, _, step, _, _ in rows)
    assert steps == {(r, s): 8 for r in (0, 1) for s in range(1, 18)}  # each step once a rank, 8 rows
    every_row = sorted((s, r) for s in range(SHARDS) for r in range(ROWS_PER_SHARD))
    for epoch in (0, 1):  # 8 steps an epoch; epoch 0 resumed after its step 3
        assert sorted((s, r) for _, e, _, s, r in rows if e == epoch) == every_row
    for step in (3, 6, 9, 12, 15, 17):  # each checkpoint's position is what the rows trained say
        epoch = next(e for _, e, t, _, _ in rows if t == step)
        trained = Counter(s for _, e, t, s, _ in rows if e == epoch and t <= step)
        consumed = {s for s, n in trained.items() if n == ROWS_PER_SHARD}
        partial = {s: n for s, n in trained.items() if n < ROWS_PER_SHARD}
        assert len(partial) <= 1  # the steps trained are a prefix of the epoch's order
        saved = json.loads((tmp_path / "ckpt" / "resume" / f"checkpoint_{step:08d}" / ckpt.STATES).read_text())["data"][
            "data_position"
        ]  # the group's position, summed over ranks: rank 0 saves it for all
        partial_saved = {int(k): v for k, v in saved["partial"].items()}
        assert (saved["epoch"], set(saved["consumed"]), partial_saved) == (epoch, consumed, partial), step
