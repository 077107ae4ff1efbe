"""Shard formats and the image decode step: round trips, and every kind of bad record skipped and counted."""

import io
import json
import tarfile
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mdc.data import shards
from mdc.data.images import CLIP_MEAN, CLIP_STD, ImageTransform, decode_image, preprocess_batch
from mdc.data.shards import Sample


def encode(array: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format=fmt)
    return buf.getvalue()


def random_rgb(seed: int, size: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def make_samples(n: int) -> tuple[list[Sample], dict[str, np.ndarray]]:
    """Alternating PNG (exact pixels) and JPEG samples, some with meta; returns the PNG pixels by key."""
    samples, pixels = [], {}
    for i in range(n):
        key, arr = f"sample{i:03d}", random_rgb(i)
        if i % 2 == 0:
            samples.append(Sample(key, encode(arr, "PNG"), f"caption number {i} – ünïcode", {"label": i}))
            pixels[key] = arr
        else:
            samples.append(Sample(key, encode(arr, "JPEG"), f"caption number {i}", None))
    return samples, pixels


def tar_of(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


GOOD_JPEG = encode(random_rgb(0), "JPEG")
CORRUPT_JPEG = GOOD_JPEG[:200]  # header intact, scan data cut: opens but cannot be decoded


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("format", ["webdataset", "parquet"])
def test_round_trip_keys_captions_meta_pixels(tmp_path, format):
    samples, pixels = make_samples(7)
    uris = shards.write_shards(iter(samples), str(tmp_path / "out"), format, samples_per_shard=3)
    suffix = ".tar" if format == "webdataset" else ".parquet"
    assert [u.rsplit("/", 1)[1] for u in uris] == [f"shard-0000{i}{suffix}" for i in range(3)]

    skips = Counter()
    back = list(shards.read_shards(str(tmp_path / "out"), skips=skips))
    assert not skips
    assert [(s.key, s.caption, s.meta) for s in back] == [(s.key, s.caption, s.meta) for s in samples]
    assert [s.image for s in back] == [s.image for s in samples]  # bytes pass through untouched
    for s in back:
        if s.key in pixels:
            np.testing.assert_array_equal(np.asarray(decode_image(s.image)), pixels[s.key])


def test_tar_layout_is_img2dataset(tmp_path):
    samples, _ = make_samples(2)
    (uri,) = shards.write_shards(samples, str(tmp_path), "webdataset", samples_per_shard=10)
    with tarfile.open(uri) as tar:
        names = tar.getnames()
        assert tar.extractfile("sample000.txt").read().decode() == samples[0].caption
        assert json.loads(tar.extractfile("sample000.json").read()) == {"label": 0}
    assert names == ["sample000.png", "sample000.txt", "sample000.json", "sample001.jpg", "sample001.txt"]


def test_parquet_schema(tmp_path):
    samples, _ = make_samples(2)
    (uri,) = shards.write_shards(samples, str(tmp_path), "parquet", samples_per_shard=10)
    table = pq.read_table(uri)
    assert table.schema.names == ["key", "jpg", "txt", "json"]
    assert table.schema.field("jpg").type == pa.binary()
    assert table.column("json").to_pylist() == ['{"label": 0}', None]


def test_write_shards_rejects_bad_keys_and_formats(tmp_path):
    with pytest.raises(ValueError, match="a.b"):
        shards.write_shards([Sample("a.b", GOOD_JPEG, "x")], str(tmp_path), "webdataset", 10)
    with pytest.raises(ValueError, match="zip"):
        shards.write_shards([], str(tmp_path), "zip", 10)


def test_key_fraction_is_stable_and_nested():
    fractions = [shards.key_fraction(f"k{i}") for i in range(2000)]
    assert fractions == [shards.key_fraction(f"k{i}") for i in range(2000)]
    assert all(0 <= f < 1 for f in fractions)
    assert 0.07 < np.mean(np.array(fractions) < 0.1) < 0.13
    assert shards.key_fraction("k1", "a") != shards.key_fraction("k1", "b")


# ----------------------------------------------------------------------------------- bad records


def test_bad_tar_records_are_skipped_and_counted():
    data = tar_of(
        [
            ("good1.jpg", GOOD_JPEG),
            ("good1.txt", b"a dog"),
            ("empty.jpg", GOOD_JPEG),
            ("empty.txt", b"  \n "),
            ("latin1.jpg", GOOD_JPEG),
            ("latin1.txt", "café".encode("latin-1")),
            ("nocap.jpg", GOOD_JPEG),
            ("nocap.json", b"{}"),
            ("noimg.txt", b"text only"),
            ("badjson.jpg", GOOD_JPEG),
            ("badjson.txt", b"ok"),
            ("badjson.json", b"{not json"),
            ("corrupt.jpg", CORRUPT_JPEG),
            ("corrupt.txt", b"a broken picture"),
            ("good2.png", encode(random_rgb(1), "PNG")),
            ("good2.txt", b"  a cat \n"),
        ]
    )
    skips = Counter()
    samples = list(shards.iter_tar(io.BytesIO(data), "mem.tar", skips))
    assert [(s.key, s.caption) for s in samples] == [
        ("good1", "a dog"),
        ("corrupt", "a broken picture"),
        ("good2", "a cat"),
    ]
    assert skips == {
        shards.EMPTY_CAPTION: 1,
        shards.NON_UTF8_CAPTION: 1,
        shards.MISSING_CAPTION: 1,
        shards.MISSING_IMAGE: 1,
        shards.INVALID_JSON: 1,
    }

    # decodability is checked by the decode step, which the caller counts
    batch, ok = preprocess_batch([s.image for s in samples], image_size=8)
    assert ok == [True, False, True]
    assert batch.shape == (3, 3, 8, 8) and batch.dtype == np.float32
    assert not batch[1].any()


def test_bad_parquet_records_are_skipped_and_counted():
    table = pa.table(
        {
            "key": ["good", "empty", "nocap", "noimg", "badjson", "good2"],
            "jpg": [GOOD_JPEG, GOOD_JPEG, GOOD_JPEG, None, GOOD_JPEG, GOOD_JPEG],
            "txt": ["a dog", " ", None, "text", "ok", "a cat"],
            "json": [None, None, None, None, "{oops", '{"label": 3}'],
        }
    )
    skips = Counter()
    samples = list(shards.iter_parquet_batches(table.to_batches(), "mem.parquet", skips))
    assert [(s.key, s.caption, s.meta) for s in samples] == [("good", "a dog", None), ("good2", "a cat", {"label": 3})]
    assert skips == {
        shards.EMPTY_CAPTION: 1,
        shards.MISSING_CAPTION: 1,
        shards.MISSING_IMAGE: 1,
        shards.INVALID_JSON: 1,
    }


def test_parquet_binary_caption_column_counts_non_utf8_and_accepts_img2dataset_names():
    table = pa.table({"image": [GOOD_JPEG, GOOD_JPEG], "caption": [b"\xff\xfe", b"fine"]})
    skips = Counter()
    samples = list(shards.iter_parquet_batches(table.to_batches(), "mem.parquet", skips))
    assert [s.caption for s in samples] == ["fine"]
    assert skips == {shards.NON_UTF8_CAPTION: 1}


def test_parquet_without_caption_column_names_the_file():
    with pytest.raises(ValueError, match="data.parquet.*txt"):
        list(shards.iter_parquet_batches(pa.table({"jpg": [GOOD_JPEG]}).to_batches(), "data.parquet", Counter()))


@pytest.mark.parametrize("where", ["inside member data", "inside a header", "at a member boundary", "garbage"])
def test_truncated_tar_yields_complete_samples_before_the_damage(tmp_path, caplog, where):
    samples = [Sample(f"k{i}", GOOD_JPEG, f"caption {i}", {"i": i}) for i in range(4)]
    (uri,) = shards.write_shards(samples, str(tmp_path), "webdataset", samples_per_shard=4)
    data = open(uri, "rb").read()
    offsets = {m.name: m.offset for m in tarfile.open(fileobj=io.BytesIO(data))}
    k2 = offsets["k2.jpg"]
    cut = {
        "inside member data": data[: k2 + 512 + 100],
        "inside a header": data[: k2 + 200],
        "at a member boundary": data[: offsets["k2.json"]],
        "garbage": b"not a tar at all" * 100,
    }[where]
    skips = Counter()
    keys = [s.key for s in shards.iter_tar(io.BytesIO(cut), "cut.tar", skips)]
    # a cut header hides whether it belonged to k1 (say k1.json), so k1 is dropped as possibly incomplete
    expected = {"garbage": [], "inside a header": ["k0"]}.get(where, ["k0", "k1"])
    assert keys == expected
    assert skips == {shards.TRUNCATED_TAR: 1}
    assert "cut.tar" in caplog.text  # the damaged file is named in the log


def test_read_shards_mixes_formats_and_counts_damaged_files(tmp_path):
    samples, _ = make_samples(4)
    shards.write_shards(samples[:2], str(tmp_path / "a"), "webdataset", 10)
    shards.write_shards(samples[2:], str(tmp_path / "b"), "parquet", 10)
    whole = (tmp_path / "a" / "shard-00000.tar").read_bytes()
    (tmp_path / "c.tar").write_bytes(whole[:700])  # cut inside the first image
    (tmp_path / "d.parquet").write_bytes(b"PAR1 broken")
    (tmp_path / "notes.txt").write_text("ignored")
    skips = Counter()
    keys = [s.key for s in shards.read_shards(str(tmp_path), skips=skips)]
    assert keys == ["sample000", "sample001", "sample002", "sample003"]
    assert skips == {shards.TRUNCATED_TAR: 1, shards.CORRUPT_PARQUET: 1}


def test_manifest_round_trip(tmp_path):
    uri = shards.write_manifest(str(tmp_path), {"num_samples": 3, "class_names": ["a"]})
    assert uri.endswith("manifest.json")
    assert shards.read_manifest(str(tmp_path)) == {"num_samples": 3, "class_names": ["a"]}
    assert shards.read_manifest(uri) == {"num_samples": 3, "class_names": ["a"]}


# ---------------------------------------------------------------------------------------- images


def test_decode_composites_transparency_on_white():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)  # opaque red; the rest fully transparent black
    rgba[0, 1] = (0, 0, 0, 128)  # half-transparent black -> mid grey
    img = np.asarray(decode_image(encode(rgba, "PNG")))
    assert img.shape == (4, 4, 3)
    assert tuple(img[0, 0]) == (255, 0, 0)
    assert tuple(img[3, 3]) == (255, 255, 255)
    assert 120 <= img[0, 1, 0] <= 135

    la = np.zeros((2, 2, 2), dtype=np.uint8)  # grey + alpha, all transparent
    assert (np.asarray(decode_image(encode(la, "PNG", "LA"))) == 255).all()

    palette = Image.new("P", (2, 2), 0)
    palette.putpalette([0, 0, 0, 9, 9, 9])
    buf = io.BytesIO()
    palette.save(buf, format="PNG", transparency=0)
    assert (np.asarray(decode_image(buf.getvalue())) == 255).all()


@pytest.mark.parametrize("data", [b"", b"not an image", CORRUPT_JPEG])
def test_decode_rejects_undecodable(data):
    with pytest.raises(ValueError, match="undecodable"):
        decode_image(data)


def test_transform_resizes_shorter_side_crops_centre_and_normalises():
    # 3 vertical bands 40 px wide, 40 px tall: after shorter side -> 20, the centre crop is the middle band
    arr = np.zeros((40, 120, 3), dtype=np.uint8)
    arr[:, :40] = (255, 0, 0)
    arr[:, 40:80] = (0, 255, 0)
    arr[:, 80:] = (0, 0, 255)
    out = ImageTransform(20)(Image.fromarray(arr))
    assert out.shape == (3, 20, 20) and out.dtype == np.float32
    expected = (np.array([0.0, 1.0, 0.0]) - np.array(CLIP_MEAN)) / np.array(CLIP_STD)
    np.testing.assert_allclose(out[:, 2:-2, 2:-2].mean(axis=(1, 2)), expected, atol=1e-4)

    tall = ImageTransform(16)(Image.new("RGB", (30, 90), (255, 255, 255)))
    assert tall.shape == (3, 16, 16)
    np.testing.assert_allclose(tall[:, 0, 0], (1 - np.array(CLIP_MEAN)) / np.array(CLIP_STD), atol=1e-4)
