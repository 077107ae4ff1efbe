"""`mdc submit -- mdc train ...`: run an `mdc` command as a Ray job through the Job Submission API.

The submission id is stable (`mdc-<run name>` unless --submission-id is given), so submitting the
same command again never starts a second job: a pending or running job is followed, a succeeded one
is reported, and a failed or stopped one is submitted again as `<id>-r1`, `<id>-r2`, ... with the
same run name, so Ray Train resumes it from its last checkpoint. The command exits with the job's
outcome: 0 when it succeeded, 1 when it failed or was stopped, 2 when it could not be submitted.

Every request carries this process's Ray token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
~/.ray/auth_token): a cluster with token authentication refuses a Jobs API request without it,
and that refusal is said in one line that never shows the token.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer
import yaml
from rich.console import Console

from pipelines.infra.console import first_line_of
from pipelines.infra.ray_connection import TOKEN_HELP, auth_token

console = Console(stderr=True, soft_wrap=True)  # stdout carries the job's own log

ACTIVE = ("PENDING", "RUNNING")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# Never uploaded: local environments, runs and stores (Ray also honours .gitignore).
WORKING_DIR_EXCLUDES = [".git", ".venv", "runs", "mdc-demo", "*.db", "__pycache__", "*.egg-info"]


def _option(tokens: list[str], flag: str) -> str | None:
    for i, token in enumerate(tokens):
        if token == flag and i + 1 < len(tokens):
            return tokens[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def run_name_of(entrypoint: list[str], working_dir: Path | None) -> str | None:
    """The run name an `mdc train|scaling` entrypoint will use: its --name, a `name=` override, or
    the `name` in its --config file (read relative to the working dir); None if it has none."""
    name = _option(entrypoint, "--name") or next((t[5:] for t in entrypoint if t.startswith("name=")), None)
    config = _option(entrypoint, "--config")
    if name is None and config is not None:
        path = Path(config) if working_dir is None else working_dir / config  # `/` keeps absolute paths
        if path.is_file():
            name = (yaml.safe_load(path.read_text()) or {}).get("name")
    return name


def default_submission_id(run_name: str) -> str:
    """`mdc-<run name>` with anything but letters, digits, '-' and '_' replaced by '-'."""
    return "mdc-" + re.sub(r"[^A-Za-z0-9_-]", "-", run_name)


@dataclass
class Plan:
    action: str  # "submit" a new attempt, "follow" the running one, or "done": it succeeded
    submission_id: str
    status: str | None = None


def plan_submission(base_id: str, statuses: dict[str, str]) -> Plan:
    """What to do given the status of every job on the cluster (submission id -> status): attempts
    of `base_id` are `base_id`, `base_id-r1`, `base_id-r2`, ...; only the latest one counts."""
    pattern = re.compile(re.escape(base_id) + r"(?:-r(\d+))?")
    attempts = sorted((int(m.group(1) or 0), sid) for sid in statuses if (m := pattern.fullmatch(sid)))
    if not attempts:
        return Plan("submit", base_id)
    number, latest = attempts[-1]
    status = statuses[latest]
    if status in ACTIVE:
        return Plan("follow", latest, status)
    if status == "SUCCEEDED":
        return Plan("done", latest, status)
    return Plan("submit", f"{base_id}-r{number + 1}", status)


def runtime_env(working_dir: Path | None, env: list[str], pip: list[str]) -> dict:
    """The job's runtime environment: this checkout as working dir (it shadows the code installed in
    the cluster image), extra environment variables and pip packages."""
    out: dict = {}
    if working_dir is not None:
        out.update(working_dir=str(working_dir.resolve()), excludes=WORKING_DIR_EXCLUDES)
    if env:
        bad = [item for item in env if "=" not in item]
        if bad:
            raise ValueError(f"--env must look like KEY=VALUE, got {bad[0]!r}")
        out["env_vars"] = dict(item.split("=", 1) for item in env)
    if pip:
        out["pip"] = list(pip)
    return out


def follow(client, submission_id: str) -> str:
    """Stream the job's log to stdout until it ends; returns its final status."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(submission_id):
            sys.stdout.write(lines)
            sys.stdout.flush()

    asyncio.run(tail())
    while (status := str(client.get_job_status(submission_id).value)) not in TERMINAL:
        time.sleep(1)  # the log stream can close a moment before the status is final
    return status


def connect(address: str | None):
    """(client, status of every job by submission id) for the job server at `address`, the token
    sent in the Authorization header (Ray itself sends one only under RAY_AUTH_MODE=token). Not
    reached or refused: one line on stderr and exit code 2, instead of Ray's traceback."""
    # Ray's job client: seconds to import, so only once the command line is checked
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    where = address or "RAY_ADDRESS / local head"
    token = auth_token()
    try:
        client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"} if token else None)
        return client, {job.submission_id: str(job.status.value) for job in client.list_jobs() if job.submission_id}
    except AuthenticationError:
        held = "a token it does not accept" if token else "no token"
        message = f"the Ray job server at {where} refused the request ({held}): {TOKEN_HELP}"
    except ConnectionError as err:
        message = f"no Ray job server at {where}: {first_line_of(err)}"
    console.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)
