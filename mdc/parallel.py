"""FSDP2 sharding of the captioner (torchtitan's pattern: each transformer block, then the root)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model, bf16: bool) -> None:
    """Shard every encoder and decoder block, then the root (embeddings, norms, patch stem).

    bf16: parameters are all-gathered and computed in bfloat16, gradients reduced in float32
    (GPU). On CPU/gloo everything stays float32.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in [*model.encoder.blocks, *model.blocks]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
