"""What an objective *is*, one entry each (docs/design.md §3–§5): its config (its own fields and
defaults), the model it trains, its loss, the objective its validation loss is measured with, the
scorer compositionality uses by default and the way it writes captions. Everything that used to
switch on an objective's name looks its entry up here; adding an objective is one entry and its
own modules.

The traits the config validates with (`masked`, `time`) live here too, and `mdc.config` builds
`RunConfig.objective`'s union of the entries' config classes from this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from mdc import ddcap, sampling, seeding
from mdc.models.captioner import Captioner
from mdc.models.cdlm import DiffusionLMCaptioner
from mdc.models.clip import ClipModel
from mdc.objectives.autoregressive import autoregressive_loss
from mdc.objectives.base import ObjectiveSection
from mdc.objectives.cdlm import continuous_diffusion_loss
from mdc.objectives.clip import clip_loss
from mdc.objectives.masked import masked_diffusion_loss
from mdc.objectives.sections import (
    SECTIONS,
    T_MIN,
    ArObjective,
    BertObjective,
    CappaObjective,
    CdlmObjective,
    ClipObjective,
    CmlmObjective,
    MaskedObjective,
    MdcObjective,
)

LossFn = Callable[..., tuple[torch.Tensor, dict]]  # (model, images, tokens, objective config, generator)
WriteFn = Callable[..., torch.Tensor]  # (model, images, length, sampling.Decoding) -> (B, L)

# The one yardstick of every masking objective's validation loss, whatever its training schedule or
# ratio: the masked-diffusion ELBO over t ∈ [T_MIN, 1] per non-pad token, estimated without bias.
MASKED_ELBO = MdcObjective(omega_l=T_MIN, omega_u=1.0, antithetic=True)


def _captioner(cls: type[Captioner]) -> Callable[..., nn.Module]:
    def build(cfg, tokenizer) -> nn.Module:
        m = cfg.model
        return cls(
            preset=m.preset,
            vocab_size=tokenizer.vocab_size,
            mask_id=tokenizer.mask_id,
            pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            max_length=cfg.data.max_length,
            image_size=m.image_size,
            decoder_layers=m.decoder_layers,
            time_conditioning=cfg.time_conditioned,
            concentrated_attention=m.concentrated_attention,
            predict_length=m.predict_length,
            null_image=cfg.objective.null_image,
            encoder_pos_embed=m.encoder_pos_embed,
        )

    return build


def _clip(cfg, tokenizer) -> nn.Module:
    """A contrastive dual encoder around the same ViT, its text tower as deep as the decoder."""
    return ClipModel(
        preset=cfg.model.preset,
        max_length=cfg.data.max_length,
        image_size=cfg.model.image_size,
        text_layers=cfg.model.decoder_layers,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        encoder_pos_embed=cfg.model.encoder_pos_embed,
    )


@dataclass(frozen=True)
class Objective:
    config: type[ObjectiveSection]  # its config: its own fields and defaults, a member of RunConfig.objective
    summary: str
    build: Callable[..., nn.Module]  # (RunConfig, tokenizer) -> the model it trains
    loss: LossFn
    validation: ObjectiveSection | None  # the config of the validation objective; None: its own loss
    scorer: str  # the compositionality scorer "auto" resolves to (mdc.evaluation.compositionality)
    write: WriteFn | None  # None: the model writes no captions
    sampler: str | None = None  # the caption writer's name in reports; None: the masked sampler asked for

    @property
    def name(self) -> str:
        return self.config.model_fields["name"].default

    @property
    def time(self) -> Literal["optional", "required", "never"]:
        """model.time_conditioning: optional, required, or never (no t): the config class says."""
        return self.config.time

    @property
    def masked(self) -> bool:
        """Trained on masked captions: DDCap's length head and image-free training apply."""
        return issubclass(self.config, MaskedObjective)


def _contrastive_loss(model, images, tokens, objective, generator=None):
    return clip_loss(model, images, tokens)


def _continuous_loss(model, images, tokens, objective, generator=None):
    return continuous_diffusion_loss(model, images, tokens, generator)


def _write_masked(model, images, length, decoding: sampling.Decoding, generator=None):
    """N' = `length` [MASK]s; per-image lengths (B,) as [MASK]s then pad; None: the length head's."""
    tokens = None
    if torch.is_tensor(length):
        tokens, length = ddcap.masked_captions(length, model.max_length, model.mask_id, model.pad_id), None
    return sampling.sample_masked(
        model,
        images,
        length=length,
        tokens=tokens,
        strategy=decoding.sampler,
        steps=decoding.steps,
        guidance_scale=decoding.guidance_scale,
        schedule=decoding.schedule,
        threshold=decoding.threshold,
        generator=generator,
    )


def _fixed_length(name: str, length) -> int:
    if not isinstance(length, int):
        raise ValueError(f"a {name} model writes at a fixed caption length, not {length!r}")
    return length


def _write_autoregressive(model, images, length, decoding: sampling.Decoding, generator=None):
    return sampling.generate_autoregressive(model, images, max_tokens=_fixed_length("autoregressive", length))


def _write_continuous(model, images, length, decoding: sampling.Decoding, generator=None):
    length = _fixed_length("cdlm", length)
    return sampling.sample_continuous(model, images, length, steps=decoding.steps or 5, generator=generator)


_MASKED = dict(
    build=_captioner(Captioner),
    loss=masked_diffusion_loss,
    validation=MASKED_ELBO,
    scorer="montecarlo",
    write=_write_masked,
)
_AUTOREGRESSIVE = dict(
    build=_captioner(Captioner),
    loss=autoregressive_loss,
    validation=ArObjective(),
    scorer="ar",
    write=_write_autoregressive,
    sampler="greedy-autoregressive",
)

OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective(MdcObjective, "masked diffusion captioning: the 1/t-weighted ELBO, t ~ U[ω_l, ω_u]", **_MASKED),
        Objective(CmlmObjective, 'MDC\'s "no t" ablation: same t, the weight dropped', **_MASKED),
        Objective(BertObjective, "image-conditioned BERT: a fixed mask ratio", **_MASKED),
        Objective(ArObjective, "autoregressive captioning (Cap)", **_AUTOREGRESSIVE),
        Objective(CappaObjective, "CapPa: Cap with parallel prediction", **_AUTOREGRESSIVE),
        Objective(
            ClipObjective,
            "CLIP: contrastive dual encoder",
            build=_clip,
            loss=_contrastive_loss,
            validation=None,
            scorer="clip",
            write=None,
        ),
        Objective(
            CdlmObjective,
            "CLIP-Diffusion-LM: continuous diffusion over token embeddings",
            build=_captioner(DiffusionLMCaptioner),
            loss=_continuous_loss,
            validation=None,
            scorer="cdlm",
            write=_write_continuous,
            sampler="continuous-denoising",
        ),
    )
}
MASKED_OBJECTIVES = tuple(name for name, o in OBJECTIVES.items() if o.masked)
# mdc.config builds its union from the torch-free table: the same classes, in the same order
assert {n: o.config for n, o in OBJECTIVES.items()} == SECTIONS and list(OBJECTIVES) == list(SECTIONS)


def objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; expected one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


def build_model(cfg, tokenizer, seed: int = 0) -> nn.Module:
    """The objective's model with weights drawn from `seed` alone (mdc/seeding.py): the same
    weights in any thread, whatever other threads draw meanwhile."""
    with seeding.drawing_from(seed):
        return objective(cfg.objective.name).build(cfg, tokenizer)


def compute_loss(model, images, tokens, objective_cfg, generator=None):
    """(loss, metrics) of one batch under an objective's config (mdc.config.ObjectiveConfig)."""
    return objective(objective_cfg.name).loss(model, images, tokens, objective_cfg, generator)


@torch.no_grad()
def write_captions(
    model,
    images: torch.Tensor,
    objective_name: str,
    length: int | torch.Tensor | None,
    decoding: sampling.Decoding = sampling.Decoding(),
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, L) caption tokens in the objective's own way: masked denoising (N' = `length`, or per-image
    lengths (B,), or None for the length head's), greedy decoding up to `length` tokens, or
    `decoding.steps` (default 5) rounds of continuous denoising. Samplers that draw (ancestral,
    temperature > 0, continuous denoising) draw from `generator`."""
    entry = objective(objective_name)
    if entry.write is None:
        raise ValueError(f"a {objective_name!r} model does not write captions")
    return entry.write(model, images, length, decoding, generator)
