"""Caption quality (docs/design.md §9): write captions at N' = 10, 15, 20 and score them with BLEU-4 and CIDEr-D.

Scores come from pycocoevalcap's `Bleu(4)` and `Cider` (the latter is CIDEr-D: clipped counts and a
length penalty, as in the COCO evaluation server). COCO's PTBTokenizer needs Java, so captions are
tokenised by `normalize_caption` instead: lower case, every non-alphanumeric character (punctuation)
replaced by a space, whitespace squeezed. That matches PTB + punctuation removal on plain English
captions but not on contractions ("don't" -> "don t" instead of "do n't"), so absolute numbers can
differ slightly from the official toolkit's.

References are all captions of the same image (samples whose image bytes are identical).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider

from mdc import registry
from mdc.data.shards import Sample
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation.probe import preprocess


def normalize_caption(text: str) -> str:
    """lower case, punctuation to spaces, single spaces (our stand-in for COCO's PTBTokenizer)."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def caption_metrics(candidates: dict, references: dict) -> dict:
    """BLEU-4 and CIDEr-D of one candidate per id against that id's list of references."""
    if set(candidates) != set(references):
        raise ValueError("candidates and references must have the same ids")
    res = {k: [normalize_caption(c)] for k, c in candidates.items()}
    gts = {k: [normalize_caption(r) for r in refs] for k, refs in references.items()}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    cider, _ = Cider().compute_score(gts, res)
    return {"bleu4": float(bleu[3]), "cider": float(cider)}


@dataclass
class CaptionImage:
    key: str
    image: bytes
    references: list[str] = field(default_factory=list)


def group_by_image(samples: Iterable[Sample], limit: int | None = None) -> list[CaptionImage]:
    """One entry per distinct image (by content), with every caption of it as a reference."""
    images: dict[str, CaptionImage] = {}
    for sample in samples:
        digest = hashlib.sha1(sample.image).hexdigest()
        if digest not in images:
            if limit and len(images) >= limit:
                continue
            images[digest] = CaptionImage(sample.key, sample.image)
        images[digest].references.append(sample.caption)
    return list(images.values())


def evaluate_captions(
    model,
    objective: str,
    images: Sequence[CaptionImage],
    lengths: Sequence[int] = (10, 15, 20),
    sampler: str = "confidence",
    steps: int | None = None,
    batch_size: int = 32,
    guidance_scale: float = 1.0,
) -> dict:
    """BLEU-4, CIDEr-D and captions per second at each length N', with every caption written.

    Lengths above the model's max_length cannot be written (no position embedding) and are listed
    under `skipped_lengths`."""
    device = next(model.parameters()).device
    max_length = model.pos_embed.shape[1] - 1
    tokenizer = CaptionTokenizer(max_length)
    references = {i: img.references for i, img in enumerate(images)}
    results, generated = {}, {}
    for length in lengths:
        if length > max_length:
            continue
        captions, seconds = [], 0.0
        for i in range(0, len(images), batch_size):
            pixels = preprocess([img.image for img in images[i : i + batch_size]], model.image_size).to(device)
            tic = time.perf_counter()
            tokens = registry.write_captions(model, pixels, objective, length, sampler, steps, guidance_scale)
            seconds += time.perf_counter() - tic
            captions += tokenizer.decode(tokens)
        generated[length] = captions
        metrics = caption_metrics(dict(enumerate(captions)), references)
        results[str(length)] = {**metrics, "captions_per_s": len(captions) / max(seconds, 1e-9)}
    return {
        "lengths": results,
        "skipped_lengths": [n for n in lengths if n > max_length],
        "sampler": registry.objective(objective).sampler or sampler,
        "num_images": len(images),
        "captions": [
            {"key": img.key, "references": img.references, "generated": {str(n): generated[n][i] for n in generated}}
            for i, img in enumerate(images)
        ],
    }
