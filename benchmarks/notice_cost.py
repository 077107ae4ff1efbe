"""What reading the reclaim notice costs a step (pipelines/worker/notice.py, `Trainer._reclaimed`):
a read is Ray Train's `get_preemption_info()` and rank 0's step gap broadcast
(`broadcast_from_rank_zero`), both collectives over the worker group. Timed here in a Ray Train
group of `--workers` CPU workers sharing one CPU (0.5 each for 2, as a run lays them out on 2
cores): the median and 90th percentile of `--reads` reads, and the share of training time that is
when one is read every `workers.notice_every_s` (5 s), whatever the step time. The steps between
reads only compare their step with the next read's (`NoticeSchedule.due`), timed too.

    python -m benchmarks.notice_cost [--workers 2] [--reads 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import ray.train
import ray.train.collective
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

from pipelines.worker.notice import NoticeSchedule

NOTICE_EVERY_S = 5.0


def loop(config: dict) -> dict:
    ray.train.collective.barrier()
    reads = []
    for _ in range(config["reads"]):
        start = time.perf_counter()
        ray.train.get_preemption_info()
        ray.train.collective.broadcast_from_rank_zero(7)
        reads.append(time.perf_counter() - start)
    schedule, start = NoticeSchedule(NOTICE_EVERY_S), time.perf_counter()
    sum(schedule.due(step) for step in range(100_000))
    quiet_step_s = (time.perf_counter() - start) / 100_000
    return {"reads": reads, "quiet_step_s": quiet_step_s}  # rank 0's is the result's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reads", type=int, default=50)
    args = parser.parse_args()
    ray.init(num_cpus=2, logging_level="ERROR")
    trainer = TorchTrainer(
        loop,
        train_loop_config={"reads": args.reads},
        scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1 / args.workers}),
    )
    result = trainer.fit()
    ray.shutdown()
    reads = sorted(result.return_value["reads"])
    median, p90 = statistics.median(reads), reads[int(0.9 * (len(reads) - 1))]
    print(
        json.dumps(
            {
                "workers": args.workers,
                "reads": len(reads),
                "read_median_ms": round(median * 1e3, 2),
                "read_p90_ms": round(p90 * 1e3, 2),
                "quiet_step_ns": round(result.return_value["quiet_step_s"] * 1e9, 1),
                # one read per NOTICE_EVERY_S of training
                "share_of_training_time": round(median / NOTICE_EVERY_S, 6),
            }
        )
    )


if __name__ == "__main__":
    main()
