"""A generated compositional dataset: 1 or 2 coloured shapes in a spatial relation, with captions.

Small, fully known and deterministic from a seed, so that pretraining, linear probes (label = shape of
the first-mentioned object) and compositionality tests (swapped objects / swapped colours, written in
the ARO and SugarCrepe layouts) can all run end to end on a laptop.

Captions name the two objects in reading order ("to the left of", "above"), so the first-mentioned
object, and with it the probe label, is a property of the image (with "to the right of" too, the
same picture would carry either object's label).
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass, field, replace
from typing import Literal

from PIL import Image, ImageDraw

from mdc.data import shards, storage

CLASS_NAMES = ["circle", "square", "triangle"]  # probe label = shape of the first-mentioned object
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
SIZES = {"small": 0.15, "large": 0.24}  # half-width as a fraction of the image side
RELATIONS = ["to the left of", "above"]  # reading order: the first-mentioned object is left / on top
RELATION_SWAP = "relation_swap"  # objects swapped around the relation
ATTRIBUTE_SWAP = "attribute_swap"  # colours swapped between the two objects
COMPOSITIONALITY_DIR = "compositionality"


@dataclass(frozen=True)
class ShapeObject:
    shape: str
    colour: str
    size: str

    def describe(self) -> str:
        return f"a {self.size} {self.colour} {self.shape}"


@dataclass
class ShapeRecord:
    key: str
    image: bytes  # PNG
    caption: str
    label: int
    objects: list[ShapeObject]
    relation: str | None = None
    negatives: dict[str, str] = field(default_factory=dict)  # RELATION_SWAP / ATTRIBUTE_SWAP -> caption

    @property
    def label_name(self) -> str:
        return CLASS_NAMES[self.label]


def _caption(objects: list[ShapeObject], relation: str | None) -> str:
    if len(objects) == 1:
        return objects[0].describe()
    return f"{objects[0].describe()} {relation} {objects[1].describe()}"


def _centres(rng: random.Random, s: int, relation: str | None) -> list[tuple[float, float]]:
    """Object centres: the first object left of (or above) the second."""
    if relation is None:
        return [(s / 2 + rng.uniform(-s / 8, s / 8), s / 2 + rng.uniform(-s / 8, s / 8))]
    first, second = (p + rng.uniform(-s / 32, s / 32) for p in (s / 4, 3 * s / 4))
    across_a, across_b = (s / 2 + rng.uniform(-s / 10, s / 10) for _ in range(2))
    if relation == "to the left of":
        return [(first, across_a), (second, across_b)]
    return [(across_a, first), (across_b, second)]


def _draw(draw: ImageDraw.ImageDraw, obj: ShapeObject, cx: float, cy: float, s: int) -> None:
    r = SIZES[obj.size] * s
    cx, cy = min(max(cx, r + 1), s - r - 2), min(max(cy, r + 1), s - r - 2)  # keep it inside the image
    box = (cx - r, cy - r, cx + r, cy + r)
    fill = COLOURS[obj.colour]
    if obj.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif obj.shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)


def shape_key(index: int) -> str:
    return f"{index:08d}"


def make_shape(index: int, seed: int, image_size: int = 64, max_objects: Literal[1, 2] = 2) -> ShapeRecord:
    """The index-th record of the dataset with this seed (a pure function: any subset can be rebuilt).
    With max_objects=1 every image holds one shape and its caption is 4 tokens ("a small red
    circle"): the short-caption variant, where the masking schedule's lower bound matters most."""
    rng = random.Random(f"shapes/{seed}/{index}")
    n_objects = 1 if rng.random() < 1 / 3 or max_objects == 1 else 2  # the draw happens either way
    colours = rng.sample(sorted(COLOURS), n_objects)  # distinct colours, so colour swaps are real negatives
    objects = [ShapeObject(rng.choice(CLASS_NAMES), c, rng.choice(sorted(SIZES))) for c in colours]
    relation = rng.choice(RELATIONS) if n_objects == 2 else None

    background = (255, 255, 255) if rng.random() < 0.5 else tuple(rng.randint(225, 255) for _ in range(3))
    img = Image.new("RGB", (image_size, image_size), background)
    draw = ImageDraw.Draw(img)
    for obj, (cx, cy) in zip(objects, _centres(rng, image_size, relation)):
        _draw(draw, obj, cx, cy, image_size)
    buf = io.BytesIO()
    img.save(buf, format="PNG")

    negatives = {}
    if n_objects == 2:
        a, b = objects
        negatives[RELATION_SWAP] = _caption([b, a], relation)
        colours_swapped = [replace(a, colour=b.colour), replace(b, colour=a.colour)]
        negatives[ATTRIBUTE_SWAP] = _caption(colours_swapped, relation)
    return ShapeRecord(
        shape_key(index),
        buf.getvalue(),
        _caption(objects, relation),
        CLASS_NAMES.index(objects[0].shape),
        objects,
        relation,
        negatives,
    )


def generate_shapes(num: int, seed: int, image_size: int = 64) -> list[ShapeRecord]:
    return [make_shape(i, seed, image_size) for i in range(num)]


def _to_sample(r: ShapeRecord) -> shards.Sample:
    return shards.Sample(r.key, r.image, r.caption, {"label": r.label, "label_name": r.label_name})


def _write_compositionality(out_uri: str, pairs: list[ShapeRecord], image_size: int, endpoint_url: str | None) -> dict:
    """ARO VG-Relation/VG-Attribution and SugarCrepe swap_obj/swap_att files, images in images/."""
    root = storage.join(out_uri, COMPOSITIONALITY_DIR)
    whole_image = {"bbox_x": 0, "bbox_y": 0, "bbox_w": image_size, "bbox_h": image_size}
    relation, attribution, swap_obj, swap_att = [], [], {}, {}
    for i, r in enumerate(pairs):
        filename = f"{r.key}.png"
        storage.write_bytes(storage.join(root, "images", filename), r.image, endpoint_url)
        common = {"image_id": r.key, "image_path": filename, "true_caption": r.caption, **whole_image}
        relation.append({**common, "false_caption": r.negatives[RELATION_SWAP], "relation_name": r.relation})
        attribution.append(
            {**common, "false_caption": r.negatives[ATTRIBUTE_SWAP], "attributes": [o.colour for o in r.objects]}
        )
        swap_obj[str(i)] = {"filename": filename, "caption": r.caption, "negative_caption": r.negatives[RELATION_SWAP]}
        swap_att[str(i)] = {"filename": filename, "caption": r.caption, "negative_caption": r.negatives[ATTRIBUTE_SWAP]}
    files = {
        "aro_vg_relation": ("visual_genome_relation.json", relation),
        "aro_vg_attribution": ("visual_genome_attribution.json", attribution),
        "sugarcrepe_swap_obj": ("swap_obj.json", swap_obj),
        "sugarcrepe_swap_att": ("swap_att.json", swap_att),
    }
    return write_benchmark_files(root, files, {"num_pairs": len(pairs)}, endpoint_url)


def write_benchmark_files(root: str, files: dict[str, tuple[str, object]], entry: dict, endpoint_url=None) -> dict:
    """The ARO/SugarCrepe-format JSON files under `root` (COMPOSITIONALITY_DIR); `entry` (the
    manifest's) gains each file's path by name and the image folder."""
    entry = {**entry, "image_dir": f"{COMPOSITIONALITY_DIR}/images"}
    for name, (filename, content) in files.items():
        storage.write_bytes(storage.join(root, filename), json.dumps(content, indent=1).encode(), endpoint_url)
        entry[name] = f"{COMPOSITIONALITY_DIR}/{filename}"
    return entry


def write_shapes_dataset(
    out_uri: str,
    num: int,
    seed: int,
    val_fraction: float = 0.1,
    format: Literal["webdataset", "parquet"] = "webdataset",
    samples_per_shard: int = 1000,
    image_size: int = 64,
    endpoint_url: str | None = None,
    max_objects: Literal[1, 2] = 2,
) -> dict:
    """Write train/ and val/ shards, compositionality files built from the val pairs (none with
    max_objects=1: a swap needs two objects), and manifest.json.

    The split is by a hash of the key, so it does not depend on num; returns the manifest."""
    is_val = [shards.key_fraction(shape_key(i), f"shapes/{seed}") < val_fraction for i in range(num)]
    train = (make_shape(i, seed, image_size, max_objects) for i in range(num) if not is_val[i])
    val = [make_shape(i, seed, image_size, max_objects) for i in range(num) if is_val[i]]  # small; reused below
    splits = {
        name: shards.write_split(map(_to_sample, records), out_uri, name, format, samples_per_shard, endpoint_url)
        for name, records in (("train", train), ("val", val))
    }
    pairs = [r for r in val if r.negatives]
    manifest = {
        "dataset": "shapes",
        "seed": seed,
        "image_size": image_size,
        "max_objects": max_objects,
        "format": format,
        "num_samples": num,
        "val_fraction": val_fraction,
        "class_names": CLASS_NAMES,
        "splits": splits,
        "compositionality": _write_compositionality(out_uri, pairs, image_size, endpoint_url),
    }
    shards.write_manifest(out_uri, manifest, endpoint_url)
    return manifest
