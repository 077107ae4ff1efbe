"""How the captioner is laid out for training, in torchtitan's order: activation checkpointing,
then compilation, per transformer block; then FSDP2 sharding of each block and the root."""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint


def transformer_blocks(model) -> list[torch.nn.Module]:
    """The encoder's and the decoder's (or CLIP text tower's) blocks."""
    return [*model.encoder.blocks, *model.blocks]


def checkpoint_activations(block: torch.nn.Module) -> None:
    """Keep only the block's input in the forward pass and recompute the rest in backward. The
    forward is wrapped in place, so parameter names (and checkpoints) stay as they were."""
    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def compile_available(device: torch.device | str) -> str | None:
    """None when torch.compile works on `device`, else why not (no C++ compiler, no Triton, ...)."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4, device=device))
    except Exception as e:  # the backend reports a missing toolchain in many ways
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def prepare_model(
    model, device, *, bf16: bool, activation_checkpointing: bool = False, compile: bool = False, shard: bool = True
) -> None:
    """Activation checkpointing and `torch.compile` per block (when asked), then `apply_fsdp`
    (`shard`). Where compilation is unavailable the blocks run eagerly, with a warning that says why."""
    blocks = transformer_blocks(model)
    if activation_checkpointing:
        for block in blocks:
            checkpoint_activations(block)
    if compile:
        reason = compile_available(device)
        if reason is None:
            for block in blocks:
                block.compile()
        else:
            warnings.warn(
                f"compute.compile: torch.compile does not work on {device} ({reason}); training uncompiled",
                stacklevel=2,
            )
    if shard:
        apply_fsdp(model, bf16)


def apply_fsdp(model, bf16: bool) -> None:
    """Shard every encoder and decoder block, then the root (embeddings, norms, patch stem).

    bf16: parameters are all-gathered and computed in bfloat16, gradients reduced in float32
    (GPU); the sharded parameters, so the optimiser state and the EMA, stay float32. On CPU/gloo
    everything is float32. A model whose training entry point is not `forward` names it in
    `fsdp_forward_methods`, so FSDP unshards the root around that call too.

    Blocks stay gathered from forward to backward (`reshard_after_forward=False`): one all-gather
    per step instead of two; why: docs/design.md §11, 'FSDP resharding'.
    """
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for block in transformer_blocks(model):
        fully_shard(block, mp_policy=policy, reshard_after_forward=False)
    # The root keeps its float inputs as given: cast to bf16, the noise level t (masked diffusion,
    # cdlm) would lose its precision before the time embedding (0.5 and 0.5004 are one bf16 value).
    # The models cast images and embeddings to their weights' dtype themselves (`compute_dtype`).
    fully_shard(model, mp_policy=replace(policy, cast_forward_inputs=False))
    for name in getattr(model, "fsdp_forward_methods", ()):
        register_fsdp_forward_method(model, name)
