"""Caption infilling (DDCap's evaluation): a contiguous span of each image's first reference caption
is replaced by [MASK], the masked sampler fills it (the given tokens stay fixed), and the filled
captions are scored with BLEU-4 and CIDEr-D against all references of the image — the infilled
one included, as in DDCap, so the numbers sit far above free captioning (docs/design.md §10: CIDEr 230.3).

Only masked-diffusion models infill: autoregressive decoding cannot condition on the right context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation.captioning import CaptionImage, caption_metrics
from mdc.evaluation.probe import preprocess
from mdc.registry import MASKED_OBJECTIVES
from mdc.sampling import sample_masked


def mask_span(
    tokens: torch.Tensor, ratio: float, mask_id: int, pad_id: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Per row, max(1, round(ratio·N)) consecutive non-pad tokens set to [MASK], at a uniformly drawn start."""
    lengths = (tokens != pad_id).sum(dim=1)
    spans = (lengths.float() * ratio).round().long().clamp(min=1).minimum(lengths)
    u = torch.rand(len(tokens), generator=generator, device=tokens.device)
    starts = (u * (lengths - spans + 1)).long()
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
    span = (positions >= starts[:, None]) & (positions < (starts + spans)[:, None])
    return torch.where(span, mask_id, tokens)


@torch.no_grad()
def evaluate_infilling(
    model,
    objective: str,
    images: Sequence[CaptionImage],
    ratio: float = 0.3,
    sampler: str = "confidence",
    batch_size: int = 32,
    seed: int = 0,
) -> dict:
    """BLEU-4 and CIDEr-D of the filled captions, with every masked and filled caption."""
    if objective not in MASKED_OBJECTIVES:
        raise ValueError(f"infilling needs a masked diffusion model {MASKED_OBJECTIVES}, not {objective!r}")
    device = next(model.parameters()).device
    tokenizer = CaptionTokenizer(model.max_length)
    generator = torch.Generator(device).manual_seed(seed)
    filled, masked_texts = [], []
    for i in range(0, len(images), batch_size):
        batch = images[i : i + batch_size]
        tokens = torch.from_numpy(tokenizer.encode([img.references[0] for img in batch])).to(device)
        masked = mask_span(tokens, ratio, model.mask_id, model.pad_id, generator)
        pixels = preprocess([img.image for img in batch], model.image_size).to(device)
        filled += tokenizer.decode(sample_masked(model, pixels, tokens=masked, strategy=sampler))
        masked_texts += [_with_blank(row, model.mask_id, tokenizer) for row in masked.cpu()]
    metrics = caption_metrics(dict(enumerate(filled)), {i: img.references for i, img in enumerate(images)})
    return {
        **metrics,
        "span_ratio": ratio,
        "sampler": sampler,
        "num_images": len(images),
        "captions": [
            {"key": img.key, "masked": m, "filled": f, "references": img.references}
            for img, m, f in zip(images, masked_texts, filled)
        ],
    }


def _with_blank(row: torch.Tensor, mask_id: int, tokenizer: CaptionTokenizer) -> str:
    """The masked caption for display, its span written as "___"."""
    span = torch.nonzero(row == mask_id)[:, 0]
    start, end = int(span[0]), int(span[-1]) + 1
    parts = [tokenizer.decode(row[None, :start])[0], "___", tokenizer.decode(row[None, end:])[0]]
    return " ".join(p for p in parts if p)
