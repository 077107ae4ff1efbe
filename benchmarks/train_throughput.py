"""Training throughput and model FLOPs utilisation (MFU) per preset.

MFU = (FLOPs of one training step, counted by torch's FlopCounterMode) × steps/s divided by the
peak matmul FLOP/s measured on the same device in the same run — a ratio, so it transfers across
machines. Synthetic in-memory batches: this measures the model, not the input pipeline.

    python -m benchmarks.train_throughput --presets tiny,vit_b16 [--device cuda --bf16 --fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from mdc.config import ObjectiveConfig, OptimConfig
from mdc.model import Captioner
from mdc.objectives import compute_loss
from mdc.tokenizer import CaptionTokenizer
from mdc.training import build_optimizer, build_scheduler, train_step


def peak_matmul_flops(device: str, dtype: torch.dtype, n: int = 2048, seconds: float = 2.0) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    sync(device)
    return 2 * n**3 * count / (time.perf_counter() - start)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def synthetic_batch(model: Captioner, batch: int, max_length: int, device: str):
    images = torch.randn(batch, 3, model.image_size, model.image_size, device=device)
    tokens = torch.randint(0, 49_000, (batch, max_length), device=device)
    tokens[:, max_length * 3 // 4:] = CaptionTokenizer.pad_id  # captions fill 3/4 of the context
    return images, tokens


def measure(preset: str, batch: int, steps: int, device: str, bf16: bool, fsdp: bool, max_length: int = 32) -> dict:
    torch.manual_seed(0)
    model = Captioner(preset, max_length=max_length).to(device)
    if fsdp:
        from mdc.parallel import apply_fsdp

        apply_fsdp(model, bf16=bf16)
    objective = ObjectiveConfig()
    optimizer = build_optimizer(model, OptimConfig())
    scheduler = build_scheduler(optimizer, 10, 10_000)
    images, tokens = synthetic_batch(model, batch, max_length, device)
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=bf16 and not fsdp)
    with FlopCounterMode(display=False) as counter, autocast:
        loss, _ = compute_loss(model, images, tokens, objective)
        loss.backward()
    flops_per_step = counter.get_total_flops()
    optimizer.zero_grad(set_to_none=True)
    for _ in range(3):  # warm-up
        with autocast:
            train_step(model, optimizer, scheduler, images, tokens, objective, 1.0)
    sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        with autocast:
            train_step(model, optimizer, scheduler, images, tokens, objective, 1.0)
    sync(device)
    elapsed = time.perf_counter() - start
    peak = peak_matmul_flops(device, torch.bfloat16 if bf16 else torch.float32)
    achieved = flops_per_step * steps / elapsed
    out = {"preset": preset, "device": device, "bf16": bf16, "fsdp": fsdp, "batch": batch, "steps": steps,
           "images_per_s": batch * steps / elapsed, "step_s": elapsed / steps,
           "gflop_per_step": flops_per_step / 1e9, "achieved_tflops": achieved / 1e12,
           "peak_matmul_tflops": peak / 1e12, "mfu": achieved / peak,
           "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    if device.startswith("cuda"):
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,vit_b16")
    parser.add_argument("--batch", default="32,8", help="per preset, comma-separated")
    parser.add_argument("--steps", default="20,3")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (single process group)")
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args()
    if args.fsdp and not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        torch.distributed.init_process_group("nccl" if args.device.startswith("cuda") else "gloo",
                                             rank=0, world_size=1)
    results = [measure(p, int(b), int(s), args.device, args.bf16, args.fsdp)
               for p, b, s in zip(args.presets.split(","), args.batch.split(","), args.steps.split(","))]
    for r in results:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
