"""Every random draw of a step depends only on (seed, step, chunk), chunk c being the c-th
micro-batch of the step's global batch. Ingest deals the global order's micro-batch blocks to the W
ranks in turn (pipelines/ingest.py), so rank r's j-th micro-batch of a step is chunk r + jW: the
same rows, t, masks and crops whichever rank trains a chunk and however the global batch is split
(1 worker × 2 micro-batches or 2 workers × 1, before and after an elastic resize), and a resumed
run draws what the uninterrupted one would have."""

from __future__ import annotations

import torch


def rank_chunks(rank: int, world_size: int, accumulation: int) -> range:
    """The places in the global batch of this rank's micro-batches, in the order it trains them."""
    return range(rank, world_size * accumulation, world_size)


def noise_generator(seed: int, step: int, chunk: int, device) -> torch.Generator:
    """The noise (t, masks) of one chunk of a step."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + chunk * 10_007 + step)


def augment_seed(seed: int, step: int, chunk: int) -> int:
    """The crops of one chunk of a step, apart from its noise."""
    return 2**40 + seed * 1_000_003 + chunk * 10_007 + step
