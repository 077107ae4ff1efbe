"""Generated shapes and the tuxpaint converter: determinism, captions that match the pixels, layouts."""

import json
import os
import re
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from mdc.data import shapes, shards, tuxpaint
from mdc.data.images import decode_image

OBJECT = r"a (small|large) (red|green|blue|yellow) (circle|square|triangle)"
CAPTION = re.compile(rf"^{OBJECT}(?: (to the left of|above) {OBJECT})?$")


def test_shapes_are_deterministic_from_the_seed():
    a, b = shapes.generate_shapes(30, seed=1), shapes.generate_shapes(30, seed=1)
    assert [(r.key, r.image, r.caption, r.negatives) for r in a] == [
        (r.key, r.image, r.caption, r.negatives) for r in b
    ]
    c = shapes.generate_shapes(30, seed=2)
    assert [r.caption for r in a] != [r.caption for r in c]
    assert shapes.make_shape(17, seed=1).image == a[17].image  # any record can be rebuilt alone


def test_shapes_captions_labels_and_negatives():
    records = shapes.generate_shapes(200, seed=0)
    counts = Counter(len(r.objects) for r in records)
    assert counts[1] > 30 and counts[2] > 100
    for r in records:
        m = CAPTION.match(r.caption)
        assert m, r.caption
        assert r.label_name == m.group(3) == r.objects[0].shape  # first-mentioned object's shape
        assert shapes.CLASS_NAMES[r.label] == r.label_name
        if len(r.objects) == 1:
            assert r.negatives == {} and m.group(4) is None
            continue
        size1, colour1, shape1, relation, size2, colour2, shape2 = m.groups()
        assert colour1 != colour2 and relation == r.relation
        assert r.negatives[shapes.RELATION_SWAP] == (
            f"a {size2} {colour2} {shape2} {relation} a {size1} {colour1} {shape1}"
        )
        assert r.negatives[shapes.ATTRIBUTE_SWAP] == (
            f"a {size1} {colour2} {shape1} {relation} a {size2} {colour1} {shape2}"
        )


def test_one_object_shapes_have_four_token_captions_and_no_pairs(tmp_path):
    """The short-caption variant: the same draws, one shape each, so its images are the default
    dataset's one-object images and its other images lose their second object."""
    one, two = shapes.generate_shapes(60, seed=0), [shapes.make_shape(i, 0, max_objects=1) for i in range(60)]
    assert all(len(r.objects) == 1 and r.negatives == {} and len(r.caption.split()) == 4 for r in two)
    assert all(b.image == a.image for a, b in zip(one, two) if len(a.objects) == 1)
    assert [a.objects[0].shape for a in one if len(a.objects) == 1] == [
        b.objects[0].shape for a, b in zip(one, two) if len(a.objects) == 1
    ]
    manifest = shapes.write_shapes_dataset(str(tmp_path), num=40, seed=0, max_objects=1)
    assert manifest["max_objects"] == 1 and manifest["compositionality"]["num_pairs"] == 0


def colour_centre(img: np.ndarray, colour: str) -> np.ndarray:
    ys, xs = np.nonzero((np.abs(img.astype(int) - shapes.COLOURS[colour]).sum(axis=2)) < 30)
    assert len(xs) > 20, f"no {colour} object drawn"
    return np.array([xs.mean(), ys.mean()])


def test_shapes_pixels_match_the_caption():
    for r in shapes.generate_shapes(60, seed=3):
        img = np.asarray(decode_image(r.image))
        assert img.shape == (64, 64, 3)
        assert (img[0, 0] >= 220).all()  # light background
        if len(r.objects) == 1:
            continue
        (x1, y1), (x2, y2) = (colour_centre(img, o.colour) for o in r.objects)
        expected = {"to the left of": x1 < x2 - 10, "above": y1 < y2 - 10}[r.relation]
        assert expected, (r.caption, (x1, y1), (x2, y2))
        a, b = r.objects
        if a.size != b.size:
            area = {
                o.size: (np.abs(img.astype(int) - shapes.COLOURS[o.colour]).sum(axis=2) < 30).sum() for o in r.objects
            }
            assert area["large"] > area["small"]


def test_write_shapes_dataset(tmp_path):
    out = str(tmp_path / "shapes")
    manifest = shapes.write_shapes_dataset(out, num=120, seed=0, val_fraction=0.25, samples_per_shard=40)
    assert shards.read_manifest(out) == manifest
    assert manifest["class_names"] == shapes.CLASS_NAMES
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert train["num_samples"] + val["num_samples"] == 120 and 15 < val["num_samples"] < 45
    assert train["shards"][0] == "train/shard-00000.tar"

    records = {r.key: r for r in shapes.generate_shapes(120, seed=0)}
    seen = set()
    for split in ("train", "val"):
        samples = list(shards.read_shards(os.path.join(out, split)))
        assert len(samples) == manifest["splits"][split]["num_samples"]
        for s in samples:
            r = records[s.key]
            assert (s.image, s.caption) == (r.image, r.caption)
            assert s.meta == {"label": r.label, "label_name": r.label_name}
        seen |= {s.key for s in samples}
    assert seen == set(records)

    comp = manifest["compositionality"]
    val_pairs = [records[s.key] for s in shards.read_shards(os.path.join(out, "val")) if records[s.key].negatives]
    assert comp["num_pairs"] == len(val_pairs) > 0
    load = lambda name: json.loads((tmp_path / "shapes" / comp[name]).read_text())  # noqa: E731

    relation = load("aro_vg_relation")
    assert comp["aro_vg_relation"].endswith("visual_genome_relation.json")
    assert len(relation) == len(val_pairs)
    for item, r in zip(relation, val_pairs):
        assert {
            "image_path",
            "true_caption",
            "false_caption",
            "relation_name",
            "bbox_x",
            "bbox_y",
            "bbox_w",
            "bbox_h",
        } <= item.keys()
        assert (item["true_caption"], item["false_caption"]) == (r.caption, r.negatives[shapes.RELATION_SWAP])
        assert item["relation_name"] == r.relation
        assert (item["bbox_x"], item["bbox_y"], item["bbox_w"], item["bbox_h"]) == (0, 0, 64, 64)
        image = Image.open(tmp_path / "shapes" / comp["image_dir"] / item["image_path"])
        assert image.size == (64, 64)

    attribution = load("aro_vg_attribution")
    assert [a["false_caption"] for a in attribution] == [r.negatives[shapes.ATTRIBUTE_SWAP] for r in val_pairs]
    assert [a["attributes"] for a in attribution] == [[o.colour for o in r.objects] for r in val_pairs]

    for name, kind in (("sugarcrepe_swap_obj", shapes.RELATION_SWAP), ("sugarcrepe_swap_att", shapes.ATTRIBUTE_SWAP)):
        data = load(name)
        assert comp[name].endswith(f"{name.split('_', 1)[1]}.json")
        assert list(data) == [str(i) for i in range(len(val_pairs))]
        for entry, r in zip(data.values(), val_pairs):
            assert entry == {"filename": f"{r.key}.png", "caption": r.caption, "negative_caption": r.negatives[kind]}
            assert (tmp_path / "shapes" / comp["image_dir"] / entry["filename"]).is_file()


def test_write_shapes_dataset_parquet(tmp_path):
    manifest = shapes.write_shapes_dataset(str(tmp_path), num=30, seed=5, format="parquet", samples_per_shard=100)
    assert manifest["splits"]["train"]["shards"] == ["train/shard-00000.parquet"]
    samples = list(shards.read_shards(str(tmp_path / "train")))
    assert len(samples) == manifest["splits"]["train"]["num_samples"]


# --------------------------------------------------------------------------------------- tuxpaint


def test_tuxpaint_converter_on_a_small_tree(tmp_path):
    root = tmp_path / "stamps"
    (root / "animals" / "cats").mkdir(parents=True)
    (root / "food").mkdir()
    rgba = np.zeros((20, 10, 4), dtype=np.uint8)
    rgba[5:15, 2:8] = (200, 0, 0, 255)  # opaque red block on transparent
    Image.fromarray(rgba).save(root / "animals" / "cats" / "cat.png")
    (root / "animals" / "cats" / "cat.txt").write_text("A cat.\nfr.utf8=Un chat.\n")
    Image.fromarray(rgba).save(root / "animals" / "cats" / "cat_mirror.png")  # no caption
    Image.fromarray(rgba).save(root / "food" / "pie.png")
    (root / "food" / "pie.txt").write_bytes("Une tarte flambée".encode("latin-1"))
    (root / "food" / "bun.png").write_bytes(b"not a png")
    (root / "food" / "bun.txt").write_text("A bun.\n")
    (root / "food" / "empty.png").write_bytes(b"x")
    (root / "food" / "empty.txt").write_text("\n")

    manifest = tuxpaint.write_tuxpaint_dataset(str(tmp_path / "out"), root=str(root), val_fraction=0.0)
    assert manifest["class_names"] == ["animals", "food"]
    assert manifest["num_samples"] == 1 and manifest["splits"]["val"]["num_samples"] == 0
    assert manifest["skipped"] == {
        shards.MISSING_CAPTION: 1,
        shards.NON_UTF8_CAPTION: 1,
        shards.EMPTY_CAPTION: 1,
        shards.UNDECODABLE_IMAGE: 1,
    }
    (sample,) = shards.read_shards(str(tmp_path / "out" / "train"))
    assert sample.key == "animals_cats_cat" and sample.caption == "A cat."
    assert sample.meta["label_name"] == "animals" and sample.meta["label"] == 0
    img = np.asarray(decode_image(sample.image))
    assert img.shape == (20, 10, 3)
    assert (img[0, 0] > 245).all()  # transparent -> white
    assert img[10, 5, 0] > 180 and img[10, 5, 1] < 40


@pytest.mark.skipif(
    not os.path.isdir(tuxpaint.DEFAULT_ROOT),
    reason=f"Debian package tuxpaint-stamps-default not installed ({tuxpaint.DEFAULT_ROOT} missing)",
)
def test_tuxpaint_converter_on_the_installed_package(tmp_path):
    out = str(tmp_path / "tux")
    manifest = tuxpaint.write_tuxpaint_dataset(out, max_size=64, format="parquet")
    # ~170 stamps exist only as SVG: without cairo (libcairo2) they are skipped, and the bar stays
    assert tuxpaint.cairosvg is not None, "cairosvg cannot load libcairo2 (.ci/run installs it)"
    assert manifest["num_samples"] >= 900, manifest["skipped"]
    assert {"animals", "food", "symbols", "vehicles"} <= set(manifest["class_names"])
    assert 0.05 < manifest["splits"]["val"]["num_samples"] / manifest["num_samples"] < 0.15

    samples = list(shards.read_shards(os.path.join(out, "train"))) + list(shards.read_shards(os.path.join(out, "val")))
    assert len(samples) == manifest["num_samples"] == len({s.key for s in samples})
    assert all(s.caption and s.meta["label_name"] in manifest["class_names"] for s in samples)
    assert all(manifest["class_names"][s.meta["label"]] == s.meta["label_name"] for s in samples)
    badger = next(s for s in samples if s.key == "animals_mammals_badger")
    assert badger.caption == "A badger."
    assert max(decode_image(badger.image).size) == 64
