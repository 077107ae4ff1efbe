"""`make gpu-check DRY_RUN=1`: the GPU box check's own script, every step on CPU (tiny preset, gloo,
the bf16 policy), so a GPU session does not find out on the GPU that the script is broken."""

import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_dry_run_passes_every_step_and_the_relaunch_resumes(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert set(steps) == {"objectives", "accumulation", "compile", "mfu_vit_b16", "mfu_vit_l14", "real_path", "syncs"}
    assert report["device"] == "cpu" and not steps["syncs"]["counted"] and len(steps["syncs"]["cases"]) == 10
    assert all(step["ok"] for step in steps.values()) and report["ok"]
    assert len(steps["objectives"]["cases"]) == 10 and not steps["objectives"]["failed"]
    assert steps["compile"]["compiled"] and steps["compile"]["recompiles"] == []
    assert steps["real_path"]["resumed"] and [c["exit"] for c in steps["real_path"]["commands"]] == [0, 0, 0]


def test_a_failed_step_fails_the_check(tmp_path, monkeypatch):
    """The check is not a formality: a step whose process fails makes the whole check exit 1."""
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "TIMEOUT_S", {"accumulation": 60})
    monkeypatch.setattr(gpu_check, "STEPS_IN_PROCESS", {"accumulation": gpu_check.step_accumulation})
    monkeypatch.setattr(gpu_check, "run", lambda cmd, timeout, env=None: (1, "boom", 0.1))
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--dry-run", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main()
    assert exit_info.value.code == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["steps"]["accumulation"] == {"ok": False, "seconds": 0.1, "output_tail": "boom"}


def test_a_dry_run_runs_on_cpu_even_on_a_gpu_box(tmp_path, monkeypatch):
    """Every step of a dry run computes on CPU, each step's process told so: a dry run on a GPU box
    checks the script, as on CI, and its JSON's "device" ("cpu") is the truth."""
    from benchmarks import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "DRY_RUN", True)
    assert gpu_check.device() == "cpu"
    commands = []
    monkeypatch.setattr(gpu_check, "run", lambda cmd, timeout, env=None: commands.append(cmd) or (1, "", 0.1))
    gpu_check.check("syncs", True, tmp_path)
    gpu_check.check("mfu_vit_b16", True, tmp_path)
    assert "--dry-run" in commands[0] and commands[1][-4:-2] == ["--device", "cpu"]
    monkeypatch.setattr(gpu_check, "DRY_RUN", False)
    assert gpu_check.device() == "cuda"
