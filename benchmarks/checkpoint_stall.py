"""How long a checkpoint stalls training: the longest step (the training step plus, on checkpoint
steps, what the save keeps the training thread waiting for) with synchronous checkpoints and with
`checkpoint.background`, in one run, saving to an S3 server (moto, in this process).

    python -m benchmarks.checkpoint_stall [--preset tiny --steps 12 --every 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import boto3
import torch
import torch.distributed as dist
from moto.server import ThreadedMotoServer

from benchmarks.train_throughput import init_single_process_group, training_setup
from mdc.config import load_config
from mdc.objectives.masked import MdcObjective
from mdc.training.step import train_step
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
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="stall")
    init_single_process_group(True, "cpu")
    results = {}
    try:
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
    finally:
        dist.destroy_process_group()
        server.stop()
    results["longest_async_over_sync"] = results["async"]["longest_step_s"] / results["sync"]["longest_step_s"]
    print(json.dumps(results))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
