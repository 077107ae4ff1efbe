"""`make gpu-check`: is this GPU box ready to spend GPU-hours on? Every piece of the GPU path, each
in its own process under its own timeout, one JSON at the end.

    python -m benchmarks.gpu_check [--dry-run] [--out runs/gpu-check/result.json]

Steps: one bf16 training step per objective (FSDP2 bf16 policy, NCCL), float32 optimiser state,
EMA and exported weights, and a DCP save + restore; accumulation 4 × B against 1 × 4B; ViT-B/16
compiled with activation checkpointing under TORCH_LOGS=recompiles,graph_breaks (a recompile
fails it); the MFU benchmark for ViT-B/16 and ViT-L/14, each in its own process; and the real path:
`mdc data shapes`, `mdc train` on the GPU with compile, activation checkpointing, async checkpoints
and EMA for 30 steps, then a relaunch that must resume; and the host syncs of an MDC training step
(each objective's, under `torch.cuda.set_sync_debug_mode`: every sync that stays, per step).
`--dry-run` runs the same steps on CPU with the tiny preset and gloo (the bf16 policy included),
so CI proves the script itself works: on CPU wherever it runs, a GPU box included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CASES = {
    **{name: [f"objective.name={name}"] for name in ("mdc", "cmlm", "bert", "ar", "cappa", "clip", "cdlm")},
    "mdc+time_conditioning": ["objective.name=mdc", "model.time_conditioning=true"],
    "mdc+predict_length": ["objective.name=mdc", "model.predict_length=true"],
    "mdc+image_free_prob": ["objective.name=mdc", "objective.image_free_prob=0.5"],
}
LENGTH = 16
DRY_RUN = False  # set by --dry-run, in the parent and in each step's process


def device() -> str:
    """CUDA on a GPU box; CPU in a dry run, even there."""
    return "cuda" if torch.cuda.is_available() and not DRY_RUN else "cpu"


def one_rank_group() -> None:
    """FSDP2 needs a process group: a group of one (NCCL on the GPU, gloo on CPU)."""
    from benchmarks.train_throughput import init_single_process_group

    init_single_process_group(True, device())


def bf16_model(overrides: list[str], preset: str):
    from mdc import registry
    from mdc.config import load_config
    from mdc.data.tokenizer import CaptionTokenizer
    from mdc.training.fsdp import apply_fsdp
    from mdc.training.step import EMA, build_optimizer, build_scheduler

    cfg = load_config(None, [f"model.preset={preset}", f"data.max_length={LENGTH}", "optim.ema_decay=0.99", *overrides])
    torch.manual_seed(0)
    model = registry.build_model(cfg, CaptionTokenizer).to(device())
    apply_fsdp(model, bf16=True)
    optimizer = build_optimizer(model, cfg.optim)
    return cfg, model, optimizer, build_scheduler(optimizer, 1, 10), EMA(model, 0.99)


def full_captions(n: int, size: int):
    """Images and captions with no pad: every micro-batch has as many tokens (exact accumulation)."""
    gen = torch.Generator().manual_seed(1)
    images = torch.rand(n, 3, size, size, generator=gen).to(device())
    return images, torch.randint(0, 1000, (n, LENGTH), generator=gen).to(device())


def local_dtypes(tensors) -> list[str]:
    return sorted({str((t.to_local() if hasattr(t, "to_local") else t).dtype) for t in tensors})


def step_objectives(preset: str, work: Path) -> dict:
    """Per objective: a bf16 step, what stays float32, and a DCP save + restore."""
    from mdc.models.captioner import PRESETS
    from mdc.training import checkpoint as ckpt
    from mdc.training.step import train_step

    one_rank_group()
    out = {}
    for case, overrides in CASES.items():
        cfg, model, optimizer, scheduler, ema = bf16_model(overrides, preset)
        images, tokens = full_captions(4, PRESETS[preset].image_size)
        metrics = train_step(
            model,
            optimizer,
            scheduler,
            images,
            tokens,
            cfg.objective,
            1.0,
            generator=torch.Generator(device()).manual_seed(2),
            ema=ema,
        )
        uri = ckpt.checkpoint_dir(str(work / case), 1)
        stage = Path(tempfile.mkdtemp(dir=work))
        ckpt.stage_training_state(stage, model, optimizer, ema, {"scheduler": scheduler}, rank=0)
        ckpt.commit(uri, 1, ckpt.upload_shard(stage, uri), 0)
        _, fresh, fresh_opt, fresh_sched, fresh_ema = bf16_model(overrides + ["train.seed=5"], preset)
        ckpt.load_training_state(uri, fresh, fresh_opt, fresh_ema, {"scheduler": fresh_sched})
        restored = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters()))
        moments = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
        dtypes = {
            "params": local_dtypes(model.parameters()),
            "optimizer": local_dtypes(moments),
            "ema": local_dtypes(ema.state_dict().values()),
            "exported": local_dtypes(ckpt.full_weights(fresh, fresh_ema).values()),
        }
        ok = torch.isfinite(torch.tensor(metrics["loss"])).item() and restored
        ok = ok and all(v == ["torch.float32"] for v in dtypes.values())
        out[case] = {"ok": bool(ok), "loss": metrics["loss"], "restored": restored, "dtypes": dtypes}
    failed = [case for case, r in out.items() if not r["ok"]]
    return {"ok": not failed, "failed": failed, "cases": out}


def step_accumulation(preset: str, work: Path) -> dict:
    """4 micro-batches of B and one batch of 4B give the same loss and gradient, to bf16 tolerance
    (AR: no noise draws, and captions without pad, so every micro-batch has as many tokens)."""
    from mdc.models.captioner import PRESETS
    from mdc.training.step import train_step

    one_rank_group()
    images, tokens = full_captions(16, PRESETS[preset].image_size)
    runs = {}
    for micro in (4, 1):
        cfg, model, optimizer, scheduler, _ = bf16_model(["objective.name=ar"], preset)
        runs[micro] = train_step(model, optimizer, scheduler, images, tokens, cfg.objective, 1e9, micro_batches=micro)
    rel = {k: abs(runs[4][k] - runs[1][k]) / abs(runs[1][k]) for k in ("loss", "grad_norm")}
    return {"ok": max(rel.values()) < 1e-2, "relative_diff": rel, "tolerance": 1e-2, "runs": runs}


def step_compile(preset: str, work: Path) -> dict:
    """Compiled blocks with activation checkpointing, 4 steps of one shape; the parent reads the
    recompile and graph-break log this process writes to stderr."""
    from mdc import registry
    from mdc.config import load_config
    from mdc.data.tokenizer import CaptionTokenizer
    from mdc.models.captioner import PRESETS
    from mdc.training.fsdp import compile_available, prepare_model
    from mdc.training.step import build_optimizer, build_scheduler, train_step

    one_rank_group()
    why_not = compile_available(device())
    cfg = load_config(None, [f"model.preset={preset}", f"data.max_length={LENGTH}"])
    torch.manual_seed(0)
    model = registry.build_model(cfg, CaptionTokenizer).to(device())
    prepare_model(model, device(), bf16=True, activation_checkpointing=True, compile=True)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, 1, 10)
    images, tokens = full_captions(8, PRESETS[preset].image_size)
    times = []
    for i in range(4):
        tic = time.perf_counter()
        train_step(
            model,
            optimizer,
            scheduler,
            images,
            tokens,
            cfg.objective,
            1.0,
            generator=torch.Generator(device()).manual_seed(i),
        )
        if device() == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
    return {"ok": why_not is None, "compiled": why_not is None, "why_not": why_not, "step_s": times}


def step_syncs(preset: str, work: Path) -> dict:
    """Host syncs per training step (`device_step`, which reads nothing back), per objective: the
    warnings `torch.cuda.set_sync_debug_mode("warn")` raises over 3 steps after a warm-up one. The
    MDC objective's step must make none. On CPU there is no device to wait for: nothing counted."""
    import warnings

    from mdc.models.captioner import PRESETS
    from mdc.training.step import device_step

    one_rank_group()
    cuda, out = device() == "cuda", {}
    for case, overrides in CASES.items():
        cfg, model, optimizer, scheduler, ema = bf16_model(overrides, preset)
        images, tokens = full_captions(4, PRESETS[preset].image_size)
        tokens[::2, LENGTH // 2 :] = 49409  # pad: half the captions end halfway
        per_step = []
        for i in range(4):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda and i:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    generator = torch.Generator(device()).manual_seed(i)
                    device_step(
                        model, optimizer, scheduler, images, tokens, cfg.objective, 1.0, generator=generator, ema=ema
                    )
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
            if i:
                per_step.append(len(syncs))
        out[case] = {"syncs_per_step": per_step if cuda else None, "first": syncs[:3] if cuda else []}
    mdc_syncs = out["mdc"]["syncs_per_step"]
    return {"ok": not cuda or mdc_syncs == [0, 0, 0], "counted": cuda, "cases": out}


def mfu_command(preset: str, dry: bool, out: Path) -> list[str]:
    if dry:
        args = ["--presets", "tiny", "--batch", "8", "--steps", "3", "--fsdp", "--device", "cpu"]
    else:
        args = ["--presets", preset, "--batch", {"vit_b16": "64", "vit_l14": "32"}[preset], "--steps", "30"]
        args += ["--bf16", "--fsdp", "--compile"]
    return [sys.executable, "-m", "benchmarks.train_throughput", *args, "--out", str(out)]


def real_path_commands(dry: bool, work: Path) -> list[list[str]]:
    """`mdc data shapes`, `mdc train` for 30 steps (checkpoints every 10), then the same run to 40;
    on CPU (dry run) 6 steps (every 3) and then 8: the same paths, a third of the time."""
    first, last, every = (6, 8, 3) if dry else (30, 40, 10)
    mdc = [sys.executable, "-m", "pipelines.cli"]
    common = ["--data", str(work / "shapes/train"), "--val", str(work / "shapes/val"), "--storage", str(work / "ckpt")]
    common += ["--mlflow-uri", f"sqlite:///{work / 'mlflow.db'}", "--name", "gpu-check", "--verbose"]
    common += ["compute.compile=true", "compute.activation_checkpointing=true", "checkpoint.background=true"]
    common += [
        "optim.ema_decay=0.999",
        f"checkpoint.every={every}",
        f"train.log_every={every}",
        f"validation.every={every}",
    ]
    if dry:
        common += ["--num-workers", "1", "workers.cpus=1", "train.batch_size=8", "--no-use-gpu"]
    else:
        common += ["--num-workers", "1", "--use-gpu", "train.batch_size=64", "model.preset=vit_b16"]
    return [
        [*mdc, "data", "shapes", "--out", str(work / "shapes"), "--num", "600"],
        [*mdc, "train", *common, f"train.steps={first}"],
        [*mdc, "train", *common, f"train.steps={last}"],
    ]


STEPS_IN_PROCESS = {
    "objectives": step_objectives,
    "accumulation": step_accumulation,
    "compile": step_compile,
    "syncs": step_syncs,
}
TIMEOUT_S = {
    "objectives": 90,
    "accumulation": 60,
    "compile": 120,
    "mfu_vit_b16": 90,
    "mfu_vit_l14": 120,
    "real_path": 240,
    "syncs": 90,
}


def run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, the output's tail, seconds)."""
    tic = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, output = None, f"timed out after {timeout:.0f} s\n{err.stdout or ''}{err.stderr or ''}"
    return code, output, time.perf_counter() - tic


def recompiles(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r"[Rr]ecompil", line)]


def check(name: str, dry: bool, work: Path) -> dict:
    """One step in its own process(es); its result, with the seconds it took."""
    timeout = TIMEOUT_S[name] * (3 if dry else 1)
    preset = "tiny" if dry else {"compile": "vit_b16"}.get(name, "tiny")
    if name in STEPS_IN_PROCESS:
        result_file = work / f"{name}.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--step", name, "--preset", preset, "--work", str(work)]
        cmd += ["--dry-run"] if dry else []
        env = {**os.environ, **({"TORCH_LOGS": "recompiles,graph_breaks"} if name == "compile" else {})}
        code, output, seconds = run(cmd, timeout, env)
        result = json.loads(result_file.read_text()) if code == 0 and result_file.exists() else {"ok": False}
        if name == "compile":
            result["recompiles"] = recompiles(output)
            result["ok"] = result["ok"] and not result["recompiles"]
    elif name.startswith("mfu_"):
        out = work / f"{name}.json"
        code, output, seconds = run(mfu_command(name.removeprefix("mfu_"), dry, out), timeout)
        result = {"ok": code == 0, "runs": json.loads(out.read_text()) if code == 0 else None}
    else:  # real_path
        result, seconds, code, output = {"ok": True, "commands": []}, 0.0, 0, ""
        for cmd in real_path_commands(dry, work):
            code, output, took = run(cmd, timeout)
            seconds += took
            result["commands"].append({"command": " ".join(cmd[2:5]), "exit": code, "seconds": round(took, 1)})
            if code != 0:
                break
        result["resumed"] = code == 0 and "resuming from" in output
        result["ok"] = code == 0 and result["resumed"]
    result["seconds"] = round(seconds, 1)
    if not result["ok"]:
        result["output_tail"] = output[-3000:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, gloo: checks the script")
    parser.add_argument("--out", default="runs/gpu-check/result.json")
    parser.add_argument("--only", default=None, help="comma-separated step names")
    parser.add_argument("--step", default=None, help=argparse.SUPPRESS)  # a child process: one in-process step
    parser.add_argument("--preset", default="tiny", help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DRY_RUN
    DRY_RUN = args.dry_run
    if args.step:
        work = Path(args.work)
        result = STEPS_IN_PROCESS[args.step](args.preset, work)
        (work / f"{args.step}.json").write_text(json.dumps(result, indent=2))
        return
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu-check: no CUDA device here; `make gpu-check DRY_RUN=1` checks the script on CPU")
    names = args.only.split(",") if args.only else list(TIMEOUT_S)
    report = {"dry_run": args.dry_run, "device": torch.cuda.get_device_name() if not args.dry_run else "cpu"}
    report["torch"], report["steps"] = torch.__version__, {}
    with tempfile.TemporaryDirectory(prefix="mdc-gpu-check-") as directory:
        for name in names:
            result = check(name, args.dry_run, Path(directory))
            report["steps"][name] = result
            print(f"gpu-check {name}: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']} s)", flush=True)
    report["ok"] = all(r["ok"] for r in report["steps"].values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"gpu-check: {'all steps passed' if report['ok'] else 'FAILED'}; {args.out}")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
