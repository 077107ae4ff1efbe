"""Converter for Debian's tuxpaint-stamps-default: ~1000 real clip-art images with English captions.

Layout: ROOT/CATEGORY/**/NAME.png|svg with NAME.txt beside it (first line English). The label is the
top-level CATEGORY. Images are composited on white (they are RGBA), shrunk to max_size and stored as
JPEG. SVGs are rasterised with cairosvg when it is installed; otherwise they are skipped and counted.
"""

from __future__ import annotations

import io
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from PIL import Image

from mdc.data import shards
from mdc.data.images import decode_image

try:
    import cairosvg
except (ImportError, OSError):  # OSError: the package is there but the cairo library is not
    cairosvg = None

DEFAULT_ROOT = "/usr/share/tuxpaint/stamps"
UNRASTERISABLE_SVG = "unrasterisable_svg"


@dataclass
class Stamp:
    key: str
    path: str
    caption: str
    category: str


def find_stamps(root: str, skips: Counter) -> list[Stamp]:
    """Stamps with a usable caption, sorted by path; PNG preferred over SVG of the same name.

    Images without a NAME.txt (e.g. the *_mirror.png variants) are counted as MISSING_CAPTION."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"tuxpaint stamps not found at {root} (apt-get install tuxpaint-stamps-default)")
    stamps = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        names = set(filenames)
        stems = sorted({os.path.splitext(f)[0] for f in filenames if f.endswith((".png", ".svg"))})
        for stem in stems:
            path = os.path.join(dirpath, stem + (".png" if stem + ".png" in names else ".svg"))
            if stem + ".txt" not in names:
                skips[shards.MISSING_CAPTION] += 1
                continue
            if path.endswith(".svg") and cairosvg is None:
                skips[UNRASTERISABLE_SVG] += 1
                continue
            with open(os.path.join(dirpath, stem + ".txt"), "rb") as f:
                first_line = f.readline()
            try:
                caption = first_line.decode("utf-8").strip()
            except UnicodeDecodeError:
                skips[shards.NON_UTF8_CAPTION] += 1
                continue
            if not caption:
                skips[shards.EMPTY_CAPTION] += 1
                continue
            rel = os.path.relpath(path, root)
            parts = rel.split(os.sep)
            category = parts[0] if len(parts) > 1 else "uncategorised"
            key = re.sub(r"[^A-Za-z0-9_-]+", "_", os.path.splitext(rel)[0])
            stamps.append(Stamp(key, path, caption, category))
    return stamps


def render_stamp(path: str, max_size: int = 256) -> bytes:
    """JPEG bytes of a stamp on white, longer side at most max_size. Raises ValueError if undecodable."""
    if path.endswith(".svg"):
        try:  # unsafe=True lets cairosvg expand the XML entities some of these local files use
            data = cairosvg.svg2png(url=path, output_width=max_size, unsafe=True)
        except Exception as e:  # cairosvg raises many kinds of parse errors
            raise ValueError(f"{path}: cannot rasterise SVG: {e}") from e
    else:
        with open(path, "rb") as f:
            data = f.read()
    img = decode_image(data)
    img.thumbnail((max_size, max_size), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _samples(stamps: list[Stamp], class_names: list[str], max_size: int, skips: Counter) -> Iterator[shards.Sample]:
    for s in stamps:
        try:
            image = render_stamp(s.path, max_size)
        except ValueError:
            skips[shards.UNDECODABLE_IMAGE] += 1
            continue
        label = class_names.index(s.category)
        yield shards.Sample(s.key, image, s.caption, {"label": label, "label_name": s.category, "source": s.path})


def write_tuxpaint_dataset(
    out_uri: str,
    root: str = DEFAULT_ROOT,
    val_fraction: float = 0.1,
    seed: int = 0,
    format: Literal["webdataset", "parquet"] = "webdataset",
    samples_per_shard: int = 200,
    max_size: int = 256,
    endpoint_url: str | None = None,
) -> dict:
    """Write train/ and val/ shards (split by a hash of the key) and manifest.json; returns the manifest."""
    skips: Counter = Counter()
    stamps = find_stamps(root, skips)
    class_names = sorted({s.category for s in stamps})
    is_val = {s.key: shards.key_fraction(s.key, f"tuxpaint/{seed}") < val_fraction for s in stamps}
    splits = {}
    for name in ("train", "val"):
        chosen = [s for s in stamps if is_val[s.key] == (name == "val")]
        samples = _samples(chosen, class_names, max_size, skips)
        splits[name] = shards.write_split(samples, out_uri, name, format, samples_per_shard, endpoint_url)
    manifest = {
        "dataset": "tuxpaint",
        "root": root,
        "seed": seed,
        "format": format,
        "max_size": max_size,
        "val_fraction": val_fraction,
        "class_names": class_names,
        "splits": splits,
        "num_samples": sum(s["num_samples"] for s in splits.values()),
        "skipped": dict(skips),
    }
    shards.write_manifest(out_uri, manifest, endpoint_url)
    return manifest
