"""The training step's small parts by hand (`mdc/training/step.py`): the warmup-cosine learning-rate
multiplier and the EMA of the weights. Fast: no model is trained here (test_overfit.py trains)."""

import math

import pytest
import torch

from mdc.training.step import EMA, build_scheduler, warmup_cosine


def test_warmup_cosine_schedule():
    assert [warmup_cosine(s, 4, 12) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine(8, 4, 12) == pytest.approx(0.5)
    assert warmup_cosine(12, 4, 12) == pytest.approx(0.0)
    assert warmup_cosine(50, 4, 12) == pytest.approx(0.0)


def test_the_scheduler_sets_the_optimisers_lr_to_the_schedule():
    """Base lr 0.2, 4 warmup steps of 12: 0.05 .. 0.2, then 0.1 (1 + cos(π (s − 4) / 8)) down to 0."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    scheduler = build_scheduler(optimizer, warmup=4, total=12)
    lrs = []
    for _ in range(13):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    cosine = [0.1 * (1 + math.cos(math.pi * (s - 4) / 8)) for s in range(4, 13)]
    assert lrs == pytest.approx([0.05, 0.1, 0.15, 0.2, *cosine])


def test_ema_is_an_exponential_moving_average():
    model = torch.nn.Linear(2, 1)
    start = model.weight.detach().clone()
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    ema.update(model)
    # two updates towards start + 1: the remaining gap is 0.9²
    torch.testing.assert_close(ema.shadow["weight"], start + 1.0 - 0.81)
