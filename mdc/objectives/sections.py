"""Every objective's config class, without torch: `mdc.config` builds `RunConfig.objective`'s union
from `SECTIONS`, so a config loads and its errors answer in well under a second (`mdc --help`,
`mdc train train.stpes=3`). The losses live beside their math (masked.py, autoregressive.py, ...),
which re-export these classes; the registry (mdc/registry.py) pairs each with its model and loss.

A method that needs torch imports it when called: only a training or evaluation process calls one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from mdc.objectives.base import ObjectiveSection

T_MIN = 1e-3  # the smallest noise level the ELBO estimators draw (MDLM's sampling_eps)
TimeUse = Literal["optional", "required", "never"]  # model.time_conditioning; never: no t


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
    def noise_levels(self, n: int, generator, device):
        """(n,) masking rates t, one per caption."""

    def reduce(self, nll, t, count, real):
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
        from mdc.objectives.noise import sample_t  # torch: only where a loss is computed

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
        import torch  # only where a loss is computed

        return torch.full((n,), float(self.mask_ratio), device=device)


class ArObjective(ObjectiveSection):
    """Cap: next-token prediction only, no parallel rows."""

    name: Literal["ar"] = "ar"
    parallel_prob: ClassVar[float] = 0.0
    time: ClassVar[TimeUse] = "never"


class CappaObjective(ObjectiveSection):
    name: Literal["cappa"] = "cappa"
    parallel_prob: float = Field(
        0.75, ge=0.0, le=1.0, description="share of captions trained by parallel prediction from all-[MASK] inputs"
    )
    time: ClassVar[TimeUse] = "never"


class ClipObjective(ObjectiveSection):
    """CLIP has no setting of its own."""

    name: Literal["clip"] = "clip"


class CdlmObjective(ObjectiveSection):
    """CLIP-Diffusion-LM has no setting of its own: t ~ U[0, 1]."""

    name: Literal["cdlm"] = "cdlm"
    time: ClassVar[TimeUse] = "required"


# The objectives in the registry's order (mdc/registry.py checks it): name -> config class.
SECTIONS: dict[str, type[ObjectiveSection]] = {
    cls.model_fields["name"].default: cls
    for cls in (MdcObjective, CmlmObjective, BertObjective, ArObjective, CappaObjective, ClipObjective, CdlmObjective)
}
MASKED_OBJECTIVES = tuple(name for name, cls in SECTIONS.items() if issubclass(cls, MaskedObjective))
