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

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from mdc import ddcap
from mdc.objectives.base import ObjectiveSection
from mdc.objectives.positions import position_nll, projected

T_MIN = 1e-3  # the smallest noise level the ELBO estimators draw (MDLM's sampling_eps)


def sample_t(
    n: int,
    omega_l: float,
    omega_u: float,
    antithetic: bool = True,
    generator: torch.Generator | None = None,
    device=None,
) -> torch.Tensor:
    """t ~ U[ω_l, ω_u]. Antithetic: one draw per stratum [i/n, (i+1)/n) of the interval, a
    low-discrepancy batch that lowers the variance of the loss estimate (MDLM)."""
    u = torch.rand(n, generator=generator, device=device)
    if antithetic:
        u = (torch.arange(n, device=device) + u) / n
    return omega_l + (omega_u - omega_l) * u


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


class MaskedObjective(ObjectiveSection, ABC):
    """The masked family: what its members differ in is how t is drawn (`noise_levels`) and how the
    per-token losses make the loss (`reduce`); this default, the mean over masked tokens, needs a
    masked token per caption, so one is forced (`force_one`)."""

    force_one: ClassVar[bool] = True
    image_free_prob: float = Field(
        0.0, ge=0.0, lt=1.0, description="DDCap: share of captions trained with the learned null image instead of V"
    )

    @property
    def null_image(self) -> bool:
        return self.image_free_prob > 0

    @abstractmethod
    def noise_levels(self, n: int, generator: torch.Generator | None, device) -> torch.Tensor:
        """(n,) masking rates t, one per caption."""

    def reduce(self, nll: torch.Tensor, t: torch.Tensor, count: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The loss of per-position NLLs (B, L) (0 where not masked): their mean over the `count`
        masked tokens (`real`: the batch's non-pad tokens)."""
        return nll.sum() / count


class _SampledT(MaskedObjective):
    """t ~ U[max(ω_l, T_MIN), ω_u] per caption, stratified by default."""

    omega_l: float = Field(0.5, ge=0.0, le=1.0, description="t's interval, low end (T_MIN at least)")
    omega_u: float = Field(1.0, ge=0.0, le=1.0, description="t's interval, high end")
    antithetic: bool = Field(True, description="one t per stratum of the interval (MDLM): a lower-variance loss")

    @model_validator(mode="after")
    def _schedule(self):
        if self.omega_l >= self.omega_u:
            raise ValueError(f"omega_l must be < omega_u, got {self.omega_l} >= {self.omega_u}")
        return self

    def noise_levels(self, n, generator, device):
        return sample_t(n, max(self.omega_l, T_MIN), self.omega_u, self.antithetic, generator, device)


class MdcObjective(_SampledT):
    """The ELBO: 1/t-weighted, normalised by non-pad tokens, nothing forced (it would bias it)."""

    name: Literal["mdc"] = "mdc"
    force_one: ClassVar[bool] = False

    def reduce(self, nll, t, count, real):
        return ((1.0 / t)[:, None] * nll).sum() / real


class CmlmObjective(_SampledT):
    """MDC's "no t" ablation: the same t, the weight dropped, the mean over masked tokens."""

    name: Literal["cmlm"] = "cmlm"


class BertObjective(MaskedObjective):
    """Image-conditioned BERT: a fixed ratio instead of a sampled t, the mean over masked tokens."""

    name: Literal["bert"] = "bert"
    mask_ratio: float = Field(0.15, gt=0.0, le=1.0, description="the share of tokens masked")

    def noise_levels(self, n, generator, device):
        return torch.full((n,), float(self.mask_ratio), device=device)


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
