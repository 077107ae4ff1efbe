"""Shard formats: WebDataset tars as img2dataset writes them, and Parquet with image bytes + caption.

Readers never raise on a bad record: they skip it and count it under a reason in a Counter, so a
run reports exactly what it dropped. Image bytes are passed through undecoded; decodability is
checked once, in the decode step (images.preprocess_batch), and counted there as UNDECODABLE_IMAGE.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import posixpath
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from mdc.data import storage

log = logging.getLogger(__name__)

UNDECODABLE_IMAGE = "undecodable_image"
EMPTY_CAPTION = "empty_caption"
NON_UTF8_CAPTION = "non_utf8_caption"
TRUNCATED_TAR = "truncated_tar"
MISSING_IMAGE = "missing_image"
MISSING_CAPTION = "missing_caption"
INVALID_JSON = "invalid_json"
CORRUPT_PARQUET = "corrupt_parquet"
FAILED_DOWNLOAD = "failed_download"  # an img2dataset row whose status is not "success"


IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # in order of preference within one sample
SHARD_SUFFIXES = (".tar", ".parquet")
MANIFEST = "manifest.json"
IMG2DATASET_STATS = "_stats.json"  # img2dataset's folder totals
SUCCESS = "success"
IMAGE_COLUMNS = ("jpg", "png", "webp", "image")
CAPTION_COLUMNS = ("txt", "caption")
READ_BUFFER_BYTES = 8 * 1024**2  # one ranged GET per 8 MiB on S3; the memory of one open shard
ShardFormat = Literal["auto", "webdataset", "parquet"]
PARQUET_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("jpg", pa.binary()),
        pa.field("txt", pa.string()),
        pa.field("json", pa.string()),
    ]
)


@dataclass
class Sample:
    key: str
    image: bytes  # encoded JPEG/PNG/WebP, as stored
    caption: str
    meta: dict | None = None


def image_extension(data: bytes) -> str:
    """File extension for encoded image bytes, from their magic number (JPEG if unknown)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return "jpg"


def key_fraction(key: str, salt: str = "") -> float:
    """A stable pseudo-random number in [0, 1) for a key: deterministic, nested splits/subsets
    (every key below 0.05 is also below 0.1)."""
    digest = hashlib.sha1(f"{salt}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ---------------------------------------------------------------------------------------- writing


def _check_key(key: str) -> None:
    if not key or "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must be non-empty without '.' or '/' (WebDataset splits keys there)")


def _tar_bytes(samples: list[Sample]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for s in samples:
            members = [(image_extension(s.image), s.image), ("txt", s.caption.encode("utf-8"))]
            if s.meta is not None:
                members.append(("json", json.dumps(s.meta).encode("utf-8")))
            for ext, data in members:
                info = tarfile.TarInfo(f"{s.key}.{ext}")
                info.size, info.mode = len(data), 0o444  # mtime stays 0: same input, same bytes
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _parquet_bytes(samples: list[Sample]) -> bytes:
    table = pa.table(
        {
            "key": [s.key for s in samples],
            "jpg": [s.image for s in samples],
            "txt": [s.caption for s in samples],
            "json": [None if s.meta is None else json.dumps(s.meta) for s in samples],
        },
        schema=PARQUET_SCHEMA,
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_shards(
    samples: Iterable[Sample],
    out_uri: str,
    format: Literal["webdataset", "parquet"],
    samples_per_shard: int,
    endpoint_url: str | None = None,
) -> list[str]:
    """Write samples as shard-00000.tar/.parquet, ... under out_uri; returns the shard URIs.

    Memory holds one shard at a time, so the input may be a generator of any length."""
    encoders = {"webdataset": (".tar", _tar_bytes), "parquet": (".parquet", _parquet_bytes)}
    if format not in encoders:
        raise ValueError(f"unknown shard format {format!r}; expected one of {sorted(encoders)}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    storage.check_reachable(out_uri, endpoint_url, must_exist=False)
    suffix, encode = encoders[format]
    uris: list[str] = []

    def flush(batch: list[Sample]) -> None:
        uri = storage.join(out_uri, f"shard-{len(uris):05d}{suffix}")
        storage.write_bytes(uri, encode(batch), endpoint_url)
        uris.append(uri)

    batch: list[Sample] = []
    for s in samples:
        _check_key(s.key)
        batch.append(s)
        if len(batch) == samples_per_shard:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    return uris


def write_split(
    samples: Iterable[Sample],
    out_uri: str,
    split: str,
    format: Literal["webdataset", "parquet"],
    samples_per_shard: int,
    endpoint_url: str | None = None,
) -> dict:
    """Write one split to out_uri/split; returns its manifest entry (count, shard paths relative to out_uri)."""
    count = 0

    def counted() -> Iterator[Sample]:
        nonlocal count
        for s in samples:
            count += 1
            yield s

    uris = write_shards(counted(), storage.join(out_uri, split), format, samples_per_shard, endpoint_url)
    return {"num_samples": count, "shards": [f"{split}/{posixpath.basename(u)}" for u in uris]}


# ---------------------------------------------------------------------------------------- reading


def _split_key(name: str) -> tuple[str, str]:
    """'dir/0001.jpg' -> ('dir/0001', 'jpg'): key up to the first dot of the basename, as WebDataset."""
    dirname, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(dirname, stem), ext.lower()


def _sample_from_parts(
    key: str, image: bytes | None, caption: bytes | str | None, meta: str | bytes | None, skips: Counter
) -> Sample | None:
    """Validate one record's raw fields; count and return None if it must be skipped."""
    if image is None:
        skips[MISSING_IMAGE] += 1
        return None
    if caption is None:
        skips[MISSING_CAPTION] += 1
        return None
    if isinstance(caption, bytes):
        try:
            caption = caption.decode("utf-8")
        except UnicodeDecodeError:
            skips[NON_UTF8_CAPTION] += 1
            return None
    caption = caption.strip()
    if not caption:
        skips[EMPTY_CAPTION] += 1
        return None
    parsed = None
    if meta is not None:
        try:
            parsed = json.loads(meta)
        except (ValueError, UnicodeDecodeError):
            skips[INVALID_JSON] += 1
            return None
    return Sample(key, image, caption, parsed)


def _count_damaged(source: str, reason: str, error: object, skips: Counter) -> None:
    """A damaged file is counted once and named in the log, so it can be found and replaced."""
    skips[reason] += 1
    log.warning("%s: %s (%s); records after the damage are lost", source, reason, error)


def _group_to_sample(key: str, parts: dict[str, bytes], skips: Counter) -> Sample | None:
    image = next((parts[e] for e in IMAGE_EXTS if e in parts), None)
    return _sample_from_parts(key, image, parts.get("txt"), parts.get("json"), skips)


def iter_tar(f: BinaryIO, source: str, skips: Counter) -> Iterator[Sample]:
    """Samples of a tar read member by member from a seekable file, so memory holds one sample
    whatever the shard's size. Members are grouped by key while consecutive (as WebDataset does).
    A damaged tar yields the complete samples before the damage and counts TRUNCATED_TAR once;
    the sample being read when the damage hit is dropped, since its parts may be missing."""
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.TarError as e:
        _count_damaged(source, TRUNCATED_TAR, e, skips)
        return
    key, parts = None, {}
    try:
        while (member := tar.next()) is not None:
            if not member.isfile():
                continue
            member_key, ext = _split_key(member.name)
            if member_key != key:
                if key is not None and (sample := _group_to_sample(key, parts, skips)):
                    yield sample
                key, parts = member_key, {}
            parts[ext] = tar.extractfile(member).read()
        # tarfile stops quietly where a header is cut short; a whole tar ends with 1024 zero bytes
        f.seek(tar.offset)
        tail = f.read(1024)
    except (tarfile.TarError, OSError, EOFError) as e:
        _count_damaged(source, TRUNCATED_TAR, e, skips)
        return
    if len(tail) < 1024 or tail.strip(b"\0"):
        _count_damaged(source, TRUNCATED_TAR, "no end-of-archive marker", skips)
    elif key is not None and (sample := _group_to_sample(key, parts, skips)):
        yield sample


def _pick_column(names: list[str], wanted: tuple[str, ...], source: str) -> str:
    for n in wanted:
        if n in names:
            return n
    raise ValueError(f"{source}: no column among {list(wanted)}; columns are {names}")


def iter_parquet_batches(batches: Iterable[pa.RecordBatch], source: str, skips: Counter) -> Iterator[Sample]:
    """Samples of Parquet record batches with columns key, jpg (image bytes), txt (caption), optional json.

    img2dataset's names are accepted too: png/webp/image for the image, caption for the text; rows
    whose `status` is not "success" (its failed downloads and resizes) count as FAILED_DOWNLOAD.
    A missing column is a wrong file, not a bad record, so it raises ValueError naming the file."""
    row = 0
    for batch in batches:
        names = batch.schema.names
        image_col = _pick_column(names, IMAGE_COLUMNS, source)
        caption_col = _pick_column(names, CAPTION_COLUMNS, source)
        cols = batch.to_pydict()
        for i in range(batch.num_rows):
            key = str(cols["key"][i]) if "key" in cols else f"{source}#{row}"
            row += 1
            if "status" in cols and cols["status"][i] != SUCCESS:
                skips[FAILED_DOWNLOAD] += 1
                continue
            meta = cols["json"][i] if "json" in cols else None
            if sample := _sample_from_parts(key, cols[image_col][i], cols[caption_col][i], meta, skips):
                yield sample


def iter_parquet(f: BinaryIO, source: str, skips: Counter, batch_size: int = 256) -> Iterator[Sample]:
    """Samples of a Parquet file read `batch_size` rows at a time; a damaged file counts CORRUPT_PARQUET once."""
    try:
        batches = pq.ParquetFile(f).iter_batches(batch_size=batch_size)
        yield from iter_parquet_batches(batches, source, skips)
    except (pa.ArrowException, OSError) as e:
        _count_damaged(source, CORRUPT_PARQUET, e, skips)


def iter_shard(uri: str, skips: Counter, endpoint_url: str | None = None) -> Iterator[Sample]:
    """Samples of one .tar or .parquet shard, streamed from local disk or S3 in buffered chunks."""
    fs, path = storage.open_fs(uri, endpoint_url)
    try:
        raw = fs.open_input_file(path)
    except OSError as e:
        raise storage.StorageError(f"cannot read {uri}: {e}") from e
    with io.BufferedReader(raw, buffer_size=READ_BUFFER_BYTES) as f:
        yield from (iter_tar if uri.endswith(".tar") else iter_parquet)(f, uri, skips)


# ------------------------------------------------------------------------------------------ layout


def _is_side_file(uri: str, tars: set[str]) -> bool:
    """img2dataset writes NNNNN.parquet (metadata, no image column) beside each NNNNN.tar."""
    return uri.endswith(".parquet") and uri.removesuffix(".parquet") + ".tar" in tars


def list_shards(uri: str, format: ShardFormat = "auto", endpoint_url: str | None = None) -> list[str]:
    """The data shards under uri, sorted: the tars for webdataset, the Parquet files for parquet,
    and for auto every tar and every Parquet file that is not a tar's side file. Stats and other
    files are never data. Raises StorageError naming the folder when it holds no such shard."""
    files = storage.list_files(uri, SHARD_SUFFIXES, endpoint_url)
    tars = {f for f in files if f.endswith(".tar")}
    wanted = {
        "webdataset": lambda f: f in tars,
        "parquet": lambda f: f.endswith(".parquet"),
        "auto": lambda f: f in tars or not _is_side_file(f, tars),
    }[format]
    found = [f for f in files if wanted(f)]
    if not found:
        kinds = {"webdataset": ".tar", "parquet": ".parquet", "auto": ".tar or .parquet"}[format]
        raise storage.StorageError(
            f"no {kinds} shards under {uri} (data.format={format}); {holdings(uri, endpoint_url)}: mdc reads "
            "webdataset .tar or .parquet shards, as img2dataset writes them (docs/training.md)"
        )
    return found


def holdings(uri: str, endpoint_url: str | None = None) -> str:
    """What a folder holds, for an error: `it holds 3 .jpg, 1 .txt` or `it is empty`."""
    counts = Counter(
        posixpath.splitext(f)[1].lower() or "(no suffix)" for f in storage.list_files(uri, (), endpoint_url)
    )
    if not counts:
        return "it is empty"
    return "it holds " + ", ".join(f"{n} {suffix}" for suffix, n in counts.most_common(4))


def known_size(uri: str, files: list[str], endpoint_url: str | None = None) -> tuple[int, str] | None:
    """(samples, where that figure is from) of a training folder when a side file says it without
    reading the images: img2dataset's `_stats.json`, else the Parquet data shards' footers (one small
    read each, for up to 64 shards). None when neither says (tars without `_stats.json`)."""
    total = stats_total(uri, endpoint_url)
    if total is not None:
        return total, IMG2DATASET_STATS
    if not files or len(files) > 64 or not all(f.endswith(".parquet") for f in files):
        return None
    rows = 0
    for f in files:
        fs, path = storage.open_fs(f, endpoint_url)
        try:
            rows += pq.read_metadata(path, filesystem=fs).num_rows
        except (OSError, pa.ArrowInvalid):  # a damaged shard: the reader counts and skips it later
            return None
    return rows, f"the footers of its {len(files)} Parquet shards"


def read_shards(
    uri: str, endpoint_url: str | None = None, skips: Counter | None = None, format: ShardFormat = "auto"
) -> Iterator[Sample]:
    """All samples of all shards under uri, in sorted shard order (single process: for tests and
    small evaluations; training reads through Ray Data)."""
    skips = Counter() if skips is None else skips
    for shard in list_shards(uri, format, endpoint_url):
        yield from iter_shard(shard, skips, endpoint_url)


def stats_total(uri: str, endpoint_url: str | None = None) -> int | None:
    """Successful samples of an img2dataset folder, from its `_stats.json` totals (None without one)."""
    path = storage.join(uri, IMG2DATASET_STATS)
    try:
        return int(json.loads(storage.read_bytes(path, endpoint_url))["successes"])
    except storage.StorageError:
        return None
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: no readable 'successes' total: {e}") from e


# --------------------------------------------------------------------------------------- manifest


def write_manifest(out_uri: str, manifest: dict, endpoint_url: str | None = None) -> str:
    """Write out_uri/manifest.json (counts, class names, splits) and return its URI."""
    uri = storage.join(out_uri, MANIFEST)
    storage.write_bytes(uri, json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8"), endpoint_url)
    return uri


def read_manifest(uri: str, endpoint_url: str | None = None) -> dict:
    """Read the manifest of a dataset directory (or a manifest.json URI itself)."""
    path = uri if uri.endswith(".json") else storage.join(uri, MANIFEST)
    try:
        return json.loads(storage.read_bytes(path, endpoint_url))
    except ValueError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
