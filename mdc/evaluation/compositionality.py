"""Vision–language compositionality: ARO and SugarCrepe in their published JSON layouts (docs/design.md §9).

Each test item is an image with its true caption and one or more manipulated ones; the model is
right when the true caption scores strictly above every manipulated one (ties count as wrong).
Accuracy is reported per subset and as the macro average over subsets.

Every likelihood score sums over tokens, so it prefers the shorter caption whatever the image shows
(SugarCrepe's add_* negatives are one word longer). Beside each accuracy comes a *blind* accuracy:
the same scorer with each item's image swapped for another item's (a fixed derangement), what the
text alone wins. A subset whose blind accuracy is above BLIND_BIAS_THRESHOLD measures length or text
priors, not vision, and is listed in `text_biased`. `normalize="token"` scores by the per-token mean
log-likelihood instead of the sum.

Layouts (ROOT is --root; images are looked up in IMAGES, default ROOT/images):
- ARO VG-Relation / VG-Attribution: ROOT/visual_genome_{relation,attribution}.json, a list of
  {image_path, bbox_x, bbox_y, bbox_w, bbox_h, true_caption, false_caption, ...}; the image is cropped
  to the box, as ARO does.
- ARO COCO-Order / Flickr30k-Order: ROOT/coco_karpathy_test.json, ROOT/flickr30k_test.json, Karpathy
  lists of {image, caption: [...]} with `image` relative to ROOT. Every caption is one item: the
  caption (lower-cased, punctuation stripped, 30 words, ARO's `pre_caption`) against ARO's four word-
  order perturbations: shuffle nouns and adjectives, shuffle all but nouns and adjectives, shuffle
  within trigrams, shuffle trigrams. The first two need part-of-speech tags (`tagger`; spaCy's
  en_core_web_sm by default, which must be installed).
- SugarCrepe: ROOT/{add_att,add_obj,replace_att,replace_obj,replace_rel,swap_att,swap_obj}.json, a dict
  of {filename, caption, negative_caption} (filename relative to IMAGES, COCO val2017 for the real set).

Scorers estimate log p(caption | image) (docs/design.md §5) and are looked up by name in `SCORERS`, so other
model kinds (CLIP's image–text cosine) plug in with `register_scorer`.
"""

from __future__ import annotations

import json
import random
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import torch

from mdc import registry
from mdc.data import storage
from mdc.data.images import ImageTransform
from mdc.data.shapes import COMPOSITIONALITY_DIR
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation.readers import DatasetFormatError, load_image
from mdc.scoring import autoregressive_score, cosine_scores, denoising_scores, monte_carlo_elbo, pseudo_log_likelihood

ARO_FILES = {
    "vg_relation": "visual_genome_relation.json",
    "vg_attribution": "visual_genome_attribution.json",
    "coco_order": "coco_karpathy_test.json",
    "flickr_order": "flickr30k_test.json",
}
SUGARCREPE_SUBSETS = ("add_att", "add_obj", "replace_att", "replace_obj", "replace_rel", "swap_att", "swap_obj")
BENCHMARKS = ("aro", "sugarcrepe")
# what `mdc data shapes` (the first four) and `mdc data emoji` (vg_attribution, swap_att, replace_att) write
SHAPES_SUBSETS = ("vg_relation", "vg_attribution", "swap_obj", "swap_att", "replace_att")
VG_FIELDS = ("image_path", "bbox_x", "bbox_y", "bbox_w", "bbox_h", "true_caption", "false_caption")
BLIND_BIAS_THRESHOLD = 0.6
NORMALIZATIONS = ("none", "token")
NOUN_TAGS = {"NN", "NNS", "NNP", "NNPS"}
ADJECTIVE_TAGS = {"JJ", "JJR", "JJS"}


@dataclass
class Item:
    image: str  # path of the image file
    captions: list[str]  # the true caption first, then the manipulated ones
    box: tuple[float, float, float, float] | None = None  # (x, y, w, h) crop, ARO VG only


# ------------------------------------------------------------------------------------- readers


def benchmark_subsets(benchmark: str) -> tuple[str, ...]:
    """The subsets a benchmark can hold (`shapes`: the ARO/SugarCrepe-format pairs `mdc data shapes` writes)."""
    return {"aro": tuple(ARO_FILES), "sugarcrepe": SUGARCREPE_SUBSETS, "shapes": SHAPES_SUBSETS}[benchmark]


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DatasetFormatError(f"{path}: invalid JSON: {e}") from e


def _field(entry, field: str, path: Path, where: str):
    if not isinstance(entry, dict) or field not in entry:
        raise DatasetFormatError(f"{path}: {where}: missing field {field!r}")
    return entry[field]


def _image(directory: Path, name: str, path: Path, where: str, field: str) -> str:
    image = directory / name
    if not image.is_file():
        raise DatasetFormatError(f"{path}: {where}: field {field!r} names {image}, which does not exist")
    return str(image)


def read_vg(path: Path, image_dir: Path) -> list[Item]:
    """ARO VG-Relation or VG-Attribution."""
    items = []
    for i, entry in enumerate(_load_json(path)):
        where = f"item {i}"
        x, y, w, h, true, false = (_field(entry, f, path, where) for f in VG_FIELDS[1:])
        image = _image(image_dir, _field(entry, "image_path", path, where), path, where, "image_path")
        items.append(Item(image, [true, false], (float(x), float(y), float(w), float(h))))
    return items


def read_sugarcrepe(path: Path, image_dir: Path) -> list[Item]:
    """One SugarCrepe subset."""
    items = []
    for key, entry in _load_json(path).items():
        where = f"item {key!r}"
        caption, negative = (_field(entry, f, path, where) for f in ("caption", "negative_caption"))
        image = _image(image_dir, _field(entry, "filename", path, where), path, where, "filename")
        items.append(Item(image, [caption, negative]))
    return items


def pre_caption(caption: str, max_words: int = 30) -> str:
    """ARO's caption normalisation: lower case, drop .!"()*#:;~, squeeze spaces, truncate."""
    caption = re.sub(r"([.!\"()*#:;~])", " ", caption.lower())
    return " ".join(re.sub(r"\s{2,}", " ", caption).strip().split(" ")[:max_words])


def _trigrams(words: list[str]) -> list[list[str]]:
    return [words[i : i + 3] for i in range(0, len(words), 3)]


def _shuffle_at(words: list[str], positions: list[int], rng: random.Random) -> list[str]:
    """The words with those at `positions` permuted among themselves."""
    picked = [words[i] for i in positions]
    rng.shuffle(picked)
    out = list(words)
    for i, word in zip(positions, picked):
        out[i] = word
    return out


def order_perturbations(caption: str, tagger: Callable[[list[str]], list[str]], rng: random.Random) -> list[str]:
    """ARO's four word-order perturbations of a caption (nouns and adjectives by Penn tag)."""
    words = re.findall(r"\w+|[^\w\s]", caption)
    tags = tagger(words)
    nouns = [i for i, t in enumerate(tags) if t in NOUN_TAGS]
    adjectives = [i for i, t in enumerate(tags) if t in ADJECTIVE_TAGS]
    others = [i for i, t in enumerate(tags) if t not in NOUN_TAGS | ADJECTIVE_TAGS]
    within = [rng.sample(t, len(t)) for t in _trigrams(words)]
    across = _trigrams(words)
    rng.shuffle(across)
    perturbed = [
        _shuffle_at(_shuffle_at(words, nouns, rng), adjectives, rng),
        _shuffle_at(words, others, rng),
        [w for t in within for w in t],
        [w for t in across for w in t],
    ]
    return [" ".join(p) for p in perturbed]


def spacy_tagger() -> Callable[[list[str]], list[str]]:
    """Penn Treebank tags from spaCy's en_core_web_sm, as ARO uses."""
    try:
        # optional: only the word-order subsets need spaCy and its English model
        import spacy
        from spacy.tokens import Doc

        nlp = spacy.load("en_core_web_sm")
    except (ImportError, OSError) as e:
        raise RuntimeError(
            "COCO/Flickr-Order need a part-of-speech tagger: install spacy and its "
            "en_core_web_sm model, or pass tagger="
        ) from e
    return lambda words: [token.tag_ for token in nlp(Doc(nlp.vocab, words=words))]


def read_order(path: Path, image_root: Path, tagger: Callable[[list[str]], list[str]], seed: int = 0) -> list[Item]:
    """ARO COCO-Order or Flickr30k-Order from a Karpathy-split JSON file."""
    rng = random.Random(seed)
    items = []
    for i, entry in enumerate(_load_json(path)):
        where = f"item {i}"
        captions = _field(entry, "caption", path, where)
        image = _image(image_root, _field(entry, "image", path, where), path, where, "image")
        for caption in [captions] if isinstance(captions, str) else captions:
            caption = pre_caption(caption)
            items.append(Item(image, [caption, *order_perturbations(caption, tagger, rng)]))
    return items


def read_benchmark(
    benchmark: str,
    root: str | Path,
    image_dir: str | Path | None = None,
    subsets: Sequence[str] | None = None,
    tagger=None,
    seed: int = 0,
) -> dict[str, list[Item]]:
    """{subset: items} for every subset file present under root (or the `subsets` asked for)."""
    root = Path(root)
    image_dir = Path(image_dir) if image_dir else root / "images"
    files = ARO_FILES if benchmark == "aro" else {s: f"{s}.json" for s in SUGARCREPE_SUBSETS}
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; expected one of {BENCHMARKS}")
    unknown = set(subsets or ()) - set(files)
    if unknown:
        raise ValueError(f"unknown {benchmark} subsets {sorted(unknown)}; expected some of {sorted(files)}")
    wanted = list(subsets) if subsets else [s for s, f in files.items() if (root / f).is_file()]
    if not wanted:
        raise FileNotFoundError(f"{root}: none of the {benchmark} files {sorted(files.values())}")
    out = {}
    for subset in wanted:
        path = root / files[subset]
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found ({benchmark} subset {subset})")
        if subset in ("vg_relation", "vg_attribution"):
            out[subset] = read_vg(path, image_dir)
        elif subset in ("coco_order", "flickr_order"):
            out[subset] = read_order(path, root, tagger or spacy_tagger(), seed)
        else:
            out[subset] = read_sugarcrepe(path, image_dir)
    return out


# ------------------------------------------------------------------------------------- scorers

ScoreFn = Callable[..., torch.Tensor]  # (model, images, texts[k][b], samples, generator) -> (B, K)
SCORERS: dict[str, ScoreFn] = {}


def register_scorer(name: str, extra_terms: int | None = 0):
    """`extra_terms`: how many terms the score sums beyond the caption's text tokens (1 for the
    autoregressive EOS); None for a score that is not a sum over tokens (CLIP's cosine), which
    per-token normalisation refuses."""

    def wrap(fn: ScoreFn) -> ScoreFn:
        fn.extra_terms = extra_terms
        SCORERS[name] = fn
        return fn

    return wrap


def get_scorer(name: str, objective: str) -> tuple[str, ScoreFn]:
    """(resolved name, scorer); "auto" picks the scorer of the model's objective (docs/design.md §5)."""
    if name == "auto":
        name = registry.objective(objective).scorer
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; registered: {sorted(SCORERS)}")
    return name, SCORERS[name]


def caption_tokens(model, texts: list[str]) -> torch.Tensor:
    """Captions tokenised as in training: text tokens, truncated and padded to the model's max_length."""
    tokens = CaptionTokenizer(model.max_length).encode(texts)
    return torch.from_numpy(tokens).to(next(model.parameters()).device)


@register_scorer("ar", extra_terms=1)
def exact_log_likelihood(model, images, texts, samples=None, generator=None) -> torch.Tensor:
    """Autoregressive captioners: exact log p(C | V) by teacher forcing."""
    return torch.stack([autoregressive_score(model, images, caption_tokens(model, t)) for t in texts], 1)


@register_scorer("heuristic")
def heuristic_log_likelihood(model, images, texts, samples=None, generator=None) -> torch.Tensor:
    """Masked diffusion, cheap and deterministic: the pseudo-log-likelihood."""
    return torch.stack([pseudo_log_likelihood(model, images, caption_tokens(model, t)) for t in texts], 1)


@register_scorer("montecarlo")
def monte_carlo_log_likelihood(model, images, texts, samples=16, generator=None) -> torch.Tensor:
    """Masked diffusion: the ELBO from `samples` draws of (t, mask), shared by all candidates."""
    candidates = [caption_tokens(model, t) for t in texts]
    return torch.stack(monte_carlo_elbo(model, images, candidates, num_samples=samples, generator=generator), 1)


@register_scorer("clip", extra_terms=None)
def clip_cosine(model, images, texts, samples=None, generator=None) -> torch.Tensor:
    """CLIP: image–caption cosine similarity (no likelihood, but it ranks captions all the same)."""
    return cosine_scores(model, images, [caption_tokens(model, t) for t in texts])


@register_scorer("cdlm")
def denoising_score(model, images, texts, samples=16, generator=None) -> torch.Tensor:
    """CLIP-Diffusion-LM: minus the denoising loss of each caption, from `samples` draws of (t, ε)
    shared by all candidates."""
    candidates = [caption_tokens(model, t) for t in texts]
    return torch.stack(denoising_scores(model, images, candidates, samples, generator), 1)


# ------------------------------------------------------------------------------------ evaluation


def load_item_images(items: Sequence[Item], image_size: int) -> torch.Tensor:
    transform = ImageTransform(image_size)
    out = []
    for item in items:
        img = load_image(item.image)
        if item.box is not None:
            x, y, w, h = item.box
            img = img.crop((x, y, x + w, y + h))
        out.append(transform(img))
    return torch.from_numpy(np.stack(out))


def derangement(n: int, seed: int) -> list[int]:
    """A fixed permutation with no fixed point (Sattolo's algorithm: a random n-cycle); n ≥ 2."""
    rng, order = random.Random(seed), list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)
        order[i], order[j] = order[j], order[i]
    return order


def token_counts(texts: list[list[str]], max_length: int, extra_terms: int) -> torch.Tensor:
    """(B, K): the number of terms each candidate's score sums over."""
    return (
        torch.stack(
            [
                torch.from_numpy((CaptionTokenizer(max_length).encode(t) != CaptionTokenizer.pad_id).sum(1))
                for t in texts
            ],
            1,
        )
        + extra_terms
    )


@torch.no_grad()
def evaluate_compositionality(
    model,
    subsets: dict[str, list[Item]],
    score: ScoreFn,
    samples: int = 16,
    batch_size: int = 32,
    seed: int = 0,
    limit: int | None = None,
    normalize: str = "none",
) -> dict:
    """Accuracy per subset (true caption strictly best) and its blind accuracy (each item scored
    against another item's image), both with macro averages; subsets whose blind accuracy exceeds
    BLIND_BIAS_THRESHOLD are listed in `text_biased`. A subset of one item has no blind accuracy
    (None)."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    extra_terms = getattr(score, "extra_terms", None)
    if normalize == "token" and extra_terms is None:
        raise ValueError("normalize='token' needs a scorer that sums over tokens (ar, heuristic, montecarlo, cdlm)")
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)

    def wins(image_items: list[Item], texts: list[list[str]]) -> int:
        """How many of the texts' true captions win, scored against the images of `image_items`."""
        scores = score(
            model,
            load_item_images(image_items, model.image_size).to(device),
            texts,
            samples=samples,
            generator=generator,
        )
        if normalize == "token":
            scores = scores / token_counts(texts, model.max_length, extra_terms).to(scores)
        return int((scores[:, 0] > scores[:, 1:].max(dim=1).values).sum())

    accuracy, blind, counts = {}, {}, {}
    for name, items in subsets.items():
        items = items[:limit] if limit else items
        others = derangement(len(items), seed) if len(items) > 1 else None
        correct = blind_correct = 0
        for i in range(0, len(items), batch_size):
            batch = items[i : i + batch_size]
            num_captions = {len(item.captions) for item in batch}
            if len(num_captions) != 1:
                raise ValueError(f"{name}: items of one subset must have the same number of captions")
            texts = [[item.captions[k] for item in batch] for k in range(num_captions.pop())]
            correct += wins(batch, texts)
            if others is not None:
                blind_correct += wins([items[j] for j in others[i : i + batch_size]], texts)
        accuracy[name], counts[name] = correct / max(len(items), 1), len(items)
        blind[name] = blind_correct / len(items) if others is not None else None
    blind_values = [v for v in blind.values() if v is not None]
    return {
        "accuracy": accuracy,
        "blind_accuracy": blind,
        "macro_accuracy": float(np.mean(list(accuracy.values()))),
        "macro_blind_accuracy": float(np.mean(blind_values)) if blind_values else None,
        "text_biased": [name for name, v in blind.items() if v is not None and v > BLIND_BIAS_THRESHOLD],
        "normalize": normalize,
        "num_items": counts,
    }


def evaluate_shapes(
    model,
    objective: str,
    data_uri: str,
    endpoint_url: str | None = None,
    scorer: str = "auto",
    samples: int = 16,
    limit: int | None = None,
    normalize: str = "none",
    seed: int = 0,
    benchmarks: Sequence[str] = BENCHMARKS,
) -> dict:
    """ARO and SugarCrepe on the pairs `write_shapes_dataset` puts in DATA/compositionality (local
    or s3://; a bucket's copy is downloaded to a temporary folder first): one result over every
    subset, keyed BENCHMARK/SUBSET, so its macro averages span them all; the demo, `mdc compare` and
    `mdc study` all evaluate the shapes pairs here."""
    name, score = get_scorer(scorer, objective)
    source = storage.join(data_uri, COMPOSITIONALITY_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(source)
        if storage.is_s3(source):
            fs, path = storage.open_fs(source, endpoint_url)
            pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
            root = Path(tmp)
        items = {
            f"{benchmark}/{subset}": subset_items
            for benchmark in benchmarks
            for subset, subset_items in read_benchmark(benchmark, root).items()
        }
        return {
            "scorer": name,
            **evaluate_compositionality(model, items, score, samples, seed=seed, limit=limit, normalize=normalize),
        }
