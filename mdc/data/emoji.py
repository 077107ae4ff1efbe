"""Real captioned images from two Debian packages: the Noto Color Emoji rendered, captioned with their
CLDR names ("woman technologist: medium-light skin tone", "fortune cookie", "flag: Cuba").

- fonts-noto-color-emoji: NotoColorEmoji.ttf, a CBDT bitmap font (136x128 glyphs at its one size, 109).
- unicode-data: emoji-test.txt, each emoji's code points, status, name, group (9) and subgroup (~100).
- libfribidi0: Pillow's bundled raqm loads it to shape ZWJ sequences and flags into one glyph.

Every fully-qualified emoji that renders as one glyph becomes one sample. The split is by *base*
emoji (skin tones, gender and ZWJ joiners removed), so "woman technologist: dark skin tone" is never
in the test split while "man technologist" is in train: the test split holds emoji never seen in
any variant. Probe labels at two levels: group (`label`, manifest `class_names`) and subgroup
(`subgroup_label`, manifest `subgroup_names`). Compositionality pairs are real swaps whose negative
caption is another emoji's name: man <-> woman (SugarCrepe `replace_att`) and the skin tones of two
people exchanged (ARO VG-Attribution and SugarCrepe `swap_att`).
"""

from __future__ import annotations

import io
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from PIL import Image, ImageDraw, ImageFont, features

from mdc.data import shards, storage
from mdc.data.shapes import write_benchmark_files

FONT_PATH = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
EMOJI_TEST_PATH = "/usr/share/unicode/emoji/emoji-test.txt"
PACKAGES = "fonts-noto-color-emoji unicode-data libfribidi0"
FONT_SIZE = 109  # the one size of Noto's CBDT bitmaps; other sizes fail to load
GLYPH_WIDTH = 136  # one glyph's advance at FONT_SIZE: wider means the sequence was not shaped into one
COMPOSITIONALITY_DIR = "compositionality"
SPLITS = ("train", "val", "test")
SKIN_TONES = range(0x1F3FB, 0x1F400)
ZWJ, VS16 = 0x200D, 0xFE0F
# gendered code points mapped to the neutral one, so the variants of one emoji share a base
GENDER_NEUTRAL = {
    0x1F468: 0x1F9D1,  # man -> person
    0x1F469: 0x1F9D1,  # woman -> person
    0x1F466: 0x1F9D2,  # boy -> child
    0x1F467: 0x1F9D2,  # girl -> child
    0x1F474: 0x1F9D3,  # old man -> older person
    0x1F475: 0x1F9D3,  # old woman -> older person
    0x2640: None,  # female sign (dropped)
    0x2642: None,  # male sign
}
GENDER_WORDS = {"man": "woman", "woman": "man", "men": "women", "women": "men"}
TONE = r"(?:light|medium-light|medium|medium-dark|dark) skin tone"
LINE = re.compile(r"^([0-9A-F ]+?)\s*;\s*fully-qualified\s*#\s*\S+\s+E\d+\.\d+\s+(.+)$")
UNRENDERABLE = "unrenderable_emoji"  # the font lacks it, or shapes it into several glyphs


class MissingPackages(RuntimeError):
    """A Debian package that `mdc data emoji` needs is not installed."""


@dataclass(frozen=True)
class Emoji:
    codepoints: tuple[int, ...]
    name: str
    group: str
    subgroup: str

    @property
    def text(self) -> str:
        return "".join(map(chr, self.codepoints))

    @property
    def key(self) -> str:
        return "u" + "_".join(f"{c:x}" for c in self.codepoints)

    @property
    def base(self) -> str:
        """The code points without skin tones, gender, ZWJ and VS16: one id per family of variants."""
        kept = []
        for c in self.codepoints:
            if c in SKIN_TONES or c in (ZWJ, VS16):
                continue
            c = GENDER_NEUTRAL.get(c, c)
            if c is not None:
                kept.append(c)
        return "_".join(f"{c:x}" for c in kept) or self.key


def check_packages(font_path: str = FONT_PATH, emoji_test_path: str = EMOJI_TEST_PATH) -> None:
    """Raise MissingPackages in one line naming the packages, before any work."""
    missing = [p for p in (font_path, emoji_test_path) if not os.path.isfile(p)]
    if not features.check("raqm"):
        missing.append("Pillow's raqm layout (libfribidi0)")
    if missing:
        raise MissingPackages(f"mdc data emoji needs the Debian packages {PACKAGES}; missing: {', '.join(missing)}")


def read_emoji_test(path: str = EMOJI_TEST_PATH) -> list[Emoji]:
    """Every fully-qualified emoji of emoji-test.txt, in its (CLDR) order, with group and subgroup."""
    group = subgroup = None
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("# group:"):
                group = line.split(":", 1)[1].strip()
            elif line.startswith("# subgroup:"):
                subgroup = line.split(":", 1)[1].strip()
            elif m := LINE.match(line.strip()):
                codepoints = tuple(int(c, 16) for c in m.group(1).split())
                out.append(Emoji(codepoints, m.group(2).strip(), group, subgroup))
    if not out:
        raise ValueError(f"{path}: no fully-qualified emoji lines")
    return out


def split_of(e: Emoji, seed: int, fractions: tuple[float, float] = (0.1, 0.1)) -> str:
    """val / test / train by a hash of the base emoji: every variant of one emoji in one split."""
    u = shards.key_fraction(e.base, f"emoji/{seed}")
    val, test = fractions
    return "val" if u < val else "test" if u < val + test else "train"


def load_font(path: str = FONT_PATH) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(path, FONT_SIZE, layout_engine=ImageFont.Layout.RAQM)


def render(e: Emoji, font: ImageFont.FreeTypeFont, size: int = 32, background=(255, 255, 255)) -> bytes | None:
    """PNG bytes of the emoji centred on a plain background, size x size; None when not one glyph."""
    if font.getlength(e.text) > GLYPH_WIDTH:
        return None
    glyph = Image.new("RGBA", (GLYPH_WIDTH, GLYPH_WIDTH), (0, 0, 0, 0))
    ImageDraw.Draw(glyph).text((0, (GLYPH_WIDTH - 128) // 2), e.text, font=font, embedded_color=True)
    if glyph.getbbox() is None:
        return None
    canvas = Image.new("RGBA", glyph.size, (*background, 255))
    canvas.alpha_composite(glyph)
    buf = io.BytesIO()
    canvas.convert("RGB").resize((size, size), Image.Resampling.LANCZOS).save(buf, format="PNG")
    return buf.getvalue()


def gender_swap(name: str) -> str:
    return re.sub(r"\b(man|woman|men|women)\b", lambda m: GENDER_WORDS[m.group(1)], name)


def tone_swap(name: str) -> str | None:
    """The name with its two different skin tones exchanged (None unless it names exactly two)."""
    tones = re.findall(TONE, name)
    if len(tones) != 2 or tones[0] == tones[1]:
        return None
    parts = re.split(TONE, name)
    return parts[0] + tones[1] + parts[1] + tones[0] + parts[2]


def swaps(emoji: list[Emoji]) -> dict[str, list[tuple[Emoji, str]]]:
    """{kind: [(emoji, negative caption)]}: real swaps only, the negative being another emoji's name."""
    names = {e.name for e in emoji}
    out = {"gender": [], "skin_tone": []}
    for e in emoji:
        for kind, swapped in (("gender", gender_swap(e.name)), ("skin_tone", tone_swap(e.name))):
            if swapped and swapped != e.name and swapped in names:
                out[kind].append((e, swapped))
    return out


def _write_compositionality(out_uri: str, pairs, images: dict, size: int, endpoint_url) -> dict:
    """Skin-tone swaps as ARO VG-Attribution and SugarCrepe swap_att, gender swaps as replace_att."""
    root = storage.join(out_uri, COMPOSITIONALITY_DIR)
    box = {"bbox_x": 0, "bbox_y": 0, "bbox_w": size, "bbox_h": size}
    for key in sorted({e.key for kind in pairs.values() for e, _ in kind}):
        storage.write_bytes(storage.join(root, "images", f"{key}.png"), images[key], endpoint_url)
    attribution = [
        {"image_id": e.key, "image_path": f"{e.key}.png", "true_caption": e.name, "false_caption": neg, **box}
        for e, neg in pairs["skin_tone"]
    ]

    def sugarcrepe(kind):
        return {
            str(i): {"filename": f"{e.key}.png", "caption": e.name, "negative_caption": neg}
            for i, (e, neg) in enumerate(pairs[kind])
        }

    files = {
        "aro_vg_attribution": ("visual_genome_attribution.json", attribution),
        "sugarcrepe_swap_att": ("swap_att.json", sugarcrepe("skin_tone")),
        "sugarcrepe_replace_att": ("replace_att.json", sugarcrepe("gender")),
    }
    entry = {
        "num_pairs": sum(len(v) for v in pairs.values()),
        "gender_pairs": len(pairs["gender"]),
        "skin_tone_pairs": len(pairs["skin_tone"]),
    }
    return write_benchmark_files(root, files, entry, endpoint_url)


def write_emoji_dataset(
    out_uri: str,
    image_size: int = 32,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    format: Literal["webdataset", "parquet"] = "webdataset",
    samples_per_shard: int = 1000,
    endpoint_url: str | None = None,
    font_path: str = FONT_PATH,
    emoji_test_path: str = EMOJI_TEST_PATH,
) -> dict:
    """Write train/, val/, test/ shards, compositionality/ and manifest.json; returns the manifest.

    Compositionality pairs come from every split (a held-out-only set would hold a handful of
    two-person bases, since the split is by base): a train-split image was seen with its own name,
    never with the swapped one."""
    check_packages(font_path, emoji_test_path)
    font, skips = load_font(font_path), Counter()
    emoji, images = [], {}
    for e in read_emoji_test(emoji_test_path):
        if (png := render(e, font, image_size)) is None:
            skips[UNRENDERABLE] += 1
            continue
        emoji.append(e)
        images[e.key] = png
    groups = list(dict.fromkeys(e.group for e in emoji))  # emoji-test.txt's order
    subgroups = list(dict.fromkeys(e.subgroup for e in emoji))

    def sample(e: Emoji) -> shards.Sample:
        meta = {
            "label": groups.index(e.group),
            "label_name": e.group,
            "subgroup_label": subgroups.index(e.subgroup),
            "subgroup_name": e.subgroup,
            "base": e.base,
            "emoji": e.text,
        }
        return shards.Sample(e.key, images[e.key], e.name, meta)

    split = {e.key: split_of(e, seed, (val_fraction, test_fraction)) for e in emoji}
    splits = {
        name: shards.write_split(
            (sample(e) for e in emoji if split[e.key] == name), out_uri, name, format, samples_per_shard, endpoint_url
        )
        for name in SPLITS
    }
    pairs = swaps(emoji)
    manifest = {
        "dataset": "emoji",
        "seed": seed,
        "image_size": image_size,
        "format": format,
        "num_samples": len(emoji),
        "val_fraction": val_fraction,
        "test_fraction": test_fraction,
        "class_names": groups,
        "subgroup_names": subgroups,
        "num_bases": len({e.base for e in emoji}),
        "splits": splits,
        "skipped": dict(skips),
        "sources": {"font": font_path, "names": emoji_test_path, "packages": PACKAGES},
        "compositionality": _write_compositionality(out_uri, pairs, images, image_size, endpoint_url),
    }
    shards.write_manifest(out_uri, manifest, endpoint_url)
    return manifest
