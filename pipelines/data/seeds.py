"""Every random draw of a step depends only on (seed, step, chunk), chunk c being the c-th
micro-batch of the step's global batch, whichever rank trains it (pipelines/data/deal.py says
which): the same rows, t, masks and crops however the global batch is split (1 worker × 2
micro-batches, 2 workers × 1, 3 workers over 2 with one padding), before and after an elastic
resize, and a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import torch


def noise_generator(seed: int, step: int, chunk: int, device) -> torch.Generator:
    """The noise (t, masks) of one chunk of a step."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + chunk * 10_007 + step)


def augment_seed(seed: int, step: int, chunk: int) -> int:
    """The crops of one chunk of a step, apart from its noise."""
    return 2**40 + seed * 1_000_003 + chunk * 10_007 + step
