"""The GPU training benchmark, one command: ViT-B/16 and ViT-L/14 MDC captioners, bf16 FSDP2,
compiled blocks, activation checkpointing off and on, synthetic batches; prints img/s, MFU against
the bf16 matmul peak measured on the same GPU in the same run and against the device's dense bf16
spec (989 TFLOP/s on an H100/H200 SXM), whether compilation really ran, and peak memory.

    python -m benchmarks.gpu_train [--steps 200] [--batch 64,32] [--out results.json]

One GPU, one process (FSDP2 over a group of one: the same wrapping, mixed precision and compiled
blocks as a Ray Train worker). For several GPUs: torchrun --nproc-per-node N -m benchmarks.gpu_train
(images/s are per GPU). Never needed by CI.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.train_throughput import init_single_process_group, measure, peak_matmul_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="vit_b16,vit_l14")
    parser.add_argument("--batch", default="64,32", help="per GPU, one per preset")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_train needs a CUDA GPU; for CPU use benchmarks.train_throughput")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_single_process_group(True, "cuda")
    peak = peak_matmul_flops("cuda", torch.bfloat16, n=8192)
    results = []
    for preset, batch in zip(args.presets.split(","), args.batch.split(",")):
        for ac in (False, True):
            torch.cuda.empty_cache()
            r = measure(
                preset,
                int(batch),
                args.steps,
                "cuda",
                bf16=True,
                fsdp=True,
                activation_checkpointing=ac,
                compile=not args.no_compile,
                peak=peak,
            )
            results.append(r)
            if torch.distributed.get_rank() == 0:
                print(
                    f"{preset:8s} batch {batch:>4s} act-ckpt {'on ' if ac else 'off'}  "
                    f"{r['images_per_s']:8.1f} img/s  MFU {r['mfu']:.3f} "
                    f"(peak bf16 matmul {r['peak_matmul_tflops']:.0f} TFLOP/s), "
                    f"MFU vs spec {'n/a' if r['mfu_spec'] is None else format(r['mfu_spec'], '.3f')}  "
                    f"compiled {r['compile']}{'' if r['compile_fallback'] is None else ' (' + r['compile_fallback'] + ')'}  "
                    f"peak memory {r['peak_memory_gib']:.1f} GiB",
                    flush=True,
                )
    if args.out and torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
