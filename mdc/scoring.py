"""Scoring a caption by its estimated log-likelihood log p(C | V) (docs/design.md §5).

- autoregressive: exact, the sum of teacher-forced token log-probabilities (EOS included);
- masked diffusion, heuristic: pseudo-log-likelihood, each token masked alone, log-probs summed;
- masked diffusion, Monte Carlo: the ELBO E_t[(1/t) Σ_masked log p_θ(c_0^i | C_t, V)] with K draws,
  t ∈ [max(ω_l, T_MIN), ω_u] as in training. A draw that masks nothing adds 0: the estimate is
  unbiased (E[(1/t)·#masked] = N). Candidates for the same image share the draws of t and of the
  per-position uniforms deciding the mask (common random numbers), so their difference has low
  variance.
"""

from __future__ import annotations

import torch

from mdc.models.cdlm import noised
from mdc.objectives.autoregressive import autoregressive_io
from mdc.objectives.masked import T_MIN


def _token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per row of (M, V) logits: the target's logit less the logsumexp (no
    log-softmax over the whole vocabulary)."""
    return logits.gather(-1, targets[..., None])[..., 0] - logits.logsumexp(-1)


@torch.no_grad()
def autoregressive_score(model, images, tokens) -> torch.Tensor:
    inputs, targets = autoregressive_io(tokens, model.bos_id, model.eos_id, model.pad_id)
    real = targets != model.pad_id  # only these positions are projected onto the vocabulary
    logp = torch.zeros(real.shape, device=tokens.device)
    logp[real] = _token_log_probs(model(images, inputs, causal=True, where=real), targets[real])
    return logp.sum(1)


@torch.no_grad()
def pseudo_log_likelihood(model, images, tokens) -> torch.Tensor:
    """Σ_i log p(c_i | C with only c_i masked, V): L forward passes sharing one image encoding,
    each projecting only position i onto the vocabulary."""
    image_kv = model.image_keys_values(model.encode(images))
    real = tokens != model.pad_id
    total = torch.zeros(tokens.shape[0], device=tokens.device)
    for i in range(tokens.shape[1]):
        rows = real[:, i]
        if not rows.any():
            break
        noisy = tokens.clone()
        noisy[:, i] = torch.where(rows, model.mask_id, tokens[:, i])
        t = 1.0 / real.sum(1).clamp(min=1)
        column = torch.zeros_like(real)
        column[:, i] = rows
        logits = model.decode(noisy, image_kv, t=t, where=column)  # (rows with a token at i, V − 2)
        total[rows] += _token_log_probs(logits, tokens[rows, i])
    return total


@torch.no_grad()
def monte_carlo_elbo(
    model,
    images,
    candidates: list[torch.Tensor],
    num_samples: int = 16,
    omega_l: float = 0.0,
    omega_u: float = 1.0,
    common_random_numbers: bool = True,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """ELBO estimates (one (B,) tensor per candidate) from `num_samples` draws of (t, mask).

    t is stratified over the K draws (one per stratum of [max(ω_l, T_MIN), ω_u]); position i is
    masked when u_i < t. With common random numbers every candidate sees the same t and u.
    """
    omega_l = max(omega_l, T_MIN)
    image_kv = model.image_keys_values(model.encode(images))
    b, length = candidates[0].shape[0], max(c.shape[1] for c in candidates)
    device = candidates[0].device
    totals = [torch.zeros(b, device=device) for _ in candidates]

    def draw():
        strata = (
            torch.arange(num_samples, device=device)[:, None]
            + torch.rand(num_samples, b, generator=generator, device=device)
        ) / num_samples
        return (
            omega_l + (omega_u - omega_l) * strata,
            torch.rand(num_samples, b, length, generator=generator, device=device),
        )

    shared = draw() if common_random_numbers else None
    for c, tokens in enumerate(candidates):
        t_all, u_all = shared if common_random_numbers else draw()
        real = tokens != model.pad_id
        for k in range(num_samples):
            t = t_all[k]
            masked = (u_all[k, :, : tokens.shape[1]] < t[:, None]) & real
            noisy = torch.where(masked, model.mask_id, tokens)
            logp = torch.zeros(masked.shape, device=device)  # projected only where masked
            logp[masked] = _token_log_probs(model.decode(noisy, image_kv, t=t, where=masked), tokens[masked])
            totals[c] += logp.sum(1) / t
    return [total / num_samples for total in totals]


@torch.no_grad()
def cosine_scores(model, images: torch.Tensor, candidates: list[torch.Tensor]) -> torch.Tensor:
    """(B, K) image–caption cosine similarity for K candidate token tensors (B, L) each."""
    image = model.image_embedding(images)
    return torch.stack([(image * model.text_embedding(tokens)).sum(-1) for tokens in candidates], dim=1)


@torch.no_grad()
def denoising_scores(
    model,
    images: torch.Tensor,
    candidates: list[torch.Tensor],
    num_samples: int = 16,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """A likelihood proxy per candidate caption (B,): minus its denoising loss summed over its tokens,
    averaged over `num_samples` draws of (t, ε) shared by all candidates (common random numbers);
    t is stratified over the draws."""
    image_kv = model.image_keys_values(model.encode(images))
    b, length = candidates[0].shape[0], max(c.shape[1] for c in candidates)
    device = images.device
    t_all = (
        torch.arange(num_samples, device=device)[:, None]
        + torch.rand(num_samples, b, generator=generator, device=device)
    ) / num_samples
    noise_all = torch.randn(num_samples, b, length, model.dim, generator=generator, device=device)
    scores = []
    for tokens in candidates:
        real, total = tokens != model.pad_id, torch.zeros(b, device=device)
        x0 = model.embed(tokens)
        for k in range(num_samples):
            t, noise = t_all[k], noise_all[k, :, : tokens.shape[1]]
            x0_hat = model.predict_x0(tokens, image_kv, t, noised(x0, t, noise))
            mse = (x0_hat.float() - x0.float()).pow(2).mean(-1)  # float32 under bf16 compute too
            logp = torch.zeros(real.shape, device=device)  # projected only at real tokens
            logp[real] = _token_log_probs(model.project(x0_hat[real]), tokens[real])
            total -= torch.where(real, mse - logp, 0.0).sum(1)
        scores.append(total / num_samples)
    return scores
