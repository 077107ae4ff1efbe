"""CLIP-Diffusion-LM (docs/design.md §4): continuous Gaussian diffusion over the decoder's token embeddings,
conditioned on the image, a variant objective and sampler of the same decoder (`objective.name=cdlm`).

- x0: the caption's token embeddings, each normalised to norm √D — unit variance per dimension like
  the noise, and a fixed norm so that the MSE cannot be won by shrinking the embedding table.
- Forward process, cosine schedule ᾱ_t (Nichol & Dhariwal 2021): x_t = √ᾱ_t·x0 + √(1 − ᾱ_t)·ε.
- The decoder (bidirectional, time-conditioned: the config switches time conditioning on) reads x_t
  as its input embeddings; its final states are the prediction x̂0.
- Loss (mdc/objectives/cdlm.py): MSE(x̂0, x0) + rounding cross-entropy of the tied output layer on
  x̂0 against the tokens. Pad positions are not diffused: hidden as keys, never counted.
- Sampling (`mdc.sampling.sample_continuous`): start from noise, a few steps (5 by default) each
  predicting x̂0 and re-noising it to the next noise level, then round by argmax over the tied output
  layer; scoring (`mdc.scoring.denoising_scores`): minus the denoising loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mdc.models.captioner import Captioner

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
