"""Draw keys are hashes of (seed, purpose, step, chunk): no two steps, chunks or purposes share one."""

from __future__ import annotations

import numpy as np
import torch

from pipelines.data.seeds import CROP, NOISE, VALIDATION, augment_seed, key, noise_generator


def test_no_two_step_chunk_pairs_share_a_key():
    # Every pair of the first 10,100 steps × 8 chunks (the old linear key repeated (step 10,008,
    # chunk 0) as (step 1, chunk 1) inside this grid), then 50,000 pairs sampled from the range of
    # cluster/configs/pretrain.yaml (100k steps × 64 chunks), where the linear key repeated 88.6%.
    grid = {key(0, NOISE, step, chunk) for step in range(10_100) for chunk in range(8)}
    assert len(grid) == 10_100 * 8
    rng = np.random.default_rng(0)
    pairs = {(int(s), int(c)) for s, c in zip(rng.integers(0, 100_000, 50_000), rng.integers(0, 64, 50_000))}
    sampled = {key(0, NOISE, s, c) for s, c in pairs}
    assert len(sampled) == len(pairs)


def test_purposes_seeds_and_signs_are_apart():
    keys = [key(0, NOISE, 1, 1), key(0, CROP, 1, 1), key(0, VALIDATION, 1, 1), key(1, NOISE, 1, 1)]
    keys += [key(-1, NOISE, 1, 1), key(0, NOISE, -1, 1), key(0, NOISE, 1, 0), key(0, NOISE, 10_008, 0)]
    assert len(set(keys)) == len(keys)
    assert augment_seed(0, 1, 1) == key(0, CROP, 1, 1) != key(0, NOISE, 1, 1)


def test_the_same_tuple_draws_the_same_noise():
    first = torch.rand(4, generator=noise_generator(3, 10_008, 0, "cpu"))
    assert torch.equal(first, torch.rand(4, generator=noise_generator(3, 10_008, 0, "cpu")))
    assert not torch.equal(first, torch.rand(4, generator=noise_generator(3, 1, 1, "cpu")))
