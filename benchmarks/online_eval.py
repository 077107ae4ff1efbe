"""What evaluation during training costs the training: the same run (tiny MDC on the shapes data,
local Ray, two workers) with and without `eval.probe_every`, in one process, one after the other.
Reports each run's median throughput over its logged steps (MLflow `images_per_s`), their ratio
and the steps the probe was logged at.

    python -m benchmarks.online_eval [--steps 200 --every 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray
from mlflow.tracking import MlflowClient

from mdc.config import load_config
from mdc.data.shapes import write_shapes_dataset
from mdc.evaluation import suite
from pipelines.run.driver import run_training

PROBE = suite.probe_key("shapes")


def run(root: Path, name: str, steps: int, every: int | None) -> dict:
    overrides = [
        f"name={name}",
        f"storage_uri={root / 'ckpt'}",
        f"mlflow_uri=sqlite:///{root / 'mlflow.db'}",
        f"data.train_uri={root / 'shapes' / 'train'}",
        "data.val_uri=null",
        f"train.steps={steps}",
        "train.log_every=10",
        f"checkpoint.every={steps}",
    ]
    if every:
        overrides += [f"eval.probe_every={every}", f"eval.probes=[{{dataset: shapes, root: {root / 'shapes'}}}]"]
    cfg = load_config(None, overrides)
    tic = time.perf_counter()
    summary = run_training(cfg)
    wall = time.perf_counter() - tic
    client = MlflowClient(cfg.mlflow_uri)
    speed = [m.value for m in client.get_metric_history(summary.mlflow_run_id, "images_per_s") if m.step > 10]
    probed = sorted((m.step, round(m.value, 4)) for m in client.get_metric_history(summary.mlflow_run_id, PROBE))
    return {"median_images_per_s": statistics.median(speed), "wall_s": wall, "probe": probed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    ray.init(num_cpus=2, object_store_memory=512 * 1024**2, include_dashboard=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_shapes_dataset(str(root / "shapes"), num=2000, seed=0, samples_per_shard=250)
        plain = run(root, "plain", args.steps, None)
        online = run(root, "online", args.steps, args.every)
    ratio = online["median_images_per_s"] / plain["median_images_per_s"]
    print(json.dumps({"without": plain, "with": online, "throughput_with_over_without": ratio}, indent=2))
    print(
        f"online probe every {args.every} steps: logged at {[s for s, _ in online['probe']]}; training throughput "
        f"{ratio:.3f}× the run without it (median images/s {online['median_images_per_s']:.1f} vs "
        f"{plain['median_images_per_s']:.1f}); wall {online['wall_s']:.0f} s vs {plain['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
