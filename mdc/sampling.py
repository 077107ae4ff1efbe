"""Writing captions (docs/design.md §4).

Masked diffusion: start from N' [MASK] tokens (or a partly given caption, for infilling); each
step one forward pass predicts every masked position and some positions are committed:
- `ancestral` (MDLM): going from t to s < t, each masked position is unmasked with probability
  (t − s)/t, its token drawn from p_θ;
- `confidence` (DDCap best-first): commit the k masked positions whose chosen token is most probable.
Given tokens are never changed. Autoregressive models decode greedily with a KV cache; CLIP-Diffusion-LM
denoises continuous embeddings from noise and rounds them to tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mdc import ddcap
from mdc.models.cdlm import noised

SAMPLERS = ("confidence", "ancestral")  # sample_masked's strategies
SCHEDULES = ("fixed", "linear", "cosine")  # the confidence strategy's commits per pass (`_commit_count`)


@dataclass(frozen=True)
class Decoding:
    """How a masked diffusion model writes: `sample_masked`'s strategy, passes, schedule or
    threshold, and DDCap guidance (the other objectives' writers read only `steps`)."""

    sampler: str = "confidence"
    steps: int | None = None
    schedule: str = "fixed"
    threshold: float | None = None
    guidance_scale: float = 1.0

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler {self.sampler!r}: expected {' | '.join(SAMPLERS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: expected {' | '.join(SCHEDULES)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def label(self) -> str:
        """A short name for tables and curves: `confidence`, `cosine×3`, `threshold 0.9`, ..."""
        if self.threshold is not None:
            return f"threshold {self.threshold:g}"
        name = self.sampler if self.schedule == "fixed" else self.schedule
        return (
            name
            + (f"×{self.steps}" if self.steps else "")
            + (f" s={self.guidance_scale:g}" if self.guidance_scale != 1 else "")
        )


def _choose(logits: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token per row of (M, V) logits (argmax at temperature 0, else sampled) and its probability.
    At temperature 0 the probability is exp(max − logsumexp): no softmax over the vocabulary."""
    if temperature == 0.0:
        best, token = logits.max(-1)
        return token, (best - logits.logsumexp(-1)).exp()
    probs = (logits / temperature).softmax(-1)
    token = torch.multinomial(probs, 1, generator=generator)
    return token[:, 0], probs.gather(-1, token)[:, 0]


def _commit_count(left: torch.Tensor, total: torch.Tensor, step: int, steps: int, schedule: str, per_step: int):
    """(B, 1) positions each row commits at pass `step` of `steps`, `left` (B,) of its `total` still masked."""
    if schedule == "cosine":
        stays = torch.floor(total * math.cos(math.pi / 2 * (step + 1) / steps))
        return (left - stays).clamp(min=1)[:, None]
    if schedule == "linear":  # the rest spread evenly over the passes left
        return torch.ceil(left / (steps - step)).long()[:, None]
    if schedule == "fixed":  # ⌊N'/steps⌋ a pass (at least `per_step`), the last pass the rest
        return torch.div(total, steps, rounding_mode="floor").clamp(min=per_step)[:, None]
    raise ValueError(f"unknown schedule {schedule!r} ({' | '.join(SCHEDULES)})")


def initial_tokens(model, batch_size: int, length: int, device) -> torch.Tensor:
    return torch.full((batch_size, length), model.mask_id, dtype=torch.long, device=device)


@torch.no_grad()
def sample_masked(
    model,
    images: torch.Tensor,
    length: int | None = None,
    tokens: torch.Tensor | None = None,
    strategy: str = "confidence",
    steps: int | None = None,
    tokens_per_step: int = 1,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    guidance_scale: float = 1.0,
    schedule: str = "fixed",
    threshold: float | None = None,
) -> torch.Tensor:
    """Denoise [MASK] positions of `tokens` (B, L) — or of N' = `length` fresh [MASK]s, or, for a
    model with a length head (DDCap) and no length given, of its predicted N' per image.

    `steps` defaults to ceil(masked / tokens_per_step): N' steps, one token each, as in the paper.
    `min(steps, N')` passes: the `fixed` schedule commits max(tokens_per_step, ⌊N'/steps⌋) a pass,
    and the last pass of any schedule commits every position still masked.
    Fewer passes, for the confidence strategy: `schedule="linear"` spreads the N' commits evenly
    over `steps` passes; `"cosine"` commits, by pass s of S, all but ⌊N'·cos(π/2·s/S)⌋ (MaskGIT);
    a `threshold` commits every masked position whose token is at least that probable, and at least
    the most confident one (Fast-dLLM), in ≤ N' passes.
    `guidance_scale` s ≠ 1 (a model trained image-free) mixes conditional and null-image logits,
    l_u + s·(l_c − l_u). Returns (B, L) tokens with no [MASK] left; pad positions stay pad.
    """
    if strategy != "confidence" and (schedule != "fixed" or threshold is not None):
        raise ValueError(f"schedule and threshold choose the confidence strategy's commits, not {strategy!r}'s")
    features = model.encode(images)
    if tokens is None:
        if length is not None:
            tokens = initial_tokens(model, images.shape[0], length, images.device)
        elif getattr(model, "length_head", None) is not None:
            lengths = ddcap.predicted_lengths(model.length_head(features.mean(dim=1)))
            tokens = ddcap.masked_captions(lengths, model.max_length, model.mask_id, model.pad_id)
        else:
            raise ValueError("give a caption length N' or tokens to infill (or train a length head)")
    tokens = tokens.clone()
    image_kv = model.image_keys_values(features)
    null_kv = None
    if guidance_scale != 1.0:
        if getattr(model, "null_image", None) is None:
            raise ValueError("guidance needs a model trained image-free (objective.image_free_prob > 0)")
        null_kv = model.image_keys_values(model.null_features(len(tokens)))

    def propose(tokens, masked, t):
        """A token and its probability at every masked position (elsewhere the token itself, at
        probability −1); only masked positions are projected onto the vocabulary."""
        logits = model.decode(tokens, image_kv, t=t, where=masked)
        if null_kv is not None:
            logits = ddcap.guide(logits, model.decode(tokens, null_kv, t=t, where=masked), guidance_scale)
        token, prob = _choose(logits, temperature, generator)
        proposal, conf = tokens.clone(), torch.full(tokens.shape, -1.0, device=tokens.device)
        proposal[masked], conf[masked] = token, prob.to(conf.dtype)
        return proposal, conf

    masked = tokens == model.mask_id
    total = masked.sum(1)
    if steps is None:
        steps = max(1, math.ceil(int(total.max()) / tokens_per_step))
    for step in range(steps):
        if not masked.any():
            break
        t = masked.sum(1) / total.clamp(min=1)  # fraction still masked: the current noise level
        proposal, conf = propose(tokens, masked, t)
        if strategy == "ancestral":
            t_now, t_next = 1.0 - step / steps, 1.0 - (step + 1) / steps
            u = torch.rand(tokens.shape, generator=generator, device=tokens.device)
            commit = masked & (u < (t_now - t_next) / t_now)
        elif strategy == "confidence":
            rank = conf.argsort(dim=1, descending=True).argsort(dim=1)
            if step == steps - 1:  # the last pass commits the rest: exactly `steps` passes at most
                commit = masked
            elif threshold is not None:
                commit = masked & ((conf >= threshold) | (rank == 0))
            else:
                commit = masked & (rank < _commit_count(masked.sum(1), total, step, steps, schedule, tokens_per_step))
        else:
            raise ValueError(f"unknown sampler strategy {strategy!r} ({' | '.join(SAMPLERS)})")
        tokens = torch.where(commit, proposal, tokens)
        masked = masked & ~commit
    return tokens


@torch.no_grad()
def generate_autoregressive(
    model, images: torch.Tensor, max_tokens: int | None = None, use_cache: bool = True
) -> torch.Tensor:
    """Greedy decoding. Returns (B, max_tokens) caption tokens, padded after EOS (EOS dropped)."""
    max_tokens = max_tokens or model.pos_embed.shape[1] - 1
    b, device = images.shape[0], images.device
    image_kv = model.image_keys_values(model.encode(images))
    seq = torch.full((b, 1), model.bos_id, dtype=torch.long, device=device)
    cache = [{} for _ in model.blocks] if use_cache else None
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for i in range(max_tokens):
        if use_cache:
            states = model.hidden_states(seq[:, -1:], image_kv, cache=cache, offset=i)
        else:
            states = model.hidden_states(seq, image_kv, causal=True)
        nxt = model.project(states[:, -1]).argmax(-1)  # only the last position onto the vocabulary
        nxt = torch.where(done, model.pad_id, nxt)
        done = done | (nxt == model.eos_id)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        if done.all():
            break
    out = seq[:, 1:]
    out = torch.where(out == model.eos_id, model.pad_id, out)
    return torch.nn.functional.pad(out, (0, max_tokens - out.shape[1]), value=model.pad_id)


def placeholder_tokens(batch_size: int, length: int, device) -> torch.Tensor:
    """Token ids standing for the positions being generated: never embedded (inputs come from x_t),
    only told apart from pad, so any ordinary id (0) does."""
    return torch.zeros(batch_size, length, dtype=torch.long, device=device)


@torch.no_grad()
def sample_continuous(
    model, images: torch.Tensor, length: int, steps: int = 5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(B, length) caption tokens: from noise, `steps` rounds of predict x̂0 → re-noise to the next
    level of an even grid from t = 1 to 0, then argmax rounding of the last x̂0."""
    b, device = images.shape[0], images.device
    image_kv = model.image_keys_values(model.encode(images))
    tokens = placeholder_tokens(b, length, device)
    x = torch.randn(b, length, model.dim, generator=generator, device=device)
    levels = torch.linspace(1.0, 0.0, steps + 1, device=device)
    for i in range(steps):
        x0_hat = model.predict_x0(tokens, image_kv, levels[i].expand(b), x)
        noise = torch.randn(x.shape, generator=generator, device=device)
        x = noised(x0_hat, levels[i + 1].expand(b), noise)
    return model.project(x0_hat).argmax(dim=-1)
