"""Can Ray Train's own validation on reported checkpoints (`ValidationConfig`, Ray 2.60, alpha)
replace mdc's evaluation queue (pipelines/run/online_eval.py)? Measured on a local Ray of 2 CPUs with
the layout of an mdc run: two training workers of 0.5 CPU, ingest holding 0.5 CPU (an actor stands
in), rank 0 reporting a pointer checkpoint (a small folder naming the real one, as Ray's own error
message advises for checkpoints written elsewhere) every `--every` steps with `validation=True`, every
other rank reporting metrics only. The validation function stands in for a probe: it sleeps
`--probe-s` seconds and records when it ran.

Cases, each a fresh TorchTrainer:
- `free`: validation asks 0.5 CPU with nothing else running: does it run while training?
- `contended`: a second job takes the free 0.5 CPU after training starts (another run of a study,
  or its ingest): when do the validations run?
- `reserved`: a 0.5-CPU placement group made before the worker group and the validation task
  scheduled into it through `ray_remote_kwargs` (what the queue's bundle does): the cluster is full
  (ingest, workers, the bundle), so nothing else can take the validation's CPU.
- `pruned`: as `free`, with the checkpoint the pointer names deleted right after the report (what
  `checkpoint.keep` does to an older checkpoint while evaluations queue up).
Also timed: a report that carries a pointer checkpoint against one that carries metrics only.

    python -m benchmarks.validation_config [--steps 30 --every 10 --probe-s 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ray
import ray.train
from ray.train import Checkpoint, CheckpointUploadMode
from ray.train.torch import TorchTrainer
from ray.train.v2.api.validation_config import ValidationConfig, ValidationTaskConfig
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

STEP_S = 0.3  # a training step's stand-in


def train_loop(config: dict) -> None:
    """`steps` steps; every `every` steps rank 0 writes the 'real' checkpoint, then every rank
    reports (rank 0 with a pointer to it and validation=True); every `log_every` steps between
    them every rank reports metrics only (mdc reports at train.log_every)."""
    rank = ray.train.get_context().get_world_rank()
    timings = {"with_checkpoint": [], "metrics_only": [], "reported_at": []}
    for step in range(1, config["steps"] + 1):
        time.sleep(STEP_S)
        if step % config["every"] and step % config["log_every"]:
            continue
        if step % config["every"]:
            tic = time.perf_counter()
            ray.train.report({"step": step})
            timings["metrics_only"].append(time.perf_counter() - tic)
            continue
        checkpoint = None
        real = Path(config["root"], f"checkpoint_{step:08d}")
        with tempfile.TemporaryDirectory() as pointer:
            if rank == 0:
                real.mkdir(parents=True, exist_ok=True)
                (real / "weights.json").write_text(json.dumps({"step": step}))
                (Path(pointer) / "pointer.json").write_text(json.dumps({"uri": str(real), "step": step}))
                checkpoint = Checkpoint.from_directory(pointer)
            tic = time.perf_counter()
            ray.train.report(
                {"step": step},
                checkpoint=checkpoint,
                checkpoint_upload_mode=CheckpointUploadMode.SYNC,
                validation=checkpoint is not None,
            )
            timings["with_checkpoint"].append(time.perf_counter() - tic)
            timings["reported_at"].append(time.time())
        if rank == 0 and config["prune"]:
            shutil.rmtree(real)
    if rank == 0:
        Path(config["root"], "timings.json").write_text(json.dumps({**timings, "loop_end": time.time()}))


def probe_stand_in(checkpoint: Checkpoint, log: str, probe_s: float) -> dict:
    """Reads the real checkpoint the pointer names (as a probe reads the weights), then sleeps."""
    start = time.time()
    with checkpoint.as_directory() as directory:
        pointer = json.loads(Path(directory, "pointer.json").read_text())
    weights = json.loads(Path(pointer["uri"], "weights.json").read_text())  # raises when pruned
    time.sleep(probe_s)
    with open(log, "a") as f:
        f.write(json.dumps({"step": weights["step"], "start": start, "end": time.time()}) + "\n")
    return {"probe": float(weights["step"])}


@ray.remote(num_cpus=0.5)
class Holder:
    """Holds half a CPU: ingest's readers, or another run's work."""

    def ready(self) -> bool:
        return True


def run_case(case: str, root: Path, steps: int, every: int, probe_s: float) -> dict:
    root.mkdir(parents=True)
    log = root / "validations.jsonl"
    ingest = Holder.remote()
    ray.get(ingest.ready.remote())
    reserved = placement_group([{"CPU": 0.5}]) if case == "reserved" else None
    remote_kwargs = {"num_cpus": 0.5}
    if reserved is not None:
        ray.get(reserved.ready())
        remote_kwargs["scheduling_strategy"] = PlacementGroupSchedulingStrategy(reserved, 0)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "steps": steps,
            "every": every,
            "log_every": max(1, every // 2),
            "root": str(root / "real"),
            "prune": case == "pruned",
        },
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(name=case, storage_path=str(root / "ray")),
        validation_config=ValidationConfig(
            probe_stand_in,
            ValidationTaskConfig({"log": str(log), "probe_s": probe_s}),
            ray_remote_kwargs=remote_kwargs,
        ),
    )
    other = None
    tic = time.time()
    if case == "contended":
        other = Holder.remote()  # takes the free half CPU before the validations ask for it
    result = trainer.fit()
    fit_end = time.time()
    timings = json.loads((root / "real" / "timings.json").read_text())
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    for actor in (ingest, other):
        if actor is not None:
            ray.kill(actor)
    if reserved is not None:
        remove_placement_group(reserved)
    training_end = timings["loop_end"]
    return {
        "case": case,
        "validations_run": len(runs),
        "validations_expected": steps // every,
        "started_s_after_fit_began": [round(r["start"] - tic, 1) for r in runs],
        "started_s_after_its_report": [
            round(r["start"] - at, 1) for r, at in zip(sorted(runs, key=lambda r: r["step"]), timings["reported_at"])
        ],
        "fit_s": round(fit_end - tic, 1),
        "training_loop_ended_s": round(training_end - tic, 1),
        "validations_started_during_training": sum(r["start"] < training_end for r in runs),
        "best_checkpoints_metrics": [m for _, m in (result.best_checkpoints or [])],
        "report_with_checkpoint_ms": round(1000 * statistics.median(timings["with_checkpoint"]), 1),
        "report_metrics_only_ms": round(1000 * statistics.median(timings["metrics_only"]), 1),
        "error": repr(result.error) if result.error else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--probe-s", type=float, default=3.0)
    parser.add_argument("--cases", default="free,contended,reserved,pruned")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, object_store_memory=256 * 1024**2, include_dashboard=False)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            print(json.dumps(run_case(case, Path(tmp, case), args.steps, args.every, args.probe_s)), flush=True)


if __name__ == "__main__":
    main()
