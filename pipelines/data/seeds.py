"""Every random draw of a step depends only on (seed, step, chunk), chunk c being the c-th
micro-batch of the step's global batch, whichever rank trains it (pipelines/data/deal.py says
which): the same rows, t, masks and crops however the global batch is split (1 worker × 2
micro-batches, 2 workers × 1, 3 workers over 2 with one padding), before and after an elastic
resize, and a resumed run draws what the uninterrupted one would have.

The key of a draw is NumPy's `SeedSequence` hash of the tuple (seed, purpose, step, chunk), not a
linear mix of them: a linear key (seed·1,000,003 + chunk·10,007 + step) gave (step 10,008, chunk 0)
the draws of (step 1, chunk 1). Distinct tuples give distinct 64-bit keys (tests/test_seeds.py
checks every pair of 10,100 steps × 8 chunks and 50,000 pairs drawn from 100k steps × 64 chunks)."""

from __future__ import annotations

import numpy as np
import torch

NOISE, CROP, VALIDATION = 0, 1, 2  # what a key draws: a purpose apart from the others


def key(seed: int, purpose: int, step: int, chunk: int) -> int:
    """A 64-bit seed hashed from the tuple; a negative seed or step is its own entropy word."""
    words = [purpose, int(seed < 0), abs(seed), int(step < 0), abs(step), chunk]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])


def noise_generator(seed: int, step: int, chunk: int, device) -> torch.Generator:
    """The noise (t, masks) of one chunk of a step."""
    return torch.Generator(device).manual_seed(key(seed, NOISE, step, chunk))


def validation_generator(seed: int, batch: int, device) -> torch.Generator:
    """The fixed noise of the `batch`-th validation batch, the same at every validation."""
    return torch.Generator(device).manual_seed(key(seed, VALIDATION, 0, batch))


def augment_seed(seed: int, step: int, chunk: int) -> int:
    """The crops of one chunk of a step, apart from its noise."""
    return key(seed, CROP, step, chunk)
