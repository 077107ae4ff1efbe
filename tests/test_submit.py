"""`mdc submit` against a real Ray head started here (`ray start --head`, its own ports and temp dir,
so it never meets the test session's in-process Ray, with token authentication as every shipped
cluster has it): a tiny training job is followed to success, and submitting the same command again
starts nothing; failed and running jobs are handled by id."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from mdc.data.shapes import write_shapes_dataset
from pipelines.cli import app
from pipelines.commands.submit import Plan, default_submission_id, plan_submission, run_name_of, runtime_env

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's bin: ray, mdc
PORT_FLAGS = (
    "port",
    "dashboard-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "ray-client-server-port",
    "metrics-export-port",
    "runtime-env-agent-port",
    "node-manager-port",
    "object-manager-port",
)


def test_plan_follows_reports_or_resubmits():
    assert plan_submission("mdc-a", {}) == Plan("submit", "mdc-a")
    assert plan_submission("mdc-a", {"mdc-ab": "FAILED"}) == Plan("submit", "mdc-a")
    assert plan_submission("mdc-a", {"mdc-a": "RUNNING"}) == Plan("follow", "mdc-a", "RUNNING")
    assert plan_submission("mdc-a", {"mdc-a": "SUCCEEDED"}) == Plan("done", "mdc-a", "SUCCEEDED")
    assert plan_submission("mdc-a", {"mdc-a": "FAILED"}) == Plan("submit", "mdc-a-r1", "FAILED")
    later = {"mdc-a": "FAILED", "mdc-a-r1": "STOPPED", "mdc-a-r2": "PENDING"}
    assert plan_submission("mdc-a", later) == Plan("follow", "mdc-a-r2", "PENDING")
    later["mdc-a-r2"] = "FAILED"
    later["mdc-a-r10"] = "FAILED"
    assert plan_submission("mdc-a", later) == Plan("submit", "mdc-a-r11", "FAILED")


def test_submission_id_comes_from_the_run_name(tmp_path):
    (tmp_path / "c.yaml").write_text("name: from-config\n")
    assert run_name_of(["mdc", "train", "--name", "run-1"], None) == "run-1"
    assert run_name_of(["mdc", "train", "--name=run-2"], None) == "run-2"
    assert run_name_of(["mdc", "train", "--config", "c.yaml", "name=run-3"], tmp_path) == "run-3"
    assert run_name_of(["mdc", "train", "--config", "c.yaml"], tmp_path) == "from-config"
    assert run_name_of(["mdc", "train", "--config", str(tmp_path / "c.yaml")], REPO) == "from-config"
    assert run_name_of(["python", "x.py"], tmp_path) is None
    assert default_submission_id("vit b/16") == "mdc-vit-b-16"


def test_runtime_env_uploads_the_checkout_without_local_state():
    env = runtime_env(REPO, ["A=1", "B=x=y"], ["tqdm"])
    assert env["working_dir"] == str(REPO) and ".venv" in env["excludes"]
    assert env["env_vars"] == {"A": "1", "B": "x=y"} and env["pip"] == ["tqdm"]
    assert runtime_env(None, [], []) == {}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        runtime_env(None, ["A"], [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Head:
    url: str  # the dashboard (Jobs API)
    gcs: str  # what `ray.init(address=...)` joins
    token: str  # its RAY_AUTH_TOKEN


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head with token authentication (RAY_AUTH_MODE=token and a fresh RAY_AUTH_TOKEN) in its
    own process group on free ports, whose jobs find `mdc` on PATH. Stopped by killing that group
    only (never `ray stop`, which would end every Ray instance of this user)."""
    temp_dir = tempfile.mkdtemp(prefix="mdc-", dir="/tmp")  # short: Ray's socket paths have a limit
    ports = {flag: _free_port() for flag in PORT_FLAGS}
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    log = open(Path(temp_dir, "head.log"), "w")
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            "--object-store-memory=300000000",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            *[f"--{flag}={port}" for flag, port in ports.items()],
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
                break
            except urllib.error.HTTPError:  # any HTTP answer (a 401 here) means the head is up
                break
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise RuntimeError("Ray head did not start:\n" + Path(log.name).read_text()[-3000:]) from None
                time.sleep(0.5)
        yield Head(url, f"127.0.0.1:{ports['port']}", token)
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # a throwaway cluster: no graceful shutdown needed
        head.wait(timeout=5)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def mdc_submit(url: str, *args: str):
    """`mdc submit` in this process: it only talks HTTP to the head, it never joins the cluster."""
    result = CliRunner().invoke(app, ["submit", "--address", url, "--working-dir", str(REPO), *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def jobs(head: Head) -> dict[str, str]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head.url, headers={"Authorization": f"Bearer {head.token}"})
    return {j.submission_id: str(j.status.value) for j in client.list_jobs()}


@pytest.mark.ray
@pytest.mark.timeout(360)
def test_submit_follows_training_and_is_idempotent(ray_head, tmp_path, monkeypatch):
    url = ray_head.url
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head.token)
    write_shapes_dataset(str(tmp_path / "shapes"), num=120, seed=0, samples_per_shard=60)
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train = [
        "mdc",
        "train",
        "--config",
        "configs/demo.yaml",
        "--data",
        str(tmp_path / "shapes" / "train"),
        "--storage",
        str(tmp_path / "ckpt"),
        "--mlflow-uri",
        mlflow_uri,
        "--name",
        "submitted",
        "data.val_uri=null",
        "data.max_length=16",
        "train.batch_size=8",
        "workers.count=1",
        "workers.cpus=0.5",
        "train.steps=6",
        "checkpoint.every=3",
        "train.log_every=3",
        "optim.warmup_steps=2",
    ]

    first = mdc_submit(url, "--", *train)
    assert first.exit_code == 0, first.output[-4000:]
    assert "submitted step 6/6" in first.stdout  # the job's log was followed (the progress line)
    assert "mdc-submitted SUCCEEDED" in first.stderr
    assert jobs(ray_head) == {"mdc-submitted": "SUCCEEDED"}

    again = mdc_submit(url, "--", *train)
    assert again.exit_code == 0, again.stderr
    assert "already SUCCEEDED" in again.stderr
    assert jobs(ray_head) == {"mdc-submitted": "SUCCEEDED"}  # no second job
    client = MlflowClient(mlflow_uri)
    [run] = client.search_runs([client.get_experiment_by_name("mdc").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(steps) == list(range(1, 7))  # one pass over steps 1..6, never restarted


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_failed_job_is_resubmitted_and_running_job_followed(ray_head, monkeypatch):
    url = ray_head.url
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head.token)
    failing = ["--submission-id", "broken", "--", "python", "-c", "import sys; sys.exit(3)"]
    assert mdc_submit(url, *failing).exit_code == 1
    retry = mdc_submit(url, *failing)
    assert retry.exit_code == 1 and "resubmitting as broken-r1" in retry.stderr
    assert {k: v for k, v in jobs(ray_head).items() if k.startswith("broken")} == {
        "broken": "FAILED",
        "broken-r1": "FAILED",
    }

    sleeper = ["--submission-id", "sleeper", "--", "python", "-c", "import time; time.sleep(8); print('woke')"]
    assert mdc_submit(url, "--no-wait", *sleeper).exit_code == 0
    follow = mdc_submit(url, *sleeper)
    assert follow.exit_code == 0, follow.stderr
    assert "following it instead of submitting again" in follow.stderr and "woke" in follow.stdout
    assert [k for k in jobs(ray_head) if k.startswith("sleeper")] == ["sleeper"]
