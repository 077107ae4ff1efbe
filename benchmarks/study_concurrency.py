"""A 4-run study (2 arms × 2 seeds) one run at a time and with --max-concurrent 2, on Ray's
multi-node harness on this machine: a head with no CPU (the driver's node) and two 1-CPU worker
nodes. Each run is one 0.5-CPU training worker beside its ingest (0.5 CPU when two share the
cluster), so two runs fill the 2 cores without oversubscribing them. Reports both wall times,
their ratio (goal ≤ 0.6) and whether every run's final loss is the same both ways (same seeds).

    python -m benchmarks.study_concurrency [--steps 20] [--out runs/bench-study-concurrency]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import ray
import yaml

from pipelines import ray_private


def plan(path: Path, steps: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        yaml.safe_dump(
            {
                "name": "bench",
                "seeds": [0, 1],
                "datasets": {"shapes": {"kind": "shapes", "num": 400}},
                "budget": {
                    "data.max_length": 16,
                    "data.val_uri": None,
                    "train.steps": steps,
                    "train.batch_size": 8,
                    "train.num_workers": 1,
                    "train.cpus_per_worker": 0.5,
                    "train.log_every": steps,
                    "train.checkpoint_every": steps,
                    "optim.warmup_steps": 1,
                },
                "arms": {"mdc": {"objective.name": "mdc"}, "cmlm": {"objective.name": "cmlm"}},
                "evaluations": {"probe": False, "compositionality": False, "caption_lengths": []},
                "claims": [{"name": "losses differ", "metric": "final_loss", "arm_a": "mdc", "arm_b": "cmlm"}],
            }
        )
    )
    return path


@contextlib.contextmanager
def harness(nodes: int = 2, cpus: int = 1):
    """Ray's multi-node test cluster on this machine, connected; its current-cluster file removed after."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 200 * 1024**2}, connect=False
    )
    for _ in range(nodes):
        cluster.add_node(num_cpus=cpus, object_store_memory=200 * 1024**2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        address = cluster.address
        cluster.shutdown()
        ray_private.forget_recorded_address(address)


def timed_study(plan_path: Path, out: Path, max_concurrent: int) -> tuple[float, dict[str, float]]:
    from pipelines.study import load_plan, run_study

    tic = time.perf_counter()
    run_study(load_plan(plan_path), plan_path, out, max_concurrent=max_concurrent)
    wall = time.perf_counter() - tic
    losses = {
        p.parent.name: json.loads(p.read_text())["metrics"]["final_loss"]
        for p in sorted(out.glob("runs/*/result.json"))
    }
    return wall, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-study-concurrency"))
    args = parser.parse_args()
    out = args.out.resolve()
    plan_path = plan(out / "plan.yaml", args.steps)
    with harness():
        from pipelines.study import load_plan, prepare_data  # the shapes data once, outside both timings

        prepare_data(load_plan(plan_path), out / "shared")
        for name in ("sequential", "concurrent"):
            shutil.rmtree(out / name, ignore_errors=True)
            (out / name).mkdir(parents=True)
            shutil.copytree(out / "shared" / "data", out / name / "data")
        sequential, seq_losses = timed_study(plan_path, out / "sequential", 1)
        concurrent, con_losses = timed_study(plan_path, out / "concurrent", 2)
    result = {
        "runs": 4,
        "steps": args.steps,
        "sequential_s": round(sequential, 1),
        "concurrent_s": round(concurrent, 1),
        "ratio": round(concurrent / sequential, 3),
        "goal": "<= 0.6",
        "same_final_losses": seq_losses == con_losses,
        "final_losses": {"sequential": seq_losses, "concurrent": con_losses},
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
