"""Folders laid out exactly as img2dataset (1.47) writes them, from generated images, for tests and demos.

What img2dataset writes (read from its `writer.py`, `downloader.py` and `logger.py`):
- `output_format="webdataset"`: per shard `NNNNN.tar` holding, for every *successful* sample, the
  members `KEY.jpg`, `KEY.json`, `KEY.txt` (webdataset's TarWriter writes a sample's members in
  sorted order, mode 0o444, user/group "bigdata"); beside it `NNNNN.parquet` with the metadata of
  *every* row (failed ones too) and no image column; and `NNNNN_stats.json`.
- `output_format="parquet"`: per shard `NNNNN.parquet` whose columns are the input columns
  (`caption`, `url`), then `key, status, error_message, width, height, original_width,
  original_height, exif, sha256`, then the image column `jpg`; failed rows (`status`
  `failed_to_download` / `failed_to_resize`) keep their metadata with a null `jpg`.
- Keys are `shard_id * 10**ceil(log10(samples_per_shard)) + row`, zero-padded to that many digits
  plus 5 (the shard-name width): shard 1 row 3 of 10,000-sample shards is `000010003`.
- `_stats.json` beside the shards holds the folder's totals (the fields of the per-shard stats summed),
  as seen in the folders that img2dataset users train from.

`damage_folder` then breaks a written folder the ways real downloads break (truncated tar or
Parquet, corrupt JPEG, empty and non-UTF-8 captions), so readers can be tested on each.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tarfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from mdc.data.shapes import make_shape

SHARD_NAME_DIGITS = 5  # img2dataset's default oom_shard_count
SUCCESS, FAILED_TO_DOWNLOAD, FAILED_TO_RESIZE = "success", "failed_to_download", "failed_to_resize"
META_SCHEMA = pa.schema(
    [
        pa.field("caption", pa.string()),
        pa.field("url", pa.string()),
        pa.field("key", pa.string()),
        pa.field("status", pa.string()),
        pa.field("error_message", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("original_width", pa.int32()),
        pa.field("original_height", pa.int32()),
        pa.field("exif", pa.string()),
        pa.field("sha256", pa.string()),
    ]
)
PARQUET_SCHEMA = META_SCHEMA.append(pa.field("jpg", pa.binary()))
ERRORS = {FAILED_TO_DOWNLOAD: "HTTP Error 404: Not Found", FAILED_TO_RESIZE: "image decoding error"}


@dataclass
class Row:
    """One input row (url, caption) and what the download gave: JPEG bytes, or a failure status."""

    url: str
    caption: str
    jpg: bytes | None
    status: str = SUCCESS
    original_size: tuple[int, int] = (0, 0)


def sample_key(shard_id: int, row: int, samples_per_shard: int) -> str:
    digits = math.ceil(math.log10(samples_per_shard)) if samples_per_shard > 1 else 0
    return f"{shard_id * 10**digits + row:0{digits + SHARD_NAME_DIGITS}d}"


def generated_rows(num: int, image_size: int = 64, seed: int = 0, failed_every: int = 7) -> list[Row]:
    """Shapes pictures as JPEGs whose shorter side is `image_size` (img2dataset's keep_ratio output);
    every `failed_every`-th row failed to download and the one after it failed to resize."""
    rows = []
    for i in range(num):
        url = f"http://images.example/{seed}/{i}.jpg"
        if failed_every and i % failed_every == failed_every - 1:
            rows.append(Row(url, f"lost picture {i}", None, FAILED_TO_DOWNLOAD))
            continue
        if failed_every and i % failed_every == 0 and i > 0:
            rows.append(Row(url, f"broken picture {i}", None, FAILED_TO_RESIZE))
            continue
        record = make_shape(i, seed=seed)
        image = Image.open(io.BytesIO(record.image)).convert("RGB")
        width = image_size * (4 + i % 3) // 4  # aspect ratios 1, 5:4, 3:2, shorter side image_size
        buf = io.BytesIO()
        image.resize((width, image_size)).save(buf, format="JPEG", quality=90)
        rows.append(Row(url, record.caption, buf.getvalue(), SUCCESS, (2 * width, 2 * image_size)))
    return rows


def _meta(row: Row, key: str) -> dict:
    ok = row.status == SUCCESS
    width, height = Image.open(io.BytesIO(row.jpg)).size if ok else (None, None)
    return {
        "caption": row.caption,
        "url": row.url,
        "key": key,
        "status": row.status,
        "error_message": None if ok else ERRORS[row.status],
        "width": width,
        "height": height,
        "original_width": row.original_size[0] if ok else None,
        "original_height": row.original_size[1] if ok else None,
        "exif": "{}" if ok else None,
        "sha256": hashlib.sha256(row.jpg).hexdigest() if ok else None,
    }


def _tar(samples: list[tuple[str, Row, dict]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for key, row, meta in samples:
            members = {
                "jpg": row.jpg,
                "txt": row.caption.encode("utf-8"),
                "json": json.dumps(meta, indent=4).encode("utf-8"),
            }
            for ext in sorted(members):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mode, info.uname, info.gname = len(members[ext]), 0o444, "bigdata", "bigdata"
                tar.addfile(info, io.BytesIO(members[ext]))
    return buf.getvalue()


def _stats(statuses: Counter) -> dict:
    return {
        "count": sum(statuses.values()),
        "successes": statuses[SUCCESS],
        "failed_to_download": statuses[FAILED_TO_DOWNLOAD],
        "failed_to_resize": statuses[FAILED_TO_RESIZE],
        "duration": 0.0,
        "start_time": 0.0,
        "end_time": 0.0,
        "status_dict": {ERRORS.get(s, s): n for s, n in statuses.items()},
    }


def write_img2dataset_folder(
    rows: Iterable[Row], out_dir: str, output_format: Literal["webdataset", "parquet"], samples_per_shard: int = 10_000
) -> dict:
    """Write `rows` as img2dataset does with `output_format`; returns the folder's totals (`_stats.json`)."""
    if output_format not in ("webdataset", "parquet"):
        raise ValueError(f"output_format must be webdataset or parquet, got {output_format!r}")
    rows = list(rows)
    os.makedirs(out_dir, exist_ok=True)
    totals = Counter()
    for shard_id, start in enumerate(range(0, len(rows), samples_per_shard)):
        name = os.path.join(out_dir, f"{shard_id:0{SHARD_NAME_DIGITS}d}")
        shard = [
            (sample_key(shard_id, i, samples_per_shard), row)
            for i, row in enumerate(rows[start : start + samples_per_shard])
        ]
        metas = [_meta(row, key) for key, row in shard]
        if output_format == "webdataset":
            with open(f"{name}.tar", "wb") as f:
                f.write(_tar([(k, r, m) for (k, r), m in zip(shard, metas) if r.status == SUCCESS]))
            pq.write_table(pa.Table.from_pylist(metas, META_SCHEMA), f"{name}.parquet")
        else:
            table = [m | {"jpg": r.jpg} for (_, r), m in zip(shard, metas)]
            pq.write_table(pa.Table.from_pylist(table, PARQUET_SCHEMA), f"{name}.parquet")
        statuses = Counter(r.status for _, r in shard)
        totals += statuses
        with open(f"{name}_stats.json", "w") as f:
            json.dump(_stats(statuses), f, indent=4)
    stats = _stats(totals)
    with open(os.path.join(out_dir, "_stats.json"), "w") as f:
        json.dump(stats, f, indent=4)
    return stats


# ------------------------------------------------------------------------------------------ damage


def _rewrite_tar_member(path: str, member_ext: str, index: int, data: bytes) -> None:
    """Replace the data of the `index`-th member ending in `.member_ext` of the tar at `path`."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    targets = [i for i, (m, _) in enumerate(members) if m.name.endswith(f".{member_ext}")]
    m, _ = members[targets[index]]
    members[targets[index]] = (m, data)
    with tarfile.open(path, "w") as tar:
        for m, content in members:
            m.size = len(content)
            tar.addfile(m, io.BytesIO(content))


def damage_folder(out_dir: str, output_format: Literal["webdataset", "parquet"]) -> dict[str, int]:
    """Break a folder written by write_img2dataset_folder (at least two shards of at least three
    successful samples) as real downloads break; returns how many records each kind removes.

    Shard 0 gets a corrupt JPEG (header intact, scan cut), an empty caption and, for tars, a caption
    that is not UTF-8 (Parquet's string column cannot hold one); the last shard is cut in half."""
    shards = sorted(
        f
        for f in os.listdir(out_dir)
        if f.endswith(".tar" if output_format == "webdataset" else ".parquet") and not f.endswith("_stats.json")
    )
    first, last = os.path.join(out_dir, shards[0]), os.path.join(out_dir, shards[-1])
    if output_format == "webdataset":
        with tarfile.open(first) as tar:
            jpg = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith(".jpg"))).read()
        _rewrite_tar_member(first, "jpg", 0, jpg[: len(jpg) // 3])
        _rewrite_tar_member(first, "txt", 1, b"   ")
        _rewrite_tar_member(first, "txt", 2, "légende abîmée".encode("latin-1"))
        damaged = {"undecodable_image": 1, "empty_caption": 1, "non_utf8_caption": 1}
    else:
        table = pq.read_table(first)
        ok = [i for i, s in enumerate(table["status"].to_pylist()) if s == SUCCESS]
        jpg, caption = table["jpg"].to_pylist(), table["caption"].to_pylist()
        jpg[ok[0]] = jpg[ok[0]][: len(jpg[ok[0]]) // 3]
        caption[ok[1]] = "   "
        table = table.set_column(table.schema.get_field_index("jpg"), "jpg", pa.array(jpg, pa.binary()))
        table = table.set_column(table.schema.get_field_index("caption"), "caption", pa.array(caption, pa.string()))
        pq.write_table(table, first)
        damaged = {"undecodable_image": 1, "empty_caption": 1}
    with open(last, "rb") as f:
        data = f.read()
    with open(last, "wb") as f:
        f.write(data[: len(data) // 2])
    damaged["truncated_tar" if output_format == "webdataset" else "corrupt_parquet"] = 1
    return damaged
