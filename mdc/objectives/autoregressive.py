"""The autoregressive objectives (docs/design.md §3): captioning by next-token prediction (Cap) and CapPa, which
trains part of the captions by parallel prediction from all-[MASK] inputs.

`tokens` is a (B, L) tensor of caption tokens padded with `pad_id` on the right, without BOS/EOS:
teacher forcing adds them here.
"""

from __future__ import annotations

import torch

from mdc.objectives.positions import position_nll, projected
from mdc.objectives.sections import ArObjective, CappaObjective  # torch-free; re-exported here

__all__ = ["ArObjective", "CappaObjective", "autoregressive_io", "autoregressive_loss"]


def autoregressive_io(tokens: torch.Tensor, bos_id: int, eos_id: int, pad_id: int):
    """Teacher forcing: inputs [BOS, c_1..c_n, pad..] → targets [c_1..c_n, EOS, pad..]; (B, L+1)."""
    b = tokens.shape[0]
    pad_col = torch.full((b, 1), pad_id, dtype=tokens.dtype, device=tokens.device)
    inputs = torch.cat([torch.full_like(pad_col, bos_id), tokens], dim=1)
    targets = torch.cat([tokens, pad_col], dim=1)
    lengths = (tokens != pad_id).sum(dim=1)
    targets[torch.arange(b, device=tokens.device), lengths] = eos_id
    return inputs, targets


def autoregressive_loss(model, images, tokens, objective: ArObjective | CappaObjective, generator=None):
    """Cap and CapPa: per example, with probability `objective.parallel_prob` (Cap: 0), the input
    is [MASK] at every position, pads included, and attention is bidirectional (parallel prediction,
    as big_vision's CapPa): with no pad to hide, the input does not reveal the caption's length. The
    loss counts the caption tokens and EOS either way."""
    inputs, targets = autoregressive_io(tokens, model.bos_id, model.eos_id, model.pad_id)
    parallel = torch.rand(tokens.shape[0], generator=generator, device=tokens.device) < objective.parallel_prob
    real = targets != model.pad_id
    inputs = torch.where(parallel[:, None], model.mask_id, inputs)
    logits = model(images, inputs, causal=~parallel, where=projected(real))
    loss = position_nll(logits, targets, real).sum() / real.sum()
    return loss, {"parallel_fraction": parallel.float().mean()}
