"""What a person sees: user errors as one line (exit 2) before Ray starts, a dead or stale Ray
address decided in seconds, failures that say so, and the progress lines. No Ray is started here."""

import contextlib
import io
import os
import socket

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from mdc.config import load_config
from pipelines.cli import app
from pipelines.infra import ray_connection, ray_output, run_inputs
from pipelines.infra.console import UserError, report_failures
from pipelines.infra.progress import ProgressDisplay, step_line


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_data_folder_is_one_line_and_exit_2_before_ray(tmp_path):
    missing = tmp_path / "no-such-folder" / "train"
    result = CliRunner().invoke(app, ["train", f"data.train_uri={missing}", f"storage_uri={tmp_path / 'ckpt'}"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "data.train_uri" in lines[0], result.output
    assert "Traceback" not in result.output and "Ray's own output" not in result.output


@pytest.mark.parametrize("extra, expected_val", [([], None), (["--val", "VAL"], "VAL"), (["data.val_uri=VAL"], "VAL")])
def test_data_without_val_trains_without_the_configs_validation_split(tmp_path, monkeypatch, extra, expected_val):
    """`--data X` alone must not validate on the demo config's runs/shapes/val (absent here)."""
    import pipelines.run.driver

    for folder in ("train", "VAL"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "00000.tar").write_bytes(b"")  # a shard's name: the checks list, never read it
    monkeypatch.chdir(tmp_path)
    seen = {}

    def stop_after_config(cfg):
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(ray_connection, "ray_session", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(pipelines.run.driver, "run_training", stop_after_config)
    result = CliRunner().invoke(app, ["train", "--data", "train", "--storage", "ckpt", *extra])
    assert "cfg" in seen, result.output
    expected = None if expected_val is None else str(tmp_path / expected_val)
    assert seen["cfg"].data.val_uri == expected and seen["cfg"].data.train_uri == str(tmp_path / "train")


def test_bad_config_value_names_the_field(tmp_path):
    result = CliRunner().invoke(app, ["train", "optim.lr=fast"])
    assert result.exit_code == 2 and "optim.lr" in result.output and "Traceback" not in result.output


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = run_inputs.absolute_paths(
        load_config(
            None,
            [
                "data.train_uri=shapes/train",
                "data.val_uri=shapes/val",
                "storage_uri=runs",
                "mlflow_uri=sqlite:///mlflow.db",
            ],
        )
    )
    assert cfg.data.train_uri == str(tmp_path / "shapes" / "train")
    assert cfg.data.val_uri == str(tmp_path / "shapes" / "val")
    assert cfg.storage_uri == str(tmp_path / "runs")
    assert cfg.mlflow_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    remote = run_inputs.absolute_paths(load_config(None, ["data.train_uri=s3://b/train", "storage_uri=s3://b/ck"]))
    assert (remote.data.train_uri, remote.storage_uri) == ("s3://b/train", "s3://b/ck")


def test_named_ray_address_that_does_not_answer_fails_fast(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init called with {kw}"))
    address = f"127.0.0.1:{closed_port()}"
    with pytest.raises(UserError, match=f"no Ray cluster answers at {address}"):
        ray_connection.connect_ray(address)


def test_stale_current_cluster_file_starts_a_local_instance(monkeypatch, capsys):
    import ray

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    stale = f"127.0.0.1:{closed_port()}"
    monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda *a: stale)
    ray_connection.connect_ray(num_cpus=2)
    assert [c["address"] for c in calls] == ["local"]
    assert f"names {stale}, where nothing answers" in capsys.readouterr().out


def test_every_run_failed_exits_1_with_the_first_error(capsys):
    failures = [
        ("sweep-a", "StorageError: data.val_uri: does not exist: /x", "/s/a/error.txt"),
        ("sweep-b", "StorageError: data.val_uri: does not exist: /y", "/s/b/error.txt"),
    ]
    with pytest.raises(typer.Exit) as stop:
        report_failures("trial", 2, failures)
    assert stop.value.exit_code == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "all 2 trials failed" in out and "/x" in out and "/s/a/error.txt" in out
    report_failures("trial", 3, failures)  # some failed: a warning, no exit
    out = capsys.readouterr().out
    assert "2 of 3 trials failed" in out and "/s/b/error.txt" in out


def test_a_ray_task_errors_line_is_the_original_exceptions():
    from ray.exceptions import RayTaskError

    from mdc.data.storage import StorageError
    from pipelines.infra.console import first_line_of

    cause = StorageError("data.val_uri: does not exist: /gone")
    wrapped = RayTaskError("train", '  File "trainable.py", line 1, in train\n    raise', cause).as_instanceof_cause()
    assert first_line_of(wrapped) == "data.val_uri: does not exist: /gone"
    assert first_line_of(ValueError("one\ntwo")) == "one"


def test_display_prints_logged_steps_notes_and_one_data_wait_warning():
    buf = io.StringIO()
    display = ProgressDisplay(None, Console(file=buf, width=200))
    step = {"run": "r", "kind": "step", "total": 40}
    display._show(
        [
            {**step, "step": 1, "metrics": {"loss": 9.0, "lr": 1e-4}, "logged": True},
            {**step, "step": 2, "metrics": {"loss": 8.5}, "logged": False},
            {
                **step,
                "step": 10,
                "metrics": {"loss": 7.25, "images_per_s": 12.0, "data_wait_fraction": 0.3},
                "logged": True,
            },
            {**step, "step": 20, "metrics": {"loss": 6.5, "data_wait_fraction": 0.4}, "logged": True},
            {"run": "r", "kind": "note", "text": "checkpoint at step 20", "warning": False},
        ]
    )
    lines = buf.getvalue().splitlines()
    assert lines[0] == "r step 1/40  loss 9.0000  lr 1.00e-04"
    assert [line for line in lines if "step 2/" in line] == []
    assert lines[2].startswith("r step 10/40  loss 7.2500  lr 1.00e-04  12.0 img/s  data wait 30%  ETA ")
    assert sum("waiting for data" in line for line in lines) == 1
    assert lines[-1] == "r: checkpoint at step 20"
    assert step_line("r", 5, 10, {}, 75) == "r step 5/10  ETA 1:15"


def test_a_failed_run_is_one_line_exit_1_with_its_traceback_in_the_log(tmp_path, monkeypatch):
    from pipelines.infra.console import user_errors

    monkeypatch.setattr(ray_connection, "connect_ray", lambda *a: None)
    monkeypatch.setattr(ray_connection, "ray_output_to", lambda path: contextlib.nullcontext(path))
    log = tmp_path / "ray.log"
    buf = io.StringIO()
    monkeypatch.setattr("pipelines.infra.console.console", Console(file=buf, width=300))
    with pytest.raises(typer.Exit) as stop, user_errors(), ray_connection.ray_session(log):
        raise MemoryError_("8 worker(s) were killed due to the node running low on memory.\nMemory on the node ...")
    assert stop.value.exit_code == 1
    out = buf.getvalue().strip().splitlines()
    assert out[-1] == (
        f"error: MemoryError_: 8 worker(s) were killed due to the node running low on memory. (traceback in {log})"
    )
    assert "Traceback (most recent call last)" in log.read_text()


class MemoryError_(Exception):
    """Stands in for Ray's OutOfMemoryError."""


def test_ray_output_goes_to_the_log_and_mdc_lines_to_the_console_once(tmp_path, capfd):
    import logging

    import ray._private.worker as ray_worker

    log = tmp_path / "run" / "ray.log"
    with ray_output.ray_output_to(log):
        ray_worker.print_to_stdstream(
            {"pid": "raylet", "is_err": False, "lines": ["WARNING: 8 PYTHON worker processes have been started"]},
            ignore_prefix=False,
        )
        ray_worker.print_to_stdstream(
            {
                "pid": 7,
                "is_err": False,
                "actor_name": "RayTrainWorker",
                "lines": [
                    "Reporting training result 1",
                    "[mdc] resuming from checkpoint_00000004",
                    "[mdc] resuming from checkpoint_00000004",
                ],
            },
            ignore_prefix=False,
        )
        logging.getLogger("ray.data").info("Starting execution of Dataset train_1")
        os.write(2, b"[2026-12-01 E 1 1] core_worker.cc:2465: Actor with class name\n")
        console = capfd.readouterr()
    assert console.out.splitlines() == ["resuming from checkpoint_00000004"] and console.err == ""
    text = log.read_text()
    for line in (
        "PYTHON worker processes",
        "(RayTrainWorker pid=7) Reporting training result 1",
        "Starting execution of Dataset",
        "core_worker.cc",
    ):
        assert line in text
    assert ray_worker.print_to_stdstream.__name__ == "print_to_stdstream"  # put back


AFTER_CTRL_C = """
import logging, os, sys
from pathlib import Path
import ray._private.worker as ray_worker
from pipelines.infra import ray_output
log = Path(sys.argv[1])
try:
    with ray_output.ray_output_to(log):
        raise KeyboardInterrupt
except KeyboardInterrupt:
    print("interrupted", flush=True)
# what Ray says while the process ends: a raylet notice, its logger, its C++ core on fd 2
ray_worker.print_to_stdstream({"pid": "raylet", "is_err": False, "lines": ["raylet notice"]}, ignore_prefix=False)
logging.getLogger("ray").warning("SIGTERM handler is not set")
os.write(2, b"core_worker.cc: a line\\n")
"""


def test_after_ctrl_c_ray_output_stays_in_the_log_until_the_process_ends(tmp_path):
    """Left by Ctrl-C, the route is not undone: Ray's last lines, written while the process ends,
    go to the log, and nothing follows the console's "interrupted" line (they did before)."""
    import subprocess
    import sys

    log = tmp_path / "ray.log"
    proc = subprocess.run([sys.executable, "-c", AFTER_CTRL_C, str(log)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "interrupted\n" and proc.stderr == "", (proc.stdout, proc.stderr)
    text = log.read_text()
    assert "raylet notice" in text and "SIGTERM handler is not set" in text and "core_worker.cc: a line" in text


def test_a_one_line_error_never_ends_at_a_colon():
    """Ray's dashboard failure quotes a log after a colon: the line keeps the log's last line (issue 52)."""
    from pipelines.infra.console import first_line_of

    log = "\n".join(f"2026-12-07 dashboard line {i}" for i in range(19)) + "\nOSError: [Errno 98] address in use"
    dashboard = Exception(
        f"The last 20 lines of /tmp/ray/session/logs/dashboard.log (it contains the error message from the dashboard):\n{log}"
    )
    line = first_line_of(dashboard)
    assert line.startswith("The last 20 lines of /tmp/ray/session/logs/dashboard.log")
    assert line.endswith("OSError: [Errno 98] address in use") and "\n" not in line
    assert first_line_of(ValueError("invalid config x.yaml:\n  train.steps: too small")) == (
        "invalid config x.yaml: train.steps: too small"
    )
    assert first_line_of(RuntimeError("failed:")) == "failed (no detail given)"


def test_joining_a_live_recorded_cluster_is_said_with_how_to_start_a_fresh_one(monkeypatch):
    """Ray's own rule (the live cluster its current-cluster file names) is kept, and said (issue 52)."""
    import ray

    buf = io.StringIO()
    monkeypatch.setattr(ray_connection, "console", Console(file=buf, width=300))
    monkeypatch.setattr(ray_connection, "install_output_route", lambda: None)
    monkeypatch.setattr(ray_connection.Joined, "address", None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        live = f"127.0.0.1:{head.getsockname()[1]}"
        monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda *a: live)
        ray_connection.connect_ray()
    assert [c["address"] for c in calls] == [live] and ray_connection.Joined.address == live
    assert buf.getvalue().strip() == (
        f"joined the Ray cluster at {live} (the live cluster Ray's current-cluster file names); "
        "`--address local` (or RAY_ADDRESS=local) starts a fresh local instance instead"
    )


def test_losing_the_joined_cluster_is_one_line_not_an_actor_traceback(tmp_path, monkeypatch):
    from pipelines.infra.console import user_errors

    gone = f"127.0.0.1:{closed_port()}"
    monkeypatch.setattr(ray_connection, "connect_ray", lambda *a: None)
    monkeypatch.setattr(ray_connection, "ray_output_to", lambda path: contextlib.nullcontext(path))
    monkeypatch.setattr(ray_connection.Joined, "address", gone)
    buf = io.StringIO()
    monkeypatch.setattr("pipelines.infra.console.console", Console(file=buf, width=300))
    log = tmp_path / "ray.log"
    with pytest.raises(typer.Exit) as stop, user_errors(), ray_connection.ray_session(log):
        raise RuntimeError(
            "ActorDiedError: The actor died unexpectedly before finishing this task.\n\tclass_name: ProgressChannel"
        )
    assert stop.value.exit_code == 1
    assert buf.getvalue().strip().splitlines()[-1] == (
        f"error: the Ray cluster at {gone} went away (traceback in {log}); "
        "`--address local` (or RAY_ADDRESS=local) starts a fresh local instance instead"
    )
