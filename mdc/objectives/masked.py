"""The masked objectives (docs/design.md §3): MDC, its "no t" ablation CMLM and image-conditioned BERT.

`tokens` everywhere is a (B, L) tensor of caption tokens padded with `pad_id` on the right (no BOS/
EOS: the autoregressive objectives, mdc/objectives/autoregressive.py, add them). Pad positions are never masked, never predicted and
never counted.

MDC with the linear schedule α_t = 1 − t: a token is masked with probability t, and the MDLM weight
α_t'/(1 − α_t) = −1/t turns the ELBO into  (1/t) · Σ_masked −log p_θ(c_0^i | C_t, V),
normalised by the number of non-pad tokens in the batch. The estimate is unbiased because
E[(1/t) · #masked] = N for every t > 0: a caption whose draw masks nothing contributes 0 (MDLM), and
nothing is ever forced. t is drawn from [max(ω_l, T_MIN), ω_u] (MDLM's sampling ε): the 1/t weight
has unbounded variance as t → 0, and the interval below ε holds a share ε of the integral.
"""

from __future__ import annotations

import torch

from mdc import ddcap
from mdc.objectives.noise import sample_t
from mdc.objectives.positions import position_nll, projected
from mdc.objectives.sections import (  # the config classes, torch-free; re-exported here
    T_MIN,
    BertObjective,
    CmlmObjective,
    MaskedObjective,
    MdcObjective,
)

__all__ = [
    "T_MIN",
    "BertObjective",
    "CmlmObjective",
    "MaskedObjective",
    "MdcObjective",
    "sample_t",
    "mask_tokens",
    "masked_diffusion_loss",
]


def mask_tokens(
    tokens: torch.Tensor,
    t: torch.Tensor,
    mask_id: int,
    pad_id: int,
    generator: torch.Generator | None = None,
    force_one: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask each non-pad token independently with probability t (per row). With `force_one` a row
    left with no masked token gets one at a random non-pad position — for the objectives that
    average over masked tokens (CMLM, BERT), never for the 1/t-weighted ELBO, which it would bias."""
    real = tokens != pad_id
    u = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    masked = (u < t[:, None]) & real
    if force_one:  # fixed shapes, no `if empty.any()`: a branch on a device value waits for the device
        empty = ~masked.any(dim=1) & real.any(dim=1)
        pick = torch.where(real, u, torch.inf).argmin(dim=1)  # a uniformly random real position
        masked = masked | ((torch.arange(tokens.shape[1], device=tokens.device) == pick[:, None]) & empty[:, None])
    return torch.where(masked, mask_id, tokens), masked


def masked_diffusion_loss(model, images, tokens, objective: MaskedObjective, generator=None):
    """(loss, metrics) of one batch under a masked objective's config, which draws t and reduces the
    per-token losses. DDCap switches (mdc/ddcap.py): with `image_free_prob` that share of captions
    is trained against the learned null image; a model with a length head adds the length
    cross-entropy."""
    b = tokens.shape[0]
    t = objective.noise_levels(b, generator, tokens.device)
    noisy, masked = mask_tokens(tokens, t, model.mask_id, model.pad_id, generator, force_one=objective.force_one)
    ddcap_options = {}
    if objective.image_free_prob > 0:
        ddcap_options["image_free"] = (
            torch.rand(b, generator=generator, device=tokens.device) < objective.image_free_prob
        )
    if getattr(model, "length_head", None) is not None:
        ddcap_options["return_length"] = True
    out = model(images, noisy, t=t, causal=False, where=projected(masked), **ddcap_options)
    logits, length_logits = out if "return_length" in ddcap_options else (out, None)
    nll = position_nll(logits, tokens, masked)  # (B, L), 0 where not masked
    count, real = masked.sum(), (tokens != model.pad_id).sum()
    loss = objective.reduce(nll, t, count, real)
    metrics = {
        "masked_fraction": count / real,
        "nll_masked": nll.detach().sum() / count.clamp(min=1),
    }
    if length_logits is not None:
        length_ce = ddcap.length_loss(length_logits.float(), tokens, model.pad_id)  # float32 CE under bf16
        loss = loss + length_ce
        metrics["length_ce"] = length_ce.detach()
    if "image_free" in ddcap_options:
        metrics["image_free_fraction"] = ddcap_options["image_free"].float().mean()
    return loss, metrics
