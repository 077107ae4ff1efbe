"""The captioner: a timm ViT encoder (from scratch) late-fused into a transformer decoder.

Layout follows CapPa (Tschannen et al. 2023): the encoder's patch features V are the keys/values of
cross-attention in every decoder block. The decoder's self-attention is bidirectional for masked
diffusion and causal for autoregressive captioning; the choice is made per call (CapPa mixes both
in one batch), so one module serves every objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import timm
import torch
import torch.nn.functional as F
from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed
from torch import nn


@dataclass(frozen=True)
class Preset:
    timm_name: str
    image_size: int
    decoder_layers: int
    encoder_overrides: tuple = ()  # extra timm kwargs, as (key, value) pairs


PRESETS: dict[str, Preset] = {
    # Small enough to train on 2 CPU cores in minutes: 32 px, 4 px patches -> 64 patch tokens.
    "tiny": Preset(
        "vit_tiny_patch16_224", 32, 2, (("patch_size", 4), ("embed_dim", 128), ("depth", 4), ("num_heads", 4))
    ),
    "vit_b32": Preset("vit_base_patch32_224", 224, 6),
    "vit_b16": Preset("vit_base_patch16_224", 224, 6),
    "vit_l14": Preset("vit_large_patch16_224", 224, 6, (("patch_size", 14),)),
}


# Fixed 2D sin-cos positions at this gain (timm's learned table, std 0.02, learns what but not where);
# why: see docs/design.md §11, 'Encoder positions'
SINCOS_GAIN = 3.0


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module computes in: that of its weights (bf16 while FSDP2's mixed-precision policy
    has them gathered). Float inputs from outside are cast to it where they enter the model."""
    return next(module.parameters()).dtype


def create_encoder(preset: str, image_size: int, pos_embed: str = "sincos2d") -> nn.Module:
    """A ViT returning normalised patch tokens (no class token, no head), randomly initialised.

    `pos_embed`: "sincos2d" replaces timm's learned position table by a fixed buffer (not a
    parameter: never trained, not in the state dict); "learned" keeps timm's."""
    p = PRESETS[preset]
    encoder = timm.create_model(
        p.timm_name,
        pretrained=False,
        num_classes=0,
        img_size=image_size,
        class_token=False,
        global_pool="avg",
        fc_norm=False,
        **dict(p.encoder_overrides),
    )
    if pos_embed == "sincos2d":
        table = build_sincos2d_pos_embed(list(encoder.patch_embed.grid_size), encoder.embed_dim)
        del encoder.pos_embed
        encoder.register_buffer("pos_embed", SINCOS_GAIN * table[None], persistent=False)
    elif pos_embed != "learned":
        raise ValueError(f"pos_embed must be 'sincos2d' or 'learned', got {pos_embed!r}")
    return encoder


def num_heads(dim: int) -> int:
    """Attention heads of a transformer of width `dim` (64-wide heads; 4 for the tiny preset)."""
    return dim // 64 if dim >= 256 else 4


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Float32 whatever the model computes in: in bf16, 1000·t is only resolved to ~4 near t = 1000·0.5,
    so nearby noise levels would share an embedding (callers cast the result to the layer's dtype)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device) / half)
    angles = 1000.0 * t.float()[:, None] * freqs[None]  # t in [0,1]: stretch to a useful range
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv(x).chunk(2, dim=-1)
        return self.split(k), self.split(v)

    def forward(self, x, k, v, mask=None):
        q = self.split(self.q(x))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, h, n, dh = y.shape
        return self.out(y.transpose(1, 2).reshape(b, n, h * dh))


class DecoderBlock(nn.Module):
    """Pre-norm self-attention, cross-attention to V, MLP; optional adaLN modulation from t."""

    def __init__(self, dim: int, heads: int, time_conditioning: bool):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(dim) for _ in range(3))
        self.self_attn = Attention(dim, heads)
        self.cross_attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.modulation = nn.Linear(dim, 6 * dim) if time_conditioning else None
        if self.modulation is not None:  # start as the identity modulation
            nn.init.zeros_(self.modulation.weight)
            nn.init.zeros_(self.modulation.bias)

    def forward(self, x, image, self_mask, t_emb=None, cache=None):
        """`image` is V (B, P, D) or this block's precomputed cross-attention (K, V).
        K/V are computed here, inside the block, so an FSDP-sharded block has its weights."""
        image_kv = self.cross_attn.keys_values(image) if torch.is_tensor(image) else image
        mods = [0.0] * 6
        if self.modulation is not None:
            mods = [m[:, None] for m in self.modulation(t_emb).chunk(6, dim=-1)]
        h = self.norm1(x) * (1 + mods[0]) + mods[1]
        k, v = self.self_attn.keys_values(h)
        if cache is not None:  # incremental decoding: extend the stored keys/values
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        x = x + self.self_attn(h, k, v, self_mask)
        x = x + self.cross_attn(self.norm2(x) * (1 + mods[2]) + mods[3], *image_kv)
        return x + self.mlp(self.norm3(x) * (1 + mods[4]) + mods[5])


class Captioner(nn.Module):
    """Encoder f_φ and decoder g_ψ. [MASK] and pad are never predicted (see `project`)."""

    def __init__(
        self,
        preset: str = "tiny",
        vocab_size: int = 49410,
        mask_id: int = 49408,
        pad_id: int = 49409,
        bos_id: int = 49406,
        eos_id: int = 49407,
        max_length: int = 32,
        image_size: int | None = None,
        decoder_layers: int | None = None,
        time_conditioning: bool = False,
        concentrated_attention: bool = False,
        predict_length: bool = False,
        null_image: bool = False,
        encoder_pos_embed: str = "sincos2d",
    ):
        super().__init__()
        p = PRESETS[preset]
        self.image_size = image_size or p.image_size
        self.encoder = create_encoder(preset, self.image_size, encoder_pos_embed)
        dim = self.encoder.embed_dim
        heads = num_heads(dim)
        self.mask_id, self.pad_id, self.bos_id, self.eos_id = mask_id, pad_id, bos_id, eos_id
        self.concentrated_attention = concentrated_attention
        self.max_length = max_length
        self.token_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_length + 1, dim))  # +1: AR's BOS shift
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.token_embed.weight, std=0.02)
        self.time_mlp = (
            nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim)) if time_conditioning else None
        )
        self.blocks = nn.ModuleList(
            DecoderBlock(dim, heads, time_conditioning) for _ in range(decoder_layers or p.decoder_layers)
        )
        self.norm = nn.LayerNorm(dim)
        # DDCap switches (mdc/ddcap.py): a caption-length classifier on the pooled image feature, and
        # a learned null image that stands in for V in image-free training and guidance.
        self.length_head = nn.Linear(dim, max_length) if predict_length else None
        self.null_image = nn.Parameter(0.02 * torch.randn(1, 1, dim)) if null_image else None
        if sorted((mask_id, pad_id)) != [vocab_size - 2, vocab_size - 1]:
            raise ValueError(
                f"[MASK] ({mask_id}) and pad ({pad_id}) must be the last two of the {vocab_size} ids: "
                "the output layer predicts the ids before them"
            )
        self.num_predicted = vocab_size - 2  # ids 0 .. V−3: every id but [MASK] and pad

    @property
    def dim(self) -> int:
        return self.token_embed.embedding_dim

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Patch features V (B, P, D) after the encoder's final norm."""
        return self.encoder.forward_features(images.to(compute_dtype(self.encoder)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """Pooled features for probes: the mean of the normalised patch features."""
        return self.encode(images).mean(dim=1)

    def self_attention_mask(self, tokens: torch.Tensor, causal: torch.Tensor | bool) -> torch.Tensor:
        """(B,1,L,L) boolean, True = may attend. Pad keys are hidden (and, with concentrated
        attention, [MASK] keys); each position always sees itself so no row is empty."""
        b, n = tokens.shape
        keys = tokens != self.pad_id
        if self.concentrated_attention:
            keys = keys & (tokens != self.mask_id)
        mask = keys[:, None, :].expand(b, n, n)
        lower = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        if isinstance(causal, bool):  # a Python branch: no host-to-device copy of the flag
            mask = mask & lower if causal else mask
        else:  # per row (CapPa mixes both in a batch)
            mask = torch.where(causal.expand(b)[:, None, None], mask & lower, mask)
        return (mask | torch.eye(n, dtype=torch.bool, device=tokens.device))[:, None]

    def image_keys_values(self, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [blk.cross_attn.keys_values(features) for blk in self.blocks]

    def null_features(self, batch_size: int) -> torch.Tensor:
        """The learned null image as V (B, 1, D): what the decoder sees without an image."""
        return self.null_image.expand(batch_size, -1, -1)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor | list,
        t: torch.Tensor | None = None,
        causal: torch.Tensor | bool = False,
        cache: list[dict] | None = None,
        offset: int = 0,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's final (normalised) states (B, L, D); see `decode`. `inputs_embeds` (B, L, D)
        replaces the token embeddings as input (continuous diffusion); `tokens` still decide which
        keys are hidden (pad, and [MASK] with concentrated attention)."""
        per_block = features if isinstance(features, list) else [features] * len(self.blocks)
        n = tokens.shape[1]
        x = self.token_embed(tokens) if inputs_embeds is None else inputs_embeds
        x = (x + self.pos_embed[:, offset : offset + n]).to(self.pos_embed.dtype)
        t_emb = None
        if self.time_mlp is not None:
            if t is None:
                raise ValueError("time_conditioning is on: decode() needs t")
            t_emb = self.time_mlp(sinusoidal_embedding(t, self.dim).to(compute_dtype(self.time_mlp)))
        mask = None if cache is not None else self.self_attention_mask(tokens, causal)
        for i, blk in enumerate(self.blocks):
            x = blk(x, per_block[i], mask, t_emb, None if cache is None else cache[i])
        return self.norm(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (..., V − 2) of decoder states over the ids a caption can hold, index = id: the tied
        output layer with the rows of [MASK] and pad (the last two ids) cut, so neither is ever
        predicted and no −∞ bias is added. Float32: the losses' and scores' log-softmax."""
        return F.linear(x, self.token_embed.weight[: self.num_predicted]).float()

    def decode(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor | list,
        t: torch.Tensor | None = None,
        causal: torch.Tensor | bool = False,
        cache: list[dict] | None = None,
        offset: int = 0,
        where: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, L, V − 2) for `tokens` given image features (or their precomputed K/V).

        With `where` (B, L) boolean, only the logits at those positions, flattened to (M, V − 2):
        the output layer is the decoder's largest matmul, so samplers and scorers project only what
        they use. A boolean index has a data-dependent shape (the host waits for the device), so the
        masked training losses project every position instead (mdc/objectives/masked.py).

        With `cache` (one dict per block) only the new tokens are passed, starting at position
        `offset`; attention over the cached prefix is implicit, so this path is causal by design.
        """
        x = self.hidden_states(tokens, features, t, causal, cache, offset, inputs_embeds)
        if where is not None:
            x = x[where]
        return self.project(x)

    def forward(self, images, tokens, t=None, causal=False, where=None, image_free=None, return_length=False):
        """Training entry point (FSDP unshards parameters around it), so everything a loss needs
        from the parameters comes out of this one call.

        DDCap: rows where `image_free` (B,) is True see the learned null image instead of V; with
        `return_length`, also the caption-length logits of the pooled image feature:
        (logits, length_logits)."""
        features = self.encode(images)
        condition = (
            features if image_free is None else torch.where(image_free[:, None, None], self.null_image, features)
        )
        logits = self.decode(tokens, condition, t=t, causal=causal, where=where)
        if return_length:
            return logits, self.length_head(features.mean(dim=1))
        return logits
