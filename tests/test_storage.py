"""Local and S3 (moto server) storage: round trips, listing, and fast, clear failures."""

import time

import pytest
from helpers import closed_port

from mdc.data import shapes, shards, storage
from mdc.data.shards import Sample

PNG = shapes.make_shape(0, seed=0).image


def test_local_listing_is_recursive_sorted_and_filtered(tmp_path):
    for name in ("b/shard-1.tar", "a/shard-0.parquet", "a/notes.txt", "c.tar"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert storage.list_files(str(tmp_path), (".tar", ".parquet")) == [
        str(tmp_path / "a/shard-0.parquet"),
        str(tmp_path / "b/shard-1.tar"),
        str(tmp_path / "c.tar"),
    ]
    assert storage.list_files(str(tmp_path / "c.tar"), (".tar",)) == [str(tmp_path / "c.tar")]
    with pytest.raises(storage.StorageError, match="missing"):
        storage.list_files(str(tmp_path / "missing"))
    with pytest.raises(storage.StorageError, match="missing"):
        storage.check_reachable(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="gs://"):
        storage.open_fs("gs://bucket/x")


@pytest.mark.parametrize("format", ["webdataset", "parquet"])
def test_s3_shard_round_trip(s3_server, format):
    bucket = s3_server.make_bucket(f"roundtrip-{format}")
    out = f"{bucket}/data/train"
    samples = [Sample(f"k{i}", PNG, f"caption {i}", {"label": i % 3}) for i in range(5)]
    uris = shards.write_shards(samples, out, format, samples_per_shard=2, endpoint_url=s3_server.endpoint_url)
    suffix = ".tar" if format == "webdataset" else ".parquet"
    assert uris == [f"{out}/shard-0000{i}{suffix}" for i in range(3)]
    assert storage.list_files(bucket, (suffix,), s3_server.endpoint_url) == uris
    storage.check_reachable(out, s3_server.endpoint_url)

    back = list(shards.read_shards(f"{bucket}/data", s3_server.endpoint_url))
    assert [(s.key, s.image, s.caption, s.meta) for s in back] == [(s.key, s.image, s.caption, s.meta) for s in samples]

    shards.write_manifest(f"{bucket}/data", {"num_samples": 5}, s3_server.endpoint_url)
    assert shards.read_manifest(f"{bucket}/data", s3_server.endpoint_url) == {"num_samples": 5}


def test_s3_endpoint_from_environment(s3_server, monkeypatch):
    bucket = s3_server.make_bucket("from-env")
    storage.write_bytes(f"{bucket}/x/a.tar", b"data", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    assert storage.list_files(bucket, (".tar",)) == [f"{bucket}/x/a.tar"]
    assert storage.read_bytes(f"{bucket}/x/a.tar") == b"data"


def test_shapes_dataset_on_s3(s3_server):
    bucket = s3_server.make_bucket("shapes-data")
    manifest = shapes.write_shapes_dataset(
        f"{bucket}/shapes", num=40, seed=0, val_fraction=0.3, endpoint_url=s3_server.endpoint_url
    )
    assert shards.read_manifest(f"{bucket}/shapes", s3_server.endpoint_url) == manifest
    images = storage.list_files(f"{bucket}/shapes/compositionality/images", (".png",), s3_server.endpoint_url)
    assert len(images) == manifest["compositionality"]["num_pairs"] > 0


def test_unreachable_endpoint_fails_fast_naming_the_uri(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    for call in (
        lambda: storage.check_reachable("s3://some-bucket/prefix", endpoint),
        lambda: list(shards.read_shards("s3://some-bucket/prefix", endpoint)),
        lambda: shards.write_shards([Sample("k", PNG, "c")], "s3://some-bucket/out", "parquet", 1, endpoint),
    ):
        start = time.monotonic()
        with pytest.raises(storage.StorageError, match="s3://some-bucket/") as info:
            call()
        assert time.monotonic() - start < 10
        assert "very-secret-value" not in str(info.value)


def test_missing_bucket_or_prefix_fails_fast_naming_the_uri(s3_server):
    start = time.monotonic()
    with pytest.raises(storage.StorageError, match="bucket 'no-such-bucket' does not exist: s3://no-such-bucket/p"):
        storage.check_reachable("s3://no-such-bucket/p", s3_server.endpoint_url)
    with pytest.raises(storage.StorageError, match="no-such-bucket"):
        shards.write_shards([Sample("k", PNG, "c")], "s3://no-such-bucket/out", "webdataset", 1, s3_server.endpoint_url)
    bucket = s3_server.make_bucket("has-no-prefix")
    with pytest.raises(storage.StorageError, match="does not exist: s3://has-no-prefix/nothing/here"):
        storage.check_reachable(f"{bucket}/nothing/here", s3_server.endpoint_url)
    with pytest.raises(storage.StorageError, match="s3://has-no-prefix/nothing"):
        list(shards.read_shards(f"{bucket}/nothing", s3_server.endpoint_url))
    assert time.monotonic() - start < 10
