"""CLIP baseline (docs/design.md §3): a contrastive image–text dual encoder with open_clip's text transformer
and loss around the captioner's own timm ViT, so that probes compare the same encoder trained by
different objectives.

- Image: the encoder's patch features, mean-pooled as the probes pool them (`encode_image`), then a
  linear projection into the joint space.
- Text: open_clip's causal `TextTransformer` over [BOS, caption, EOS, 0...], pooled at EOS by CLIP's
  argmax-id rule (EOS has the highest id of CLIP's 49,408), as wide and deep as the captioner's decoder.
- Loss (mdc/objectives/clip.py): open_clip's `ClipLoss` (symmetric cross-entropy, learned temperature) over the *local*
  batch: under FSDP each rank contrasts its own batch only, fewer negatives than CLIP's global
  batch, which is fine for a baseline (`ClipLoss(gather_with_grad=True, rank=, world_size=)` would
  gather the features across ranks).

Captions are scored by cosine similarity (`mdc.scoring.cosine_scores`). The text blocks are exposed as `blocks` so `mdc.training.fsdp.apply_fsdp` shards them like decoder blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from open_clip.transformer import TextTransformer
from torch import nn

from mdc.models.captioner import PRESETS, compute_dtype, create_encoder, num_heads

MAX_LOGIT_SCALE = 100.0  # CLIP keeps the temperature's inverse at most 100


class ClipModel(nn.Module):
    def __init__(
        self,
        preset: str = "tiny",
        max_length: int = 32,
        image_size: int | None = None,
        text_layers: int | None = None,
        bos_id: int = 49406,
        eos_id: int = 49407,
        pad_id: int = 49409,
        encoder_pos_embed: str = "sincos2d",
    ):
        super().__init__()
        p = PRESETS[preset]
        self.image_size = image_size or p.image_size
        self.max_length = max_length
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.encoder = create_encoder(preset, self.image_size, encoder_pos_embed)
        dim = self.encoder.embed_dim
        self.image_proj = nn.Linear(dim, dim, bias=False)
        self.text = TextTransformer(
            context_length=max_length + 2,
            vocab_size=eos_id + 1,
            width=dim,
            heads=num_heads(dim),
            layers=text_layers or p.decoder_layers,
            output_dim=dim,
        )
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(1 / 0.07)))  # 1-D: FSDP shards no scalars

    @property
    def dim(self) -> int:
        return self.encoder.embed_dim

    @property
    def blocks(self) -> nn.ModuleList:
        return self.text.transformer.resblocks

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder.forward_features(images.to(compute_dtype(self.encoder)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """Pooled features for probes: the mean of the normalised patch features (as the captioner)."""
        return self.encode(images).mean(dim=1)

    def text_inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Our (B, L) caption tokens (no BOS/EOS, padded with pad_id) as CLIP text: (B, L + 2)."""
        b, n = tokens.shape
        real = tokens != self.pad_id
        text = torch.zeros(b, n + 2, dtype=tokens.dtype, device=tokens.device)
        text[:, 0] = self.bos_id
        text[:, 1 : n + 1] = torch.where(real, tokens, 0)
        text[torch.arange(b, device=tokens.device), real.sum(1) + 1] = self.eos_id
        return text

    def image_embedding(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image_proj(self.encode_image(images)), dim=-1)

    def text_embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(self.text_inputs(tokens)), dim=-1)

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """Clamp the parameter itself to log(MAX_LOGIT_SCALE), in place, as open_clip does after each
        optimiser step: clamping exp() instead would zero its gradient above the bound for good."""
        self.logit_scale.clamp_(max=math.log(MAX_LOGIT_SCALE))

    def forward(self, images, tokens):
        """(image embeddings, text embeddings, logit scale): the inputs of ClipLoss."""
        return self.image_embedding(images), self.text_embedding(tokens), self.logit_scale.exp()
