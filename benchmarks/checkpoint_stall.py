"""How long a checkpoint stalls training: the longest step (the training step plus, on checkpoint
steps, what the save keeps the training thread waiting for) with synchronous checkpoints and with
`checkpoint.background`, in one run, saving to the local S3 server (moto, in its own process: its work does not hold this one's GIL).

    python -m benchmarks.checkpoint_stall [--preset tiny --steps 12 --every 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.train_throughput import init_single_process_group, training_setup
from mdc.config import load_config
from mdc.objectives.masked import MdcObjective
from mdc.training.step import train_step
from pipelines.infra.local_s3 import create_bucket, local_s3_server
from pipelines.worker.checkpointer import Checkpointer


def step_times(cfg, run_dir: str, steps: int, every: int) -> list[float]:
    model, optimizer, scheduler, (images, tokens) = training_setup(
        cfg.model.preset, 16, "cpu", False, True, False, False
    )
    checkpointer = Checkpointer(
        cfg, run_dir, 0, model=model, optimizer=optimizer, ema=None, states={"scheduler": scheduler}
    )
    times = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        train_step(model, optimizer, scheduler, images, tokens, MdcObjective(), 1.0)
        if step % every == 0:
            checkpointer.save(step)
        times.append(time.perf_counter() - start)
    if checkpointer.background is not None:
        checkpointer.background.wait()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args()
    init_single_process_group(True, "cpu")
    results = {}
    with local_s3_server() as endpoint:
        create_bucket(endpoint, "stall")
        for mode in ("sync", "async"):
            cfg = load_config(
                None,
                [
                    f"model.preset={args.preset}",
                    "train.steps=100000",
                    "train.batch_size=32",
                    "data.max_length=32",
                    f"checkpoint.background={mode == 'async'}",
                    f"data.endpoint_url={endpoint}",
                    "data.val_uri=null",
                ],
            )
            times = step_times(cfg, f"s3://stall/{mode}", args.steps, args.every)
            results[mode] = {"longest_step_s": max(times), "median_step_s": statistics.median(times)}
    dist.destroy_process_group()
    results["longest_async_over_sync"] = results["async"]["longest_step_s"] / results["sync"]["longest_step_s"]
    print(json.dumps(results))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
