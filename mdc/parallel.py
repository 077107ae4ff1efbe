"""FSDP2 sharding of the captioner (torchtitan's pattern: each transformer block, then the root)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method


def apply_fsdp(model, bf16: bool) -> None:
    """Shard every encoder and decoder block, then the root (embeddings, norms, patch stem).

    bf16: parameters are all-gathered and computed in bfloat16, gradients reduced in float32
    (GPU). On CPU/gloo everything stays float32. A model whose training entry point is not
    `forward` names it in `fsdp_forward_methods`, so FSDP unshards the root around that call too.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in [*model.encoder.blocks, *model.blocks]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for name in getattr(model, "fsdp_forward_methods", ()):
        register_fsdp_forward_method(model, name)
