"""A 4-run study (2 arms × 2 seeds) one run at a time and with --max-concurrent 2, on Ray's
multi-node harness on this machine: a head with no CPU (the driver's node) and two 1-CPU worker
nodes. Each run is one 0.5-CPU training worker beside a 0.5-CPU reader, so two runs fill the 2
cores without oversubscribing them, and each run reads its rows in the same order both ways.
Reports both wall times, their ratio (goal ≤ 0.6), whether every run's final loss is the same
both ways (same seeds), and how many of the machine's cores each way kept busy (/proc/stat): two
runs at once cannot take less than the sequential study's CPU time spread over every core, so
`ratio_floor` = the sequential study's busy cores / the machine's cores bounds the ratio from below.

    python -m benchmarks.study_concurrency [--steps 20] [--out runs/bench-study-concurrency]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import yaml

from pipelines.infra.local_cluster import local_cluster


def one_worker_runs(path: Path, name: str, steps: int, images: int, log_every: int) -> Path:
    """A study plan of 2 arms × 2 seeds of one 0.5-CPU worker each, on `images` generated shapes,
    judged on the training loss alone (also tests/test_multinode.py's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = {
        "name": name,
        "seeds": [0, 1],
        "datasets": {"shapes": {"kind": "shapes", "num": images}},
        "budget": {
            "data.max_length": 16,
            "data.val_uri": None,
            "data.ingest_cpus": 0.5,  # half a CPU of ingest each: two runs fit two 1-CPU nodes
            "train.steps": steps,
            "train.batch_size": 8,
            "workers.count": 1,
            "workers.cpus": 0.5,
            "train.log_every": log_every,
            "checkpoint.every": steps,
            "optim.warmup_steps": 1,
            "eval.probes": [],  # judged on the training loss alone
            "eval.compositionality": [],
            "eval.captions": [],
        },
        "arms": {"mdc": {"objective.name": "mdc"}, "cmlm": {"objective.name": "cmlm"}},
        "claims": [{"name": "losses differ", "metric": "loss", "arm_a": "mdc", "arm_b": "cmlm"}],
    }
    path.write_text(yaml.safe_dump(plan))
    return path


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot (Linux's /proc/stat)."""
    user, nice, system, idle, iowait, *rest = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + sum(rest)) / os.sysconf("SC_CLK_TCK")


def timed_study(plan_path: Path, out: Path, max_concurrent: int) -> tuple[float, float, dict[str, float]]:
    """Wall seconds, busy cores (CPU seconds / wall seconds) and each run's final loss."""
    from pipelines.commands.study import load_plan, run_study

    tic, busy = time.perf_counter(), busy_cpu_seconds()
    run_study(load_plan(plan_path), plan_path, out, max_concurrent=max_concurrent)
    wall = time.perf_counter() - tic
    busy_cores = (busy_cpu_seconds() - busy) / wall
    losses = {
        p.parent.name: json.loads(p.read_text())["metrics"]["final_loss"]
        for p in sorted(out.glob("runs/*/result.json"))
    }
    return wall, busy_cores, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-study-concurrency"))
    args = parser.parse_args()
    out = args.out.resolve()
    plan_path = one_worker_runs(out / "plan.yaml", "bench", args.steps, images=400, log_every=args.steps)
    with local_cluster(0, {"num_cpus": 1}, {"num_cpus": 1}):
        from pipelines.commands.study import load_plan, prepare_data  # the shapes data once, outside both timings

        prepare_data(load_plan(plan_path), out / "shared")
        for name in ("sequential", "concurrent"):
            shutil.rmtree(out / name, ignore_errors=True)
            (out / name).mkdir(parents=True)
            shutil.copytree(out / "shared" / "data", out / name / "data")
        sequential, seq_busy, seq_losses = timed_study(plan_path, out / "sequential", 1)
        concurrent, con_busy, con_losses = timed_study(plan_path, out / "concurrent", 2)
    result = {
        "runs": 4,
        "steps": args.steps,
        "sequential_s": round(sequential, 1),
        "concurrent_s": round(concurrent, 1),
        "ratio": round(concurrent / sequential, 3),
        "goal": "<= 0.6",
        "cores": os.cpu_count(),
        "busy_cores": {"sequential": round(seq_busy, 2), "concurrent": round(con_busy, 2)},
        "ratio_floor": round(seq_busy / os.cpu_count(), 3),
        "same_final_losses": seq_losses == con_losses,
        "final_losses": {"sequential": seq_losses, "concurrent": con_losses},
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
