"""CLIP-Diffusion-LM (SPEC §4): continuous Gaussian diffusion over the decoder's token embeddings,
conditioned on the image, a variant objective and sampler of the same decoder (`objective.name=cdlm`).

- x0: the caption's token embeddings, each normalised to norm √D — unit variance per dimension like
  the noise, and a fixed norm so that the MSE cannot be won by shrinking the embedding table.
- Forward process, cosine schedule ᾱ_t (Nichol & Dhariwal 2021): x_t = √ᾱ_t·x0 + √(1 − ᾱ_t)·ε.
- The decoder (bidirectional, time-conditioned: the config switches time conditioning on) reads x_t
  as its input embeddings; its final states are the prediction x̂0.
- Loss: MSE(x̂0, x0) + rounding cross-entropy of the tied output layer on x̂0 against the tokens.
  Pad positions are not diffused: hidden as keys, never counted.
- Sampling: start from noise, a few steps (5 by default) each predicting x̂0 and re-noising it to the
  next noise level, then round by argmax over the tied output layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mdc.model import Captioner

COSINE_OFFSET = 0.008  # s of the cosine schedule: keeps ᾱ_t from dropping too fast near t = 0


def alpha_bar(t: torch.Tensor) -> torch.Tensor:
    """ᾱ_t = f(t)/f(0), f(t) = cos²((t + s)/(1 + s)·π/2): 1 at t = 0, 0 at t = 1."""
    def f(x):
        return torch.cos((x + COSINE_OFFSET) / (1 + COSINE_OFFSET) * math.pi / 2) ** 2

    return (f(t.float()) / f(torch.zeros((), device=t.device))).clamp(0.0, 1.0)


def noised(x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_t = √ᾱ_t·x0 + √(1 − ᾱ_t)·ε, with t (B,)."""
    ab = alpha_bar(t)[:, None, None]
    return ab.sqrt() * x0 + (1 - ab).sqrt() * noise


class DiffusionLMCaptioner(Captioner):
    """The captioner with a denoising entry point. `denoise` touches the root parameters (the token
    embedding) outside `forward`, so `apply_fsdp` registers it as an FSDP forward method."""

    fsdp_forward_methods = ("denoise",)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """x0: token embeddings scaled to norm √D."""
        return F.normalize(self.token_embed(tokens), dim=-1) * math.sqrt(self.dim)

    def predict_x0(self, tokens, image, t, x_t) -> torch.Tensor:
        """x̂0 (B, L, D) from x_t; `tokens` only mark the pad positions (hidden keys)."""
        return self.hidden_states(tokens, image, t=t, inputs_embeds=x_t)

    def denoise(self, images, tokens, t, noise):
        """(x̂0, x0, rounding logits) at the non-pad positions (M, ·), for the training loss."""
        real = tokens != self.pad_id
        x0 = self.embed(tokens)
        x0_hat = self.predict_x0(tokens, self.encode(images), t, noised(x0, t, noise))[real]
        return x0_hat, x0[real], self.project(x0_hat)


def continuous_diffusion_loss(model, images, tokens, generator=None):
    """MSE(x̂0, x0) per dimension + rounding cross-entropy, t ~ U[0, 1] per caption."""
    t = torch.rand(tokens.shape[0], generator=generator, device=tokens.device)
    noise = torch.randn(*tokens.shape, model.dim, generator=generator, device=tokens.device)
    x0_hat, x0, logits = model.denoise(images, tokens, t, noise)
    mse = (x0_hat - x0).pow(2).mean()
    rounding = F.cross_entropy(logits, tokens[tokens != model.pad_id])
    return mse + rounding, {"mse": mse.detach(), "rounding_ce": rounding.detach()}


def placeholder_tokens(batch_size: int, length: int, device) -> torch.Tensor:
    """Token ids standing for the positions being generated: never embedded (inputs come from x_t),
    only told apart from pad, so any ordinary id (0) does."""
    return torch.zeros(batch_size, length, dtype=torch.long, device=device)


@torch.no_grad()
def sample_continuous(model, images: torch.Tensor, length: int, steps: int = 5,
                      generator: torch.Generator | None = None) -> torch.Tensor:
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


@torch.no_grad()
def denoising_scores(model, images: torch.Tensor, candidates: list[torch.Tensor], num_samples: int = 16,
                     generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """A likelihood proxy per candidate caption (B,): minus its denoising loss summed over its tokens,
    averaged over `num_samples` draws of (t, ε) shared by all candidates (common random numbers);
    t is stratified over the draws."""
    image_kv = model.image_keys_values(model.encode(images))
    b, length = candidates[0].shape[0], max(c.shape[1] for c in candidates)
    device = images.device
    t_all = (torch.arange(num_samples, device=device)[:, None]
             + torch.rand(num_samples, b, generator=generator, device=device)) / num_samples
    noise_all = torch.randn(num_samples, b, length, model.dim, generator=generator, device=device)
    scores = []
    for tokens in candidates:
        real, total = tokens != model.pad_id, torch.zeros(b, device=device)
        x0 = model.embed(tokens)
        for k in range(num_samples):
            t, noise = t_all[k], noise_all[k, :, :tokens.shape[1]]
            x0_hat = model.predict_x0(tokens, image_kv, t, noised(x0, t, noise))
            mse = (x0_hat - x0).pow(2).mean(-1)
            logp = model.project(x0_hat).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
            total -= torch.where(real, mse - logp, 0.0).sum(1)
        scores.append(total / num_samples)
    return scores
