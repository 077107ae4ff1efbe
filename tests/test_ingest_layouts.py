"""img2dataset's two folder layouts as the project generates them, how shards are picked from a
folder, every damage kind counted by reason in each layout, and the ingest budget and stall guard
(no Ray here: the training runs are in test_ingest_training.py)."""

import io
import json
import os
import tarfile
import threading
import time
from collections import Counter

import pyarrow.parquet as pq
import pytest
from test_shards import tar_of

from mdc.data import shards, storage
from mdc.data.images import preprocess_batch
from mdc.data.img2dataset import (
    FAILED_TO_DOWNLOAD,
    FAILED_TO_RESIZE,
    META_SCHEMA,
    damage_folder,
    generated_rows,
    sample_key,
    write_img2dataset_folder,
)
from pipelines.data.feed import BatchFeed, DataStallError
from pipelines.data.ingest import ingest_resources

ROWS = generated_rows(60, image_size=32)  # 44 successes, 8 failed downloads, 8 failed resizes
SUCCESSES = sum(r.jpg is not None for r in ROWS)


def folder(tmp_path, output_format, damaged=False) -> str:
    out = str(tmp_path / output_format)
    write_img2dataset_folder(ROWS, out, output_format, samples_per_shard=20)
    return out, damage_folder(out, output_format) if damaged else {}


def test_keys_are_img2dataset_keys():
    assert sample_key(1, 3, 10_000) == "000010003"
    assert sample_key(2, 7, 20) == "0000207"


def test_webdataset_folder_has_img2dataset_members_and_side_files(tmp_path):
    out, _ = folder(tmp_path, "webdataset")
    assert sorted(os.listdir(out)) == [
        "00000.parquet",
        "00000.tar",
        "00000_stats.json",
        "00001.parquet",
        "00001.tar",
        "00001_stats.json",
        "00002.parquet",
        "00002.tar",
        "00002_stats.json",
        "_stats.json",
    ]
    with tarfile.open(os.path.join(out, "00000.tar")) as tar:
        names = tar.getnames()
        meta = json.loads(tar.extractfile("0000000.json").read())
        assert tar.getmember("0000000.jpg").uname == "bigdata"
    assert names[:3] == ["0000000.jpg", "0000000.json", "0000000.txt"]  # webdataset writes members sorted
    assert meta["status"] == "success" and meta["key"] == "0000000" and len(meta["sha256"]) == 64
    side = pq.read_table(os.path.join(out, "00000.parquet"))
    assert side.schema.names == META_SCHEMA.names  # metadata of every row, no image column
    assert side.num_rows == 20 and len(names) == 3 * side["status"].to_pylist().count("success")
    stats = json.load(open(os.path.join(out, "_stats.json")))
    assert (stats["count"], stats["successes"]) == (60, SUCCESSES)
    assert stats["failed_to_download"] == sum(r.status == FAILED_TO_DOWNLOAD for r in ROWS) > 0


def test_parquet_folder_keeps_failed_rows_with_null_image(tmp_path):
    out, _ = folder(tmp_path, "parquet")
    table = pq.read_table(os.path.join(out, "00000.parquet"))
    assert table.schema.names == [
        "caption",
        "url",
        "key",
        "status",
        "error_message",
        "width",
        "height",
        "original_width",
        "original_height",
        "exif",
        "sha256",
        "jpg",
    ]
    failed = [r for r in table.to_pylist() if r["status"] != "success"]
    assert {r["status"] for r in failed} == {FAILED_TO_DOWNLOAD, FAILED_TO_RESIZE}
    assert all(r["jpg"] is None and r["error_message"] for r in failed)
    assert shards.stats_total(out) == SUCCESSES


@pytest.mark.parametrize("output_format", ["webdataset", "parquet"])
def test_each_layout_reads_every_success_once(tmp_path, output_format):
    out, _ = folder(tmp_path, output_format)
    skips = Counter()
    samples = list(shards.read_shards(out, skips=skips))
    assert sorted(s.caption for s in samples) == sorted(r.caption for r in ROWS if r.jpg is not None)
    assert len({s.key for s in samples}) == SUCCESSES
    # a tar holds only successes; a parquet shard keeps the failures, skipped and counted
    assert skips == ({} if output_format == "webdataset" else {shards.FAILED_DOWNLOAD: 60 - SUCCESSES})


def test_side_files_are_metadata_and_format_picks_shards(tmp_path):
    web, _ = folder(tmp_path, "webdataset")
    par, _ = folder(tmp_path, "parquet")
    assert [os.path.basename(f) for f in shards.list_shards(web)] == ["00000.tar", "00001.tar", "00002.tar"]
    assert len(shards.list_shards(par)) == 3
    mixed = str(tmp_path)  # webdataset/ (tars + side files) and parquet/ (data Parquet) side by side
    assert len(shards.list_shards(mixed)) == 6
    assert all(f.endswith(".tar") for f in shards.list_shards(mixed, "webdataset"))
    assert len(shards.list_shards(mixed, "parquet")) == 6  # asked for: side files are read as Parquet
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_stats.json").write_text("{}")
    with pytest.raises(storage.StorageError, match=f"no .tar or .parquet shards under {tmp_path / 'empty'}"):
        shards.list_shards(str(tmp_path / "empty"))
    with pytest.raises(storage.StorageError, match="no .parquet shards.*data.format=parquet"):
        shards.list_shards(str(tmp_path / "empty"), "parquet")
    assert shards.stats_total(str(tmp_path / "missing-stats")) is None


@pytest.mark.parametrize("output_format", ["webdataset", "parquet"])
def test_damage_kinds_are_counted_by_reason(tmp_path, output_format):
    out, damaged = folder(tmp_path, output_format, damaged=True)
    skips = Counter()
    samples = list(shards.read_shards(out, skips=skips))
    _, ok = preprocess_batch([s.image for s in samples], 32)  # decodability is the decode step's check
    skips[shards.UNDECODABLE_IMAGE] += ok.count(False)
    if output_format == "parquet":  # failed rows of the two shards that are still readable
        damaged[shards.FAILED_DOWNLOAD] = sum(r.jpg is None for r in ROWS[:40])
    assert skips == damaged
    expected_reasons = {"webdataset": {"truncated_tar", "non_utf8_caption"}, "parquet": {"corrupt_parquet"}}
    assert expected_reasons[output_format] | {"undecodable_image", "empty_caption"} <= set(skips)


def test_tar_is_read_member_by_member():
    """The reader never holds a whole shard: it reads a little past the members it has yielded."""
    members = [
        (f"k{i}.{ext}", os.urandom(4096) if ext == "jpg" else b"caption") for i in range(50) for ext in ("jpg", "txt")
    ]
    buf = io.BytesIO(tar_of(members))
    reader = shards.iter_tar(buf, "mem.tar", Counter())
    next(reader)
    next(reader)
    assert buf.tell() < 4 * (4096 + 1024)  # two samples read, 48 still on "disk"
    assert len(list(reader)) == 48


# ------------------------------------------------------------------------------- budget and stalls


def test_ingest_budget_is_what_training_leaves():
    small = ingest_resources(cluster_cpus=2, training_cpus=2 * 0.5)
    assert (small.budget, small.cpus_per_reader, small.max_readers) == (1, 1.0, 1)
    big = ingest_resources(cluster_cpus=64, training_cpus=8 * 1)
    assert (big.budget, big.cpus_per_reader, big.max_readers) == (56, 1.0, 56)
    assert ingest_resources(2, 1, override=3).max_readers == 3
    assert ingest_resources(2, 1.5).cpus_per_reader == 0.5  # below one CPU: one reader with all of it
    # a Tune trial's driver holds 0.05 CPU: with two 0.5-CPU workers a whole-CPU reader would never start
    assert (
        ingest_resources(2, 1, held_cpus=0.05).cpus_per_reader,
        ingest_resources(2, 1, held_cpus=0.05).max_readers,
    ) == (0.95, 1)
    assert ingest_resources(2, 0.5, held_cpus=0.05).cpus_per_reader == 1.0  # at most one CPU a reader
    assert ingest_resources(2, 1, held_cpus=1.0).cpus_per_reader == 1.0  # a holder about to leave: waited for
    with pytest.raises(ValueError, match="cluster has 2 CPUs and the training workers hold 2"):
        ingest_resources(2, 2)
    # one online evaluation at a time keeps its CPUs free of readers
    assert ingest_resources(2, 1, eval_cpus=0.5).cpus_per_reader == 0.5
    with pytest.raises(ValueError, match=r"hold 1 and online evaluation 1 \(eval.cpus\)"):
        ingest_resources(2, 1, eval_cpus=1.0)


def test_stall_guard_passes_batches_and_errors_through():
    assert list(BatchFeed(5, lambda: "unused")(iter(range(5)))) == [0, 1, 2, 3, 4]

    def broken():
        yield 1
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(BatchFeed(5, lambda: "unused")(broken()))


def test_feed_adds_up_the_time_spent_waiting_for_batches():
    def slow():
        for i in range(4):
            time.sleep(0.1)
            yield i

    feed = BatchFeed(5, lambda: "unused")
    assert list(feed(slow())) == [0, 1, 2, 3]
    assert feed.wait_s >= 0.35  # the consumer did nothing else: it waited for all four sleeps


def test_stall_guard_fails_when_the_source_never_yields():
    never = threading.Event()

    def silent():
        never.wait()
        yield "never"

    start = time.monotonic()
    with pytest.raises(DataStallError, match="what it waited for"):
        next(BatchFeed(0.5, lambda: "what it waited for")(silent()))
    assert time.monotonic() - start < 5
    never.set()


def test_stats_totals_size_a_split_without_manifest(tmp_path):
    from pipelines.commands.scaling import ScalingError, split_total

    out, _ = folder(tmp_path, "webdataset")
    assert split_total(out, str(tmp_path / "manifest.json"), {}) == SUCCESSES
    with pytest.raises(ScalingError, match="no _stats.json in .*nothing; pass --total"):
        split_total(str(tmp_path / "nothing"), str(tmp_path / "manifest.json"), {})
