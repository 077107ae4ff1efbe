"""Exact data position on resume (pipelines/position.py): the position arithmetic, the tagged
rows the read tasks yield, and one run killed after a checkpoint and resumed, whose rows trained
are compared with a whole epoch's."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from mdc.config import load_config
from mdc.data.img2dataset import damage_folder, generated_rows, write_img2dataset_folder
from pipelines import ingest
from pipelines.ingest import BadRecordLedger, PassedOverShards, Subset, read_shards
from pipelines.position import DataPosition, ShardTally, consumed_shards, fingerprint, resume_point


def test_a_shard_is_consumed_when_its_rows_summed_over_ranks_are_all_trained():
    # shard 0: 10 rows, all trained (6 + 4 on two ranks); shard 1: 10 rows, 9 trained;
    # shard 2: its last batch not trained yet (row count unknown); shard 3: never reached
    trained = np.array([6, 5, 3, 0]) + np.array([4, 4, 0, 0])
    totals = np.maximum(np.array([10, 10, 0, 0]), np.array([10, 0, 0, 0]))
    assert consumed_shards(trained, totals) == {0}


def test_tally_counts_rows_per_shard_and_keeps_what_was_skipped(gloo_process_group):
    tally = ShardTally(4, passed_over=frozenset({3}))
    tally.add(torch.tensor([0, 0, 1, 2]), torch.tensor([0, 0, 0, 0]))
    tally.add(torch.tensor([0, 1, 1]), torch.tensor([0, 3, 3]))  # shard 1's last batch: 3 rows in all
    assert tally.trained.tolist() == [3, 3, 1, 0] and tally.totals.tolist() == [0, 3, 0, 0]
    assert tally.consumed("cpu") == (1, 3)  # shard 0's count is not known yet: not consumed


def test_resume_point_goes_on_with_the_epoch_unless_the_position_does_not_fit():
    files = fingerprint(["a.tar", "b.tar", "c.tar"])
    position = DataPosition(epoch=2, shard_seed=0, shards=files, consumed=(0, 2))
    assert DataPosition.from_state(position.to_state()) == position
    assert DataPosition.from_state(json.loads(json.dumps(position.to_state()))) == position
    assert resume_point(position, 2, 0, files, 3)[:2] == (2, frozenset({0, 2}))
    assert resume_point(None, 2, 0, files, 3)[:2] == (3, frozenset())  # an older checkpoint: fresh pass
    assert resume_point(position, 2, 1, files, 3)[:2] == (3, frozenset())  # another seed
    assert resume_point(position, 2, 0, fingerprint(["a.tar", "b.tar"]), 2)[:2] == (3, frozenset())
    whole = DataPosition(epoch=2, shard_seed=0, shards=files, consumed=(0, 1, 2))
    assert resume_point(whole, 2, 0, files, 3)[:2] == (3, frozenset())


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
    return {
        "shard": np.array([str(tmp_path / "00000.tar"), str(tmp_path / "00001.tar")]),
        "index": np.array([0, 1]),
    }, counts


@pytest.fixture
def no_ray_get(monkeypatch):
    """The stand-in actors answer at once: ray.get passes their answers through."""
    monkeypatch.setattr(ingest.ray, "get", lambda answer, timeout: answer)


def test_read_tasks_tag_rows_with_their_shard_row_and_the_shards_row_count(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "DECODE_BATCH", 4)  # 10 rows a shard: batches of 4, 4 and 2
    batch, _ = two_shards(tmp_path)
    out = list(read_shards(batch, 32, 16, None, None, Subset(None, "")))
    assert [len(b["tokens"]) for b in out] == [4, 4, 2, 4, 4, 2]
    assert np.concatenate([b["shard"] for b in out]).tolist() == [0] * 10 + [1] * 10
    assert np.concatenate([b["row"] for b in out]).tolist() == list(range(10)) * 2
    assert [b["shard_rows"].tolist() for b in out][:3] == [[0] * 4, [0] * 4, [10, 10]]  # on the last batch only


def test_skipped_shards_are_not_read_and_bad_records_are_counted_once(tmp_path, no_ray_get):
    """Shard 0 has a corrupt JPEG, an empty and a non-UTF-8 caption; shard 1 is cut short. A
    resumed epoch that passes over shard 0 reads shard 1 again: every count stays what one pass
    counted, in the live counter and in one restored from a checkpoint."""
    batch, damaged = two_shards(tmp_path, damaged=True)
    counts, skips = BadRecordLedger(), PassedOverShards()
    first = list(read_shards(batch, 32, 16, Actor(counts), None, Subset(None, ""), Actor(skips)))
    assert counts.get() == damaged and set(np.concatenate([b["shard"] for b in first])) == {0, 1}

    skips.set({0})
    again = list(read_shards(batch, 32, 16, Actor(counts), None, Subset(None, ""), Actor(skips)))
    assert set(np.concatenate([b["shard"] for b in again])) == {1}
    assert counts.get() == damaged

    relaunched = BadRecordLedger()
    relaunched.restore(json.loads(json.dumps(counts.state())))  # as a checkpoint carries it
    list(read_shards(batch, 32, 16, Actor(relaunched), None, Subset(None, ""), Actor(skips)))
    assert relaunched.get() == damaged


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
    """Rank 1 dies once checkpoint 3 is complete (each rank has trained 24 rows: shards in flight).
    The restarted group goes on with epoch 0 without the shards consumed by then: epoch 0 trains
    the rows an uninterrupted epoch does (epoch 1 of the same run: every row once), only rows of
    shards in flight at the checkpoint twice, and every checkpoint holds what was consumed."""
    from pipelines.train import Fault, run_training

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
            "data.shuffle_buffer=0",
            "train.batch_size=8",
            "train.num_workers=2",
            "train.steps=17",
            "train.log_every=1",
            "train.checkpoint_every=3",
            "train.keep_checkpoints=10",
            "train.max_failures=1",
            "optim.warmup_steps=1",
        ],
    )
    (tmp_path / "rows").mkdir()
    summary = run_training(
        cfg,
        fault=Fault(step=3, rank=1, marker=str(tmp_path / "fired"), at="committed"),
        trained_rows_dir=str(tmp_path / "rows"),
    )
    assert (tmp_path / "fired").exists() and summary.metrics["step"] == 17

    rows = trained_rows(tmp_path / "rows")
    steps = Counter((rank, step) for rank, _, step, _, _ in rows)
    assert steps == {(r, s): 8 for r in (0, 1) for s in range(1, 18)}  # each step once a rank, 8 rows
    every_row = {(s, r) for s in range(SHARDS) for r in range(ROWS_PER_SHARD)}
    before = [(s, r) for _, epoch, step, s, r in rows if epoch == 0 and step <= 3]
    after = [(s, r) for _, epoch, step, s, r in rows if epoch == 0 and step > 3]
    per_shard = Counter(s for s, _ in before)
    consumed = {s for s, n in per_shard.items() if n == ROWS_PER_SHARD}
    in_flight = set(per_shard) - consumed

    assert consumed and in_flight  # 24 rows a rank: one shard trained, one part-trained, if blocks stay whole
    epoch_of = {step: epoch for _, epoch, step, _, _ in rows}
    end_of_epoch0 = max(step for step, epoch in epoch_of.items() if epoch == 0)
    for step in (3, 6, 9, 12, 15, 17):  # each checkpoint's position is what the rows trained say
        epoch = epoch_of[step]
        first, carried = (1, set()) if step <= 3 else (4, consumed) if epoch == 0 else (end_of_epoch0 + 1, set())
        since = Counter(s for _, e, t, s, _ in rows if e == epoch and first <= t <= step)
        expected = carried | {s for s, n in since.items() if n == ROWS_PER_SHARD}
        for rank in (0, 1):
            saved = json.loads(
                (tmp_path / "ckpt" / "resume" / f"checkpoint_{step:08d}" / f"extra_rank{rank}.json").read_text()
            )["data_position"]
            assert (saved["epoch"], set(saved["consumed"])) == (epoch, expected), (step, rank)
    assert set(before) | set(after) == every_row  # none lost
    assert len(before) == len(set(before)) and len(after) == len(set(after))
    assert {s for s, _ in after}.isdisjoint(consumed)  # consumed shards were not read again
    assert {s for s, _ in set(before) & set(after)} <= in_flight  # only rows in flight seen twice
    assert len(after) == (SHARDS - len(consumed)) * ROWS_PER_SHARD
    epoch1 = [(s, r) for _, epoch, _, s, r in rows if epoch == 1]
    assert sorted(epoch1) == sorted(every_row)  # after the resumed epoch: a fresh pass
