"""Optimiser, learning-rate schedule, EMA and one training step — shared by every trainer."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mdc.registry import compute_loss


def build_optimizer(model: nn.Module, optim) -> torch.optim.AdamW:
    """AdamW; biases, norms, embeddings' positions and other 1-D parameters are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2))


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """Multiplier of the base lr: linear warmup to 1, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total))


class EMA:
    """Exponential moving average of the parameters (kept in float32, same sharding as the model)."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.shadow = {n: p.detach().clone().float() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for n, p in model.named_parameters():
            self.shadow[n].lerp_(p.detach().float(), 1.0 - self.decay)

    def state_dict(self) -> dict:
        return dict(self.shadow)

    def load_state_dict(self, state: dict) -> None:
        for n, v in state.items():
            self.shadow[n].copy_(v)


def train_step(*args, **kwargs) -> dict:
    """`device_step` (the same arguments) with its metrics read back as floats: for callers that
    look at every step (tests, benchmarks); each read is a host sync."""
    return {k: float(as_plain(v)) for k, v in device_step(*args, **kwargs).items()}


def as_plain(value):
    """A DTensor metric (FSDP2's grad norm) as a plain tensor; a collective for a sharded one."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def device_step(
    model,
    optimizer,
    scheduler,
    images,
    tokens,
    objective,
    grad_clip: float,
    *,
    generator=None,
    ema: EMA | None = None,
    micro_batches: int = 1,
    weights: list[float] | None = None,
) -> dict:
    """Forward, backward, clip, step. Returns the metrics (loss, grad_norm, ...) as tensors on the
    device, so a step forces no host sync, and lr as a float (the scheduler's, on the host).

    With `micro_batches` > 1 the batch is split into that many equal micro-batches whose gradients
    accumulate before the one optimiser step: each micro-batch's loss (and metrics) are weighted
    `weights[i]`, by default 1/their number, so the step is the full batch's step when every
    micro-batch has the same loss normaliser (e.g. as many caption tokens). A worker whose share
    of the global batch is short pads it with micro-batches of weight 0 (pipelines/data/deal.py). An FSDP2 model reduces gradients across ranks, and frees its
    gathered parameters after backward, only on the last micro-batch: the others reuse the
    parameters the first one gathered (one all-gather per step, not one per micro-batch). Noise
    draws come from `generator`, in micro-batch order, or from a list of one generator per
    micro-batch (the worker's, pipelines/data/seeds.py)."""
    if images.shape[0] % micro_batches:
        raise ValueError(f"a batch of {images.shape[0]} does not split into {micro_batches} micro-batches")
    fsdp = isinstance(model, FSDPModule)
    optimizer.zero_grad(set_to_none=True)
    totals: dict = {}
    generators = generator if isinstance(generator, (list, tuple)) else [generator] * micro_batches
    weights = weights or [1.0 / micro_batches] * micro_batches
    for i, (imgs, toks) in enumerate(zip(images.chunk(micro_batches), tokens.chunk(micro_batches))):
        if fsdp:
            last = i == micro_batches - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        loss, metrics = compute_loss(model, imgs, toks, objective, generators[i])
        (loss * weights[i]).backward()
        for key, value in {"loss": loss.detach(), **metrics}.items():
            totals[key] = totals.get(key, 0.0) + value * weights[i]
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    if ema is not None:
        ema.update(model)
    return {**totals, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0]}
