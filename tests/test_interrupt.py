"""Ctrl-C stops runs at once: SIGINT to a real `mdc study --max-concurrent 2` (the smoke plan) while
two runs train ends the process within 30 s (not when training ends), the MLflow runs end KILLED,
and the same command run again resumes the interrupted runs from their checkpoints and finishes
the study: its report, plot and MLflow record; a third launch trains and evaluates nothing."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines.commands.study import CLAIM_FIELDS
from pipelines.infra import tracking
from pipelines.run import concurrency

REPO = Path(__file__).resolve().parent.parent
MDC = str(Path(sys.executable).parent / "mdc")
STEPS, EVERY = 12, 4  # a run trains long enough to be interrupted, with checkpoints to resume from
STEP_LINE = re.compile(r"(smoke-\w+-s\d) step (\d+)/")
EXIT_WITHIN_S = 30


@pytest.mark.parametrize("max_concurrent", [1, 2])
def test_ctrl_c_in_run_all_returns_at_once_cancels_what_has_not_started_and_kills_the_runs(monkeypatch, max_concurrent):
    """KeyboardInterrupt reaches the main thread, waiting in run_all, while one or two calls block
    (one at a time too: `mdc train` and a study at --max-concurrent 1 take this path)."""
    monkeypatch.setattr(tracking, "kill_open_runs", lambda: killed.append(True))
    killed, started, release = [], [], threading.Event()

    def blocking(key):
        started.append(key)
        release.wait(60)  # a run that would train for a minute more

    # Python's own handler, as the `mdc` process has it: a Ray an earlier test started installs its own
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # a real SIGINT, as Ctrl-C sends
    tic = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            concurrency.run_all({key: lambda key=key: blocking(key) for key in "abc"}, max_concurrent)
    finally:
        signal.signal(signal.SIGINT, previous)
        release.set()
    assert time.monotonic() - tic < 5 and killed == [True]
    time.sleep(0.2)
    assert sorted(started) == ["a", "b"][:max_concurrent]  # the rest cancelled, not started when a slot freed


def test_sigterm_stops_a_command_as_ctrl_c_does(monkeypatch):
    """`kill`, `timeout` or a scheduler's cancel (SIGTERM) ends the runs KILLED and exits 130, as
    Ctrl-C does (before, the process died and left its MLflow runs RUNNING); the handler is the
    previous one again afterwards."""
    import typer

    from pipelines.infra.console import user_errors

    monkeypatch.setattr(tracking, "kill_open_runs", lambda: killed.append(True))
    killed, release, previous = [], threading.Event(), signal.getsignal(signal.SIGTERM)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    tic = time.monotonic()
    try:
        with pytest.raises(typer.Exit) as stop, user_errors():
            concurrency.run_all({"a": lambda: release.wait(60)}, 1)
    finally:
        release.set()
    assert stop.value.exit_code == 130 and killed == [True] and time.monotonic() - tic < 5
    assert signal.getsignal(signal.SIGTERM) is previous


def test_after_ctrl_c_every_open_run_ends_killed_and_a_failure_too(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "_OPEN", {})
    monkeypatch.setattr(tracking, "_INTERRUPTED", threading.Event())
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ids = [tracking.get_or_create_run(uri, "mdc", name, {}) for name in ("done", "open", "torn-down")]
    tracking.finish_run(uri, ids[0])
    assert tracking.kill_open_runs() == ids[1:]
    tracking.finish_run(uri, ids[2], "FAILED")  # its trainer, torn down by the exit, fails afterwards
    client = MlflowClient(uri)
    assert [client.get_run(i).info.status for i in ids] == ["FINISHED", "KILLED", "KILLED"]


def plan_file(tmp_path: Path) -> Path:
    """The smoke plan (2 arms × 2 seeds, evaluated, two claims), long enough to be interrupted."""
    plan = yaml.safe_load((REPO / "studies" / "smoke.yaml").read_text())
    plan["budget"].update({"train.steps": STEPS, "train.log_every": EVERY, "checkpoint.every": EVERY})
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def study(plan: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [MDC, "study", "--plan", str(plan), "--out", str(out), "--max-concurrent", "2", "--address", "local"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: the test ends what is left of it, and nothing else
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )


def read_lines(proc: subprocess.Popen, lines: list[str]) -> threading.Thread:
    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_ctrl_c_stops_a_study_at_once_and_the_same_command_resumes_it(tmp_path):
    plan, out, lines = plan_file(tmp_path), tmp_path / "out", []
    first = study(plan, out)
    try:
        pump = read_lines(first, lines)
        training = set()
        deadline = time.monotonic() + 300
        while len(training) < 2:  # two runs past their first checkpoint, at once
            training = {m[1] for line in lines if (m := STEP_LINE.search(line)) and EVERY < int(m[2]) < STEPS}
            assert first.poll() is None and time.monotonic() < deadline, "\n".join(lines[-40:])
            time.sleep(0.2)
        sent = time.monotonic()
        first.send_signal(signal.SIGINT)
        code = first.wait(timeout=120)
        took = time.monotonic() - sent
        pump.join(timeout=10)
    finally:
        stop_group(first)
    said = "\n".join(lines)
    print(f"SIGINT while {sorted(training)} trained; exit {code} after {took:.1f} s")
    assert took < EXIT_WITHIN_S, said[-3000:]
    assert code == 130 and "interrupted: runs stopped" in said, said[-3000:]
    assert lines[-1].startswith("interrupted: "), said[-3000:]  # Ray's last lines went to its log file
    assert "Traceback" not in said, said[-3000:]

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mdc").experiment_id
    status = {r.data.tags["mdc.run_name"]: r.info.status for r in client.search_runs([experiment])}
    assert all(status[name] == "KILLED" for name in training), status
    assert status["study-smoke"] == "KILLED" and "RUNNING" not in status.values(), status

    relaunched = time.monotonic()
    output = finish(study(plan, out))
    print(f"relaunch finished the study in {time.monotonic() - relaunched:.0f} s")
    runs = {r.data.tags["mdc.run_name"]: r for r in client.search_runs([experiment])}
    assert all(run.info.status == "FINISHED" for run in runs.values()), {k: r.info.status for k, r in runs.items()}
    for name in training:  # resumed: the steps before the checkpoint it resumed from were logged once
        steps = [m.step for m in client.get_metric_history(runs[name].info.run_id, "loss")]
        assert steps.count(EVERY) == 1 and max(steps) == STEPS, (name, sorted(steps))
    assert_report(out, client, runs)

    output = finish(study(plan, out))  # everything is done: nothing is trained or evaluated again
    again = {r.data.tags["mdc.run_name"]: r for r in client.search_runs([experiment])}
    assert {k: (r.info.run_id, r.info.end_time) for k, r in again.items() if k != "study-smoke"} == {
        k: (r.info.run_id, r.info.end_time) for k, r in runs.items() if k != "study-smoke"
    }
    assert not STEP_LINE.search(output), output[-3000:]


def finish(proc: subprocess.Popen) -> str:
    try:
        output, _ = proc.communicate(timeout=400)
    finally:
        stop_group(proc)
    assert proc.returncode == 0, output[-3000:]
    return output


def assert_report(out: Path, client: MlflowClient, runs: dict) -> None:
    """study.json's claims with their paired intervals over seeds 0 and 1, results.md, claims.png, and
    the parent MLflow run with the claims and the same three files; four child runs."""
    report = json.loads((out / "study.json").read_text())
    assert [c["name"] for c in report["claims"]] == [
        "MDC beats CMLM on the linear probe",
        "MDC matches CMLM on VG-Relation",
    ]
    for claim in report["claims"]:
        assert set(CLAIM_FIELDS) <= set(claim) and claim["seeds"] == [0, 1] and len(claim["values_a"]) == 2
        assert claim["ci_low"] <= claim["mean_diff"] <= claim["ci_high"]
        assert claim["verdict"] in ("holds", "reversed", "inconclusive")
    results = (out / "results.md").read_text()
    assert "| MDC beats CMLM on the linear probe | eval/probe/shapes/accuracy | mdc | cmlm |" in results
    assert (out / "claims.png").read_bytes()[:4] == b"\x89PNG"
    parent = runs["study-smoke"]
    assert "claims/0/mean_diff" in parent.data.metrics
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "eval")} == {
        "eval/study.json",
        "eval/results.md",
        "eval/claims.png",
    }
    children = [r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["mdc.run_name"] for r in children) == [
        "smoke-cmlm-s0",
        "smoke-cmlm-s1",
        "smoke-mdc-s0",
        "smoke-mdc-s1",
    ]
