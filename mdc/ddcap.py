"""DDCap's techniques for masked diffusion captioning (Zhu et al. 2022, docs/design.md §4), each a switch.

- **Length prediction** (`model.predict_length`): the caption length N' is a class 1..max_length
  predicted from the pooled image feature by `Captioner.length_head`, trained with an extra
  cross-entropy term; the sampler uses it when no N' is given.
- **Concentrated attention** (`model.concentrated_attention`): queries do not attend to [MASK] keys,
  except each token to itself (`Captioner.self_attention_mask`).
- **Image-free training** (`objective.image_free_prob`): that share of training captions see the
  learned null image `Captioner.null_image` instead of V, so the same decoder also learns p(C);
  sampling mixes the two with classifier-free guidance `l_u + s·(l_c − l_u)`.
- **Best-first sampling**: the `confidence` strategy of `mdc.sampling.sample_masked`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def length_targets(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The length class of each caption: its number of non-pad tokens, as index N − 1."""
    return ((tokens != pad_id).sum(dim=1) - 1).clamp(min=0)


def length_loss(length_logits: torch.Tensor, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    return F.cross_entropy(length_logits, length_targets(tokens, pad_id))


def predicted_lengths(length_logits: torch.Tensor) -> torch.Tensor:
    """The most probable caption length N' (≥ 1) per image."""
    return length_logits.argmax(dim=-1) + 1


def masked_captions(lengths: torch.Tensor, max_length: int, mask_id: int, pad_id: int) -> torch.Tensor:
    """(B, max(lengths)) sampler input: `lengths[i]` [MASK] tokens, then pad."""
    positions = torch.arange(int(lengths.max()), device=lengths.device)
    return torch.where(positions[None] < lengths[:, None], mask_id, pad_id)[:, :max_length]


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance on logits, l_u + s·(l_c − l_u) (finite: the output layer predicts
    no special id, so no −∞ can turn into NaN)."""
    return uncond + scale * (cond - uncond)
