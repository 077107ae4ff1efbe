"""`mdc data emoji`: the Noto emoji with their CLDR names, split by base emoji, two probe levels, real swaps."""

import json
import os

import pytest

from mdc.data import emoji, shards
from mdc.evaluation import compositionality, readers

INSTALLED = os.path.isfile(emoji.FONT_PATH) and os.path.isfile(emoji.EMOJI_TEST_PATH)
needs_packages = pytest.mark.skipif(
    not INSTALLED, reason=f"Debian packages {emoji.PACKAGES} not installed (.ci/run installs them)"
)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("emoji")
    return out, emoji.write_emoji_dataset(str(out), image_size=16)


def test_missing_packages_fail_in_one_line_naming_them(tmp_path):
    with pytest.raises(emoji.MissingPackages) as err:
        emoji.write_emoji_dataset(str(tmp_path / "out"), font_path=str(tmp_path / "NotoColorEmoji.ttf"))
    assert "\n" not in str(err.value)
    assert "fonts-noto-color-emoji" in str(err.value) and "unicode-data" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_variants_share_a_base():
    def e(*cps):
        return emoji.Emoji(cps, "", "", "")

    technologist = e(0x1F9D1, 0x200D, 0x1F4BB)
    assert e(0x1F469, 0x1F3FF, 0x200D, 0x1F4BB).base == e(0x1F468, 0x200D, 0x1F4BB).base == technologist.base
    assert e(0x1F3C3, 0x200D, 0x2640, 0xFE0F).base == e(0x1F3C3, 0x1F3FB).base == e(0x1F3C3).base  # person running
    assert e(0x1F34E).base != e(0x1F34F).base  # red apple, green apple: two emoji
    assert emoji.tone_swap("kiss: man, woman, light skin tone, dark skin tone") == (
        "kiss: man, woman, dark skin tone, light skin tone"
    )
    assert emoji.tone_swap("handshake: dark skin tone, dark skin tone") is None


@needs_packages
def test_layout_captions_groups_and_the_split_by_base(written):
    out, manifest = written
    assert manifest["dataset"] == "emoji" and set(manifest["splits"]) == {"train", "val", "test"}
    assert manifest["num_samples"] > 3000 and len(manifest["class_names"]) == 9 and len(manifest["subgroup_names"]) > 90
    assert sorted(p.name for p in out.iterdir()) == ["compositionality", "manifest.json", "test", "train", "val"]
    samples = {name: list(shards.read_shards(str(out / name), format="webdataset")) for name in manifest["splits"]}
    for name, split in manifest["splits"].items():
        assert split["num_samples"] == len(samples[name]) > 100
    by_caption = {s.caption: s for split in samples.values() for s in split}
    cookie = by_caption["fortune cookie"]
    assert cookie.key == "u1f960" and cookie.meta["label_name"] == "Food & Drink"
    assert manifest["class_names"][cookie.meta["label"]] == "Food & Drink"
    assert manifest["subgroup_names"][cookie.meta["subgroup_label"]] == cookie.meta["subgroup_name"] == "food-asian"
    assert cookie.image.startswith(b"\x89PNG")
    assert by_caption["flag: Cuba"].meta["label_name"] == "Flags"
    bases = {name: {s.meta["base"] for s in split} for name, split in samples.items()}
    assert not bases["train"] & bases["test"] and not bases["train"] & bases["val"] and not bases["val"] & bases["test"]
    technologists = [s for s in by_caption.values() if "technologist" in s.caption]
    assert len(technologists) == 18 and len({s.meta["base"] for s in technologists}) == 1


@needs_packages
def test_probe_kinds_and_real_swaps(written):
    out, manifest = written
    group, subgroup = (readers.read_split(kind, str(out), "test") for kind in ("emoji", "emoji-subgroup"))
    assert len(group) == len(subgroup) == manifest["splits"]["test"]["num_samples"]  # the test split, not val
    assert group.class_names == manifest["class_names"] and subgroup.class_names == manifest["subgroup_names"]
    assert subgroup.labels.max() > group.labels.max()
    root = out / "compositionality"
    replace = json.loads((root / "replace_att.json").read_text())
    pairs = {(v["caption"], v["negative_caption"]) for v in replace.values()}
    assert ("man technologist", "woman technologist") in pairs and ("woman technologist", "man technologist") in pairs
    names = set(json.loads((out / "manifest.json").read_text())["class_names"])  # groups, not captions
    assert "woman technologist" not in names
    attribution = json.loads((root / "visual_genome_attribution.json").read_text())
    entry = next(a for a in attribution if a["true_caption"] == "handshake: light skin tone, dark skin tone")
    assert entry["false_caption"] == "handshake: dark skin tone, light skin tone"
    items = compositionality.read_benchmark("sugarcrepe", root, subsets=["swap_att", "replace_att"])
    assert len(items["replace_att"]) == manifest["compositionality"]["gender_pairs"] > 300
    assert len(items["swap_att"]) == manifest["compositionality"]["skin_tone_pairs"] > 200
    assert set(items) <= set(compositionality.SHAPES_SUBSETS)


@needs_packages
def test_the_default_eval_section_names_every_figure_emoji(written):
    """Its probes, swap pairs and captions are keyed `emoji` (the pairs were keyed `shapes`: a figure
    of emoji under the generated shapes' name)."""
    from mdc.config import load_config
    from mdc.evaluation import suite

    out, _ = written
    cfg = suite.resolve_section(load_config(None, [f"data.train_uri={out / 'train'}", "data.val_uri=null"]))
    assert [p.key for p in cfg.eval.probes] == ["emoji", "emoji-subgroup"]
    assert [c.key for c in cfg.eval.compositionality] == ["emoji"]
    assert [c.name for c in cfg.eval.captions] == ["emoji"]
