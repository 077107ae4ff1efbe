"""Training throughput and model FLOPs utilisation (MFU) per preset.

MFU = (FLOPs of one training step of the eager model, counted by torch's FlopCounterMode; the
recomputation of activation checkpointing is not counted) × steps/s divided by two peaks: the matmul
FLOP/s measured on the same device in the same run (`mfu`, a ratio that transfers across machines)
and the device's dense bf16 spec sheet figure (`mfu_spec`, the number papers quote; None for a
device not in DENSE_BF16_TFLOPS, e.g. a CPU). `compile` is what ran: false, with
`compile_fallback` saying why, when torch.compile was asked for but unavailable.
Synthetic in-memory batches: this measures the model, not the input pipeline.

    python -m benchmarks.train_throughput --presets tiny,vit_b16 [--device cuda --bf16 --fsdp --compile --ac]
    python -m benchmarks.train_throughput --presets tiny --profile        # where a step's time goes
    python -m benchmarks.train_throughput --ray-vs-plain --global-batch 32 # Ray Train (2 CPU workers) / one process
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from mdc.config import OptimConfig
from mdc.data.tokenizer import CaptionTokenizer
from mdc.models.captioner import Captioner
from mdc.objectives.masked import MdcObjective
from mdc.registry import compute_loss
from mdc.training.fsdp import compile_available, prepare_model
from mdc.training.step import build_optimizer, build_scheduler, train_step

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, TFLOP/s, by a substring of
# torch.cuda.get_device_name(); first match wins, so the PCIe H100 comes before the SXM one.
DENSE_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def spec_peak_tflops(device: str) -> float | None:
    """The device's dense bf16 peak from DENSE_BF16_TFLOPS; None when it is not listed (CPU, others)."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((tflops for key, tflops in DENSE_BF16_TFLOPS if key in name), None)


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
    tokens[:, max_length * 3 // 4 :] = CaptionTokenizer.pad_id  # captions fill 3/4 of the context
    return images, tokens


def step_flops(preset: str, batch: int, max_length: int, device: str) -> float:
    """FLOPs of one forward + backward of the eager, unsharded model (model FLOPs)."""
    torch.manual_seed(0)
    model = Captioner(preset, max_length=max_length).to(device)
    images, tokens = synthetic_batch(model, batch, max_length, device)
    with FlopCounterMode(display=False) as counter:
        loss, _ = compute_loss(model, images, tokens, MdcObjective())
        loss.backward()
    return counter.get_total_flops()


def training_setup(
    preset: str,
    batch: int,
    device: str,
    bf16: bool,
    fsdp: bool,
    activation_checkpointing: bool,
    compile: bool,
    max_length: int = 32,
):
    torch.manual_seed(0)
    model = Captioner(preset, max_length=max_length).to(device)
    prepare_model(
        model, device, bf16=bf16, activation_checkpointing=activation_checkpointing, compile=compile, shard=fsdp
    )
    optimizer = build_optimizer(model, OptimConfig())
    scheduler = build_scheduler(optimizer, 10, 10_000)
    return model, optimizer, scheduler, synthetic_batch(model, batch, max_length, device)


def measure(
    preset: str,
    batch: int,
    steps: int,
    device: str,
    bf16: bool,
    fsdp: bool,
    activation_checkpointing: bool = False,
    compile: bool = False,
    max_length: int = 32,
    peak: float | None = None,
) -> dict:
    flops_per_step = step_flops(preset, batch, max_length, device)
    model, optimizer, scheduler, (images, tokens) = training_setup(
        preset, batch, device, bf16, fsdp, activation_checkpointing, compile, max_length
    )
    fallback = compile_available(device) if compile else None  # prepare_model's test: eager when it fails
    objective = MdcObjective()
    # FSDP2's MixedPrecisionPolicy casts sharded models; a plain model computes under autocast
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=bf16 and not fsdp)
    for _ in range(3):  # warm-up (and compilation)
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
    peak = peak or peak_matmul_flops(device, torch.bfloat16 if bf16 else torch.float32)
    achieved = flops_per_step * steps / elapsed
    spec = spec_peak_tflops(device) if bf16 else None
    out = {
        "preset": preset,
        "device": device,
        "bf16": bf16,
        "fsdp": fsdp,
        "compile": compile and fallback is None,
        "compile_fallback": fallback,
        "activation_checkpointing": activation_checkpointing,
        "batch": batch,
        "steps": steps,
        "images_per_s": batch * steps / elapsed,
        "step_s": elapsed / steps,
        "gflop_per_step": flops_per_step / 1e9,
        "achieved_tflops": achieved / 1e12,
        "peak_matmul_tflops": peak / 1e12,
        "mfu": achieved / peak,
        "spec_peak_tflops": spec,
        "mfu_spec": None if spec is None else achieved / (spec * 1e12),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    if device.startswith("cuda"):
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def profile(preset: str, batch: int, steps: int, device: str, rows: int = 15) -> str:
    """torch.profiler's table of the operators that take a training step's time, by self time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, optimizer, scheduler, (images, tokens) = training_setup(preset, batch, device, False, False, False, False)
    train_step(model, optimizer, scheduler, images, tokens, MdcObjective(), 1.0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(model, optimizer, scheduler, images, tokens, MdcObjective(), 1.0)
    key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def _ray_worker_loop(config: dict) -> None:
    """One Ray Train worker: the same step as the plain loop on its share of the global batch."""
    import ray.train

    model, optimizer, scheduler, (images, tokens) = training_setup(
        config["preset"], config["batch"], "cpu", False, True, False, False
    )
    for _ in range(config["warmup"]):
        train_step(model, optimizer, scheduler, images, tokens, MdcObjective(), 1.0)
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(config["steps"]):
        train_step(model, optimizer, scheduler, images, tokens, MdcObjective(), 1.0)
    torch.distributed.barrier()
    if ray.train.get_context().get_world_rank() == 0:  # Ray Train V2 keeps metrics only with checkpoints
        with open(config["out"], "w") as f:
            json.dump({"seconds": time.perf_counter() - start}, f)


def ray_vs_plain(preset: str, global_batch: int, steps: int, workers: int = 2, warmup: int = 3) -> dict:
    """img/s of Ray Train with `workers` CPU workers (FSDP2, gloo, global_batch / workers each)
    against one process training the whole global batch, same steps, same machine."""
    import tempfile

    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    model, optimizer, scheduler, (images, tokens) = training_setup(
        preset, global_batch, "cpu", False, False, False, False
    )
    for _ in range(warmup):
        train_step(model, optimizer, scheduler, images, tokens, MdcObjective(), 1.0)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, scheduler, images, tokens, MdcObjective(), 1.0)
    plain = global_batch * steps / (time.perf_counter() - start)
    del model, optimizer

    ray.init(num_cpus=workers, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            out = os.path.join(storage, "seconds.json")
            TorchTrainer(
                _ray_worker_loop,
                train_loop_config={
                    "preset": preset,
                    "batch": global_batch // workers,
                    "steps": steps,
                    "warmup": warmup,
                    "out": out,
                },
                scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
                run_config=ray.train.RunConfig(storage_path=storage, name="bench"),
                torch_config=TorchConfig(backend="gloo"),
            ).fit()
            with open(out) as f:
                seconds = json.load(f)["seconds"]
    finally:
        ray.shutdown()
    distributed = global_batch * steps / seconds
    return {
        "preset": preset,
        "global_batch": global_batch,
        "workers": workers,
        "steps": steps,
        "plain_images_per_s": plain,
        "ray_images_per_s": distributed,
        "ray_over_plain": distributed / plain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,vit_b16")
    parser.add_argument("--batch", default="32,8", help="per preset, comma-separated")
    parser.add_argument("--steps", default="20,3")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (single process group)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    parser.add_argument("--profile", action="store_true", help="print where a step's time goes instead")
    parser.add_argument("--ray-vs-plain", action="store_true", help="Ray Train (2 CPU workers) / one process")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args()
    presets, batches, steps = args.presets.split(","), args.batch.split(","), args.steps.split(",")
    if args.profile:
        print(profile(presets[0], int(batches[0]), int(steps[0]), args.device))
        return
    if args.ray_vs_plain:
        results = [ray_vs_plain(presets[0], args.global_batch, int(steps[0]))]
    else:
        init_single_process_group(args.fsdp, args.device)
        results = [
            measure(p, int(b), int(s), args.device, args.bf16, args.fsdp, args.ac, args.compile)
            for p, b, s in zip(presets, batches, steps)
        ]
    for r in results:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


def init_single_process_group(fsdp: bool, device: str) -> None:
    """FSDP2 needs a process group; without torchrun, a group of one."""
    if fsdp and not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")


if __name__ == "__main__":
    main()
