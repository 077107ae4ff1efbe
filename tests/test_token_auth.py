"""Token authentication against a real Ray head started with RAY_AUTH_MODE=token (test_submit's
`ray_head`): the Jobs API refuses a request without the token, `mdc submit` with the token runs a
job to the end, and a missing or wrong token is one line that says how to give it and never shows
a token. Nothing in the product turns Ray's authentication off."""

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import auth_scan
import pytest
from test_submit import ray_head  # noqa: F401  (the fixture: one token-authenticated head per module)

from mdc.data.shapes import write_shapes_dataset

REPO = Path(__file__).resolve().parent.parent
MDC = str(Path(sys.executable).parent / "mdc")
WRONG = "0123456789abcdef0123456789abcdef"
SCANNED = ("pipelines", "mdc", "cluster", ".ci", "docs", "configs", "studies", "tune_spaces", "benchmarks", "tests")
SCANNED_FILES = ("Makefile", "README.md", "pyproject.toml")
BINARY = {".png", ".jpg", ".pyc", ".npy", ".gz", ".safetensors"}
# Files allowed to hold findings, and why: none of them configures a Ray cluster.
ALLOWED = {"tests/test_token_auth.py": "the planted forms below, which the scan must find"}

# (file name, text, the line the scan must name): every way found to turn token auth off.
OFF = [
    # YAML: KubeRay, Kubernetes, docker compose, Ray's cluster launcher and runtime_env
    ("env.yaml", 'containers:\n- name: ray-head\n  env:\n  - name: RAY_AUTH_MODE\n    value: "disabled"\n', 5),
    ("value-first.yaml", "env:\n- value: disabled\n  name: RAY_AUTH_MODE\n", 2),
    ("value-from.yaml", "env:\n- name: RAY_AUTH_MODE\n  valueFrom: {configMapKeyRef: {name: ray, key: mode}}\n", 2),
    ("flow.yaml", "spec:\n  authOptions: {mode: disabled}\n", 2),
    ("block.yaml", "spec:\n  authOptions:\n    mode: disabled\n", 3),
    ("empty.yaml", "spec:\n  authOptions: {}\n", 2),
    ("template.yaml", "env:\n- {name: RAY_AUTH_MODE, value: ${MODE:-disabled}}\nres: {cpu: ${CPU}}\n", 2),
    ("second-doc.yaml", "kind: A\n---\nkind: B\nspec: {authOptions: {mode: Disabled}}\n", 4),
    ("compose.yaml", "services:\n  head:\n    environment:\n      RAY_AUTH_MODE: disabled\n", 4),
    ("compose-list.yaml", "environment:\n  - RAY_AUTH_MODE=disabled\n", 2),
    ("yaml-bool.yaml", "env_vars:\n  RAY_AUTH_MODE: off\n", 2),
    ("empty-value.yaml", 'runtime_env: {env_vars: {RAY_AUTH_MODE: ""}}\n', 1),
    ("launcher.yaml", "head_start_ray_commands:\n  - export RAY_AUTH_MODE=disabled && ray start --head\n", 2),
    (
        "configmap.yaml",
        "kind: ConfigMap\ndata:\n  rayjob.yaml: |\n    spec:\n      authOptions:\n        mode: disabled\n",
        6,
    ),
    ("env.json", '{"env": [{"name": "RAY_AUTH_MODE", "value": "disabled"}]}', 1),
    # shell, make, Docker, TOML, Markdown
    ("start.sh", "#!/bin/sh\nexport RAY_AUTH_MODE=disabled\n", 2),
    ("prefix.sh", "RAY_AUTH_MODE=disabled ray start --head\n", 1),
    ("default.sh", 'export RAY_AUTH_MODE="${MODE:-disabled}"\n', 1),
    ("assign-default.sh", ': "${RAY_AUTH_MODE:=disabled}"\nray start --head\n', 1),
    ("variable.sh", "export RAY_AUTH_MODE=$MODE\n", 1),
    ("unset.sh", "unset RAY_AUTH_MODE\nray start --head\n", 1),
    ("env-u.sh", "env -u RAY_AUTH_MODE ray start --head\n", 1),
    ("docker.sh", "docker run -e RAY_AUTH_MODE=disabled rayproject/ray\n", 1),
    ("heredoc.sh", "kubectl apply -f - <<EOF\nenv:\n  - name: RAY_AUTH_MODE\n    value: disabled\nEOF\n", 4),
    ("Makefile", "export RAY_AUTH_MODE ?= disabled\n", 1),
    ("rules.mk", "RAY_AUTH_MODE := none\n", 1),
    ("Dockerfile", "FROM rayproject/ray\nENV RAY_AUTH_MODE=disabled\n", 2),
    ("Dockerfile.old", "FROM rayproject/ray\nENV RAY_AUTH_MODE disabled\n", 2),
    ("pyproject.toml", '[tool.pytest.ini_options]\nenv = ["RAY_AUTH_MODE=disabled"]\n', 2),
    ("how.md", "# Local\n\nSet `RAY_AUTH_MODE=disabled` to skip the token.\n", 3),
    ("doc.md", "Text.\n\n```yaml\nspec:\n  authOptions:\n    mode: disabled\n```\n", 6),
    # Python
    ("item.py", 'import os\nos.environ["RAY_AUTH_MODE"] = "disabled"\n', 2),
    ("setdefault.py", 'import os\nos.environ.setdefault("RAY_AUTH_MODE", "disabled")\n', 2),
    ("putenv.py", 'import os\nos.putenv("RAY_AUTH_MODE", "off")\n', 2),
    ("setenv.py", 'def test(monkeypatch):\n    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")\n', 2),
    ("update.py", 'import os\nos.environ.update(RAY_AUTH_MODE="disabled")\n', 2),
    ("env-dict.py", 'import os\nenv = {**os.environ, "RAY_AUTH_MODE": "disabled"}\n', 2),
    ("runtime-env.py", 'import ray\nray.init(runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})\n', 2),
    ("names.py", 'import os\nKEY = "RAY_AUTH_MODE"\nMODE = "disabled"\nos.environ[KEY] = MODE\n', 4),
    ("unreadable.py", 'import os\nos.environ["RAY_AUTH_MODE"] = mode()\n', 2),
    ("del.py", 'import os\ndel os.environ["RAY_AUTH_MODE"]\n', 2),
    ("pop.py", 'import os\nos.environ.pop("RAY_AUTH_MODE", None)\n', 2),
    (
        "shell-string.py",
        'import subprocess\nsubprocess.run("RAY_AUTH_MODE=disabled ray start --head", shell=True)\n',
        2,
    ),
    ("argv.py", 'import subprocess\nsubprocess.run(["env", "RAY_AUTH_MODE=disabled", "ray", "start"])\n', 2),
    ("fstring.py", 'import subprocess\nsubprocess.run(f"RAY_AUTH_MODE={mode} ray start", shell=True)\n', 2),
    ("pod.py", 'container = {"env": [{"name": "RAY_AUTH_MODE", "value": "disabled"}]}\n', 1),
    ("system-config.py", 'import ray\nray.init(_system_config={"AUTH_MODE": "disabled"})\n', 2),
    ("system-config.sh", 'ray start --head --system-config=\'{"AUTH_MODE": "disabled"}\'\n', 1),
    ("python-c.sh", 'python -c \'import os; os.environ["RAY_AUTH_MODE"] = "disabled"\'\n', 1),
]
# What keeps it on, or only reads it: none of these is a finding (a scan that flagged every
# mention would pass the list above).
ON = [
    (
        "keep.py",
        'import os\nAUTH_MODE_ENV_VAR = "RAY_AUTH_MODE"\nos.environ[AUTH_MODE_ENV_VAR] = "token"\n'
        'os.environ.setdefault("RAY_AUTH_MODE", "token")\n'
        'mode = os.environ.get("RAY_AUTH_MODE", "unset")\nif "RAY_AUTH_MODE" in os.environ:\n    pass\n'
        'env = dict(os.environ, RAY_AUTH_MODE="token")\n"""Ray sends it only under RAY_AUTH_MODE=token."""\n',
    ),
    ("keep.sh", "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN && ray start --head\nRAY_AUTH_MODE=TOKEN ray start\n"),
    (
        "keep.yaml",
        'spec:\n  authOptions: {mode: token}\n  env:\n  - name: RAY_AUTH_MODE\n    value: "token"\n'
        "  cmd: export RAY_AUTH_MODE=token\n  res: {cpu: ${CPU}}\n",
    ),
    (
        "keep.md",
        "Started with `RAY_AUTH_MODE=token`; `RAY_AUTH_MODE` and `RAY_AUTH_TOKEN` on every pod:\n"
        "`env: [{name: RAY_AUTH_MODE, value: token}]`.\n",
    ),
]


def repo_files() -> list[Path]:
    files = [p for folder in SCANNED for p in sorted((REPO / folder).rglob("*")) if p.is_file()]
    files += [REPO / name for name in SCANNED_FILES]
    return [p for p in files if p.suffix not in BINARY and "__pycache__" not in p.parts]


def test_nothing_in_the_product_turns_ray_authentication_off():
    """Every YAML, shell, Python and Markdown file of the repository (cluster/, docs, Makefile,
    .ci, the code, the tests) sets RAY_AUTH_MODE and KubeRay's authOptions only to `token`."""
    files = repo_files()
    assert {
        "cluster/kuberay/raycluster.yaml",
        "cluster/aws/cluster.yaml",
        ".ci/run",
        "Makefile",
        "docs/clusters.md",
    } <= {str(p.relative_to(REPO)) for p in files}
    found = auth_scan.scan([p.relative_to(REPO) for p in files if str(p.relative_to(REPO)) not in ALLOWED])
    assert found == []


@pytest.mark.parametrize("name, text, line", OFF, ids=[case[0] for case in OFF])
def test_the_scan_finds_each_way_of_turning_token_auth_off(tmp_path, name, text, line):
    (tmp_path / name).write_text(text)
    found = auth_scan.scan([tmp_path / name])
    assert found and all(f.startswith(f"{tmp_path / name}:{line}: ") for f in found), found


@pytest.mark.parametrize("name, text", ON, ids=[case[0] for case in ON])
def test_the_scan_leaves_token_auth_kept_on_alone(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    assert auth_scan.scan([tmp_path / name]) == []


def test_the_allowed_files_hold_findings_and_a_file_that_does_not_parse_is_one(tmp_path):
    """ALLOWED is not stale, and a file the scan cannot read is a finding, not a pass."""
    for path in ALLOWED:
        assert auth_scan.scan([REPO / path]), path
    (tmp_path / "broken.yaml").write_text("spec: [unclosed\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    found = auth_scan.scan([tmp_path / "broken.yaml", tmp_path / "broken.py"])
    assert [f.split(": ", 1)[1][:24] for f in found] == ["not parseable as YAML, s", "not parseable as Python,"]


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
