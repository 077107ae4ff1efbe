"""The continuous-diffusion objective of CLIP-Diffusion-LM (docs/design.md §4), on a
`mdc.models.cdlm.DiffusionLMCaptioner`: MSE(x̂0, x0) + the rounding cross-entropy, t ~ U[0, 1]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mdc.objectives.sections import CdlmObjective  # torch-free; re-exported here

__all__ = ["CdlmObjective", "continuous_diffusion_loss"]


def continuous_diffusion_loss(model, images, tokens, generator=None):
    """MSE(x̂0, x0) per dimension + rounding cross-entropy, t ~ U[0, 1] per caption."""
    t = torch.rand(tokens.shape[0], generator=generator, device=tokens.device)
    noise = torch.randn(*tokens.shape, model.dim, generator=generator, device=tokens.device)
    x0_hat, x0, logits = model.denoise(images, tokens, t, noise)
    mse = (x0_hat.float() - x0.float()).pow(2).mean()  # float32 under bf16 compute too
    rounding = F.cross_entropy(logits, tokens[tokens != model.pad_id])
    return mse + rounding, {"mse": mse.detach(), "rounding_ce": rounding.detach()}
