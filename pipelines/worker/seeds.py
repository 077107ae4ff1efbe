"""Every random draw of a step depends only on (seed, rank, step): a resumed run draws what it would have."""

from __future__ import annotations

import torch


def step_generator(seed: int, rank: int, step: int, device) -> torch.Generator:
    """The step's noise (t, masks)."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + rank * 10_007 + step)


def augment_seed(seed: int, rank: int, step: int) -> int:
    """The step's crops, apart from its noise."""
    return 2**40 + seed * 1_000_003 + rank * 10_007 + step
