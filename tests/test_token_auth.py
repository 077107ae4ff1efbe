"""Token authentication against a real Ray head started with RAY_AUTH_MODE=token (test_submit's
`ray_head`): the Jobs API refuses a request without the token, `mdc submit` with the token runs a
job to the end, and a missing or wrong token is one line that says how to give it and never shows
a token. Nothing in the product turns Ray's authentication off."""

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_submit import ray_head  # noqa: F401  (the fixture: one token-authenticated head per module)

from mdc.data.shapes import write_shapes_dataset

REPO = Path(__file__).resolve().parent.parent
MDC = str(Path(sys.executable).parent / "mdc")
WRONG = "0123456789abcdef0123456789abcdef"
TURNS_AUTH_OFF = re.compile(r"RAY_AUTH_MODE\W{0,6}disabled")


def test_nothing_in_the_product_turns_ray_authentication_off():
    sources = [
        p for folder in ("pipelines", "mdc", "cluster", ".ci") for p in (REPO / folder).rglob("*") if p.is_file()
    ]
    sources += [REPO / "Makefile"]
    found = [str(p.relative_to(REPO)) for p in sources if TURNS_AUTH_OFF.search(p.read_text(errors="ignore"))]
    assert found == []
    assert TURNS_AUTH_OFF.search('os.environ.setdefault("RAY_AUTH_MODE", "disabled")')  # the scan sees it


def token_env(tmp_path: Path, **extra: str) -> dict:
    """A clean client environment: its own HOME (no ~/.ray/auth_token unless the test writes one)
    and no token or mode inherited from the session's Ray."""
    drop = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "HOME": str(home), **extra}


def mdc(env: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([MDC, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def request_status(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_the_jobs_api_refuses_a_request_without_the_right_token(ray_head):  # noqa: F811
    jobs = f"{ray_head.url}/api/jobs/"
    assert request_status(jobs) == 401
    assert request_status(jobs, WRONG) == 403
    assert request_status(jobs, ray_head.token) == 200


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_submit_sends_the_token_from_the_environment_or_rays_token_file(ray_head, tmp_path):  # noqa: F811
    job = ["--submission-id", "authed", "--no-upload", "--", "python", "-c", "print('ran with auth')"]
    env = token_env(tmp_path, RAY_AUTH_TOKEN=ray_head.token)
    first = mdc(env, "submit", "--address", ray_head.url, *job)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "ran with auth" in first.stdout and "authed SUCCEEDED" in first.stderr
    (Path(env["HOME"]) / ".ray").mkdir()
    (Path(env["HOME"]) / ".ray" / "auth_token").write_text(ray_head.token + "\n")
    again = mdc(token_env(tmp_path), "submit", "--address", ray_head.url, *job)  # Ray's default path
    assert again.returncode == 0 and "authed already SUCCEEDED" in again.stderr, again.stderr[-3000:]
    assert ray_head.token not in first.stdout + first.stderr + again.stdout + again.stderr


@pytest.mark.ray
@pytest.mark.timeout(240)
@pytest.mark.parametrize("token", [None, WRONG], ids=["no-token", "wrong-token"])
def test_submit_refused_is_one_line_on_how_to_give_the_token(ray_head, tmp_path, token):  # noqa: F811
    env = token_env(tmp_path, **({"RAY_AUTH_TOKEN": token} if token else {}))
    out = mdc(env, "submit", "--address", ray_head.url, "--submission-id", "refused", "--", "python", "-c", "1")
    said = (out.stdout + out.stderr).strip()
    assert out.returncode == 2
    assert len(said.splitlines()) == 1, said
    assert "refused the request" in said and "RAY_AUTH_TOKEN" in said and "~/.ray/auth_token" in said
    assert ("no token" if token is None else "a token it does not accept") in said
    assert WRONG not in said and ray_head.token not in said


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_joining_with_a_wrong_token_is_one_error_line(ray_head, tmp_path):  # noqa: F811
    write_shapes_dataset(str(tmp_path / "shapes"), num=40, seed=0, samples_per_shard=40)
    env = token_env(tmp_path, RAY_AUTH_TOKEN=WRONG)
    args = ["--data", str(tmp_path / "shapes" / "train"), "--storage", str(tmp_path / "ckpt")]
    out = mdc(env, "train", "--address", ray_head.gcs, *args, "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}")
    errors = [line for line in out.stdout.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(errors) == 1 and "refused to let this driver join" in errors[0] and "RAY_AUTH_TOKEN" in errors[0]
    assert "Traceback" not in out.stdout + out.stderr
    assert WRONG not in out.stdout + out.stderr


@pytest.mark.timeout(120)
def test_the_local_instance_keeps_token_authentication(ray_cluster):
    """The session's Ray, started as `mdc` starts one (RAY_AUTH_MODE unset), turned Ray's token
    authentication on: its Jobs API refuses a request without the token."""
    from ray._private.worker import get_dashboard_url  # Ray has no public getter for it

    assert os.environ.get("RAY_AUTH_MODE") == "token"
    assert request_status(f"http://{get_dashboard_url()}/api/jobs/") == 401
