"""Choosing MDC's noise interval [ω_l, ω_u] by the variance of its training-loss estimator (BD3-LM,
Arriola et al. 2025, choose their clipped interval so, instead of a sweep of trainings).

The estimator is the training loss exactly as `masked_diffusion_loss` computes it: a batch of
captions, t ~ U[max(ω_l, T_MIN), ω_u] per caption (stratified when the objective is), each token
masked with probability t, (1/t)-weighted masked NLL over the batch's non-pad tokens. Every draw
resamples the batch and the masks with its own seed; the same seeds serve every interval (common
random numbers), so the intervals' ratios are estimated paired.

What is compared: the *relative* variance, Var / mean² for the loss and tr Cov(g) / ||E g||² for
the gradient (on a fixed random subset of its coordinates). The intervals' estimators have
different means, E_t[mean per-token NLL at noise t] over each interval, so raw variances would
favour an interval whose loss is merely smaller; the relative variance is the number of draws
needed for a given relative precision of the loss, and for the gradient the noise-to-signal ratio
of an SGD step.

Closed form (a model whose every per-token loss is c): given t, the estimate is c·K/(N·t) with
K ~ Bin(N, t), so E = c and Var = c²·E[(1 − t)/t]/N = c²·(ln(ω_u/ω_l)/(ω_u − ω_l) − 1)/N for
N non-pad tokens in the batch (stratified draws of equal-length captions give the same figure).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mdc.objectives.masked import T_MIN, MdcObjective, masked_diffusion_loss

BD3LM_NOTE = (
    "BD3-LM (Arriola et al., ICLR 2025) picks its clipped interval the same way: the candidate whose "
    "NELBO estimate has the least variance over seeded draws (their `var_min`), not a sweep of trainings"
)


def closed_form_relative_variance(omega_l: float, omega_u: float, tokens: int) -> float:
    """Var / mean² of the estimator for a constant per-token loss and `tokens` non-pad tokens."""
    a = max(omega_l, T_MIN)
    return (math.log(omega_u / a) / (omega_u - a) - 1.0) / tokens


def grid(step: float, low: float = 0.0, high: float = 1.0) -> list[tuple[float, float]]:
    """Every [ω_l, ω_u] with ω_l < ω_u on the grid low, low + step, ..., high."""
    n = round((high - low) / step)
    if n < 1 or not math.isclose(low + n * step, high, abs_tol=1e-9):
        raise ValueError(f"step {step} does not divide [{low}, {high}] into whole steps")
    points = [round(low + i * step, 6) for i in range(n + 1)]
    return [(a, b) for a in points for b in points if a < b]


def gradient_coordinates(model: torch.nn.Module, k: int, seed: int) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """k coordinates of the model's trainable parameters drawn uniformly with a fixed seed: a cheap,
    unbiased sketch of the gradient's total variance and squared norm (both sums over coordinates)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = torch.tensor([p.numel() for p in params])
    total = int(sizes.sum())
    picks = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: min(k, total)].sort().values
    starts = torch.cumsum(sizes, 0) - sizes
    out = []
    for i, p in enumerate(params):
        local = picks[(picks >= starts[i]) & (picks < starts[i] + sizes[i])] - starts[i]
        if len(local):
            out.append((p, local))
    return out


@dataclass
class Draws:
    loss: np.ndarray  # (draws,)
    grad: np.ndarray | None  # (draws, k) gradient coordinates, or None


def draw_estimates(
    model: torch.nn.Module,
    images: torch.Tensor,
    tokens: torch.Tensor,
    interval: tuple[float, float],
    draws: int,
    batch_size: int,
    seed: int = 0,
    antithetic: bool = True,
    coordinates: Sequence[tuple[torch.nn.Parameter, torch.Tensor]] | None = None,
) -> Draws:
    """`draws` seeded estimates of the training loss (and gradient coordinates) under one interval.
    Draw d uses the same batch (rows of images/tokens) and the same random stream for every interval."""
    objective = MdcObjective(omega_l=interval[0], omega_u=interval[1], antithetic=antithetic)
    losses, grads = [], []
    for d in range(draws):
        rows = torch.randint(len(tokens), (batch_size,), generator=torch.Generator().manual_seed(seed * 100_003 + d))
        generator = torch.Generator(device=tokens.device).manual_seed(seed * 100_003 + d + 7_919)
        with torch.set_grad_enabled(coordinates is not None):
            loss, _ = masked_diffusion_loss(model, images[rows], tokens[rows], objective, generator)
        losses.append(loss.detach().item())
        if coordinates is not None:
            model.zero_grad(set_to_none=True)
            loss.backward()
            grads.append(
                torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).view(-1)[i] for p, i in coordinates])
            )
    grad = torch.stack(grads).double().cpu().numpy() if grads else None
    return Draws(np.asarray(losses, dtype=np.float64), grad)


def relative_variance(x: np.ndarray) -> float:
    """tr Cov / ||mean||² of draws x (n,) or (n, k); the squared mean corrected by tr Cov / n, so
    that it estimates ||E x||² without the noise's share."""
    x = x.reshape(len(x), -1)
    var = x.var(axis=0, ddof=1).sum()
    signal = (x.mean(axis=0) ** 2).sum() - var / len(x)
    return float(var / signal) if signal > 0 else math.inf


def bootstrap(
    samples: dict[tuple[float, float], np.ndarray], resamples: int = 400, seed: int = 0, level: float = 0.95
) -> tuple[dict, dict]:
    """Percentile intervals of each interval's relative variance, the draws resampled together for
    every interval (paired, as the draws share seeds); also returns the resampled values."""
    n = len(next(iter(samples.values())))
    rng = np.random.default_rng(seed)
    index = rng.integers(0, n, size=(resamples, n))
    boot = {key: np.array([relative_variance(x[i]) for i in index]) for key, x in samples.items()}
    q = [(1 - level) / 2, (1 + level) / 2]
    return {key: tuple(np.quantile(v, q)) for key, v in boot.items()}, boot


def ratio_interval(boot: dict, num: tuple[float, float], den: tuple[float, float], level: float = 0.95) -> tuple:
    """Percentile interval of relative_variance(num) / relative_variance(den) over paired resamples."""
    r = boot[num] / boot[den]
    return tuple(np.quantile(r, [(1 - level) / 2, (1 + level) / 2]))
