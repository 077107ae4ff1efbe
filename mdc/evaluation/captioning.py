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

import dataclasses
import hashlib
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider

from mdc import registry
from mdc.data.shards import Sample
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation.probe import preprocess
from mdc.sampling import Decoding


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


LENGTH_CHOICES = ("predicted", "reference")  # beside fixed N': the length head's, the references' (an oracle)


def caption_lengths(model, objective: str, images: Sequence[CaptionImage], length, tokenizer, pixels):
    """What `registry.write_captions` takes as the length for a batch: a fixed N' (an int), the
    length head's prediction (None), or each image's median reference length in tokens (B,) — an
    upper bound, since no captioner knows it."""
    if length == "predicted":
        if getattr(model, "length_head", None) is None:
            raise ValueError(
                f"--length predicted needs a model trained with a length head (a {objective!r} model has none)"
            )
        return None
    if length == "reference":
        counts = [
            sorted(int(n) for n in (tokenizer.encode(img.references) != tokenizer.pad_id).sum(1)) for img in images
        ]
        return torch.tensor([max(1, c[(len(c) - 1) // 2]) for c in counts], device=pixels.device)
    return int(length)


def _wait_for(device: torch.device) -> None:
    """A GPU runs kernels after the call that queued them returns: the clock is read once they
    are done, or captions/s would count kernel launches (CDLM's writer syncs nowhere itself)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluate_captions(
    model,
    objective: str,
    images: Sequence[CaptionImage],
    lengths: Sequence[int | str] = (10, 15, 20),
    decoding: Decoding | None = None,
    batch_size: int = 32,
    seed: int = 0,
) -> dict:
    """BLEU-4, CIDEr-D and captions per second at each length — a fixed N', `predicted` (the length
    head's) or `reference` (each image's median reference length, an upper bound) — with every
    caption written. Autoregressive models stop at EOS: for them a length is the most tokens.

    Fixed lengths above the model's max_length cannot be written (no position embedding) and are
    listed under `skipped_lengths`, as are `predicted` and `reference` for writers of a fixed length.
    A fixed N' is written in at most N' passes (one token each): more `decoding.steps` are clamped to
    N' and the lengths listed under `clamped_steps`. Samplers that draw (continuous denoising,
    ancestral) draw from `seed`, each length afresh."""
    decoding = decoding or Decoding()
    device = next(model.parameters()).device
    max_length = model.pos_embed.shape[1] - 1
    tokenizer = CaptionTokenizer(max_length)
    references = {i: img.references for i, img in enumerate(images)}
    variable = registry.objective(objective).masked
    chosen = [
        n for n in lengths if (n in LENGTH_CHOICES and variable) or (n not in LENGTH_CHOICES and int(n) <= max_length)
    ]
    results, generated = {}, {}
    clamped = [n for n in chosen if n not in LENGTH_CHOICES and decoding.steps and decoding.steps > int(n)]
    for length in chosen:
        passes = dataclasses.replace(decoding, steps=int(length)) if length in clamped else decoding
        captions, seconds, generator = [], 0.0, torch.Generator(device).manual_seed(seed)
        for i in range(0, len(images), batch_size):
            batch = images[i : i + batch_size]
            pixels = preprocess([img.image for img in batch], model.image_size).to(device)
            n = caption_lengths(model, objective, batch, length, tokenizer, pixels)
            _wait_for(device)
            tic = time.perf_counter()
            tokens = registry.write_captions(model, pixels, objective, n, passes, generator)
            _wait_for(device)
            seconds += time.perf_counter() - tic
            captions += tokenizer.decode(tokens)
        generated[str(length)] = captions
        metrics = caption_metrics(dict(enumerate(captions)), references)
        results[str(length)] = {**metrics, "captions_per_s": len(captions) / max(seconds, 1e-9)}
    return {
        "lengths": results,
        "skipped_lengths": [n for n in lengths if n not in chosen],
        "clamped_steps": clamped,
        "sampler": registry.objective(objective).sampler or decoding.label(),
        "num_images": len(images),
        "captions": [
            {"key": img.key, "references": img.references, "generated": {n: generated[n][i] for n in generated}}
            for i, img in enumerate(images)
        ],
    }
