"""The contrastive objective of the CLIP baseline (docs/design.md §3): open_clip's `ClipLoss` (symmetric
cross-entropy, learned temperature) over the local batch of a `mdc.models.clip.ClipModel`."""

from __future__ import annotations

import torch
from open_clip.loss import ClipLoss

from mdc.objectives.sections import ClipObjective  # torch-free; re-exported here

__all__ = ["ClipObjective", "clip_loss"]


def clip_loss(model, images, tokens):
    """(loss, metrics) of the contrastive objective over the local batch. The logit scale is
    clamped first: every forward sees it clamped after the previous step, as in open_clip."""
    model.clamp_logit_scale_()
    # the logits in float32 whatever the towers compute in: a bf16 softmax over the batch loses the
    # small differences the contrastive loss learns from
    image, text, scale = (x.float() for x in model(images, tokens))
    loss = ClipLoss()(image, text, scale)
    hits = (image @ text.T).argmax(dim=1) == torch.arange(len(image), device=image.device)
    return loss, {"contrastive_accuracy": hits.float().mean(), "logit_scale": scale.detach()}
