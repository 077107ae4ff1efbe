"""One skeleton for the commands that train and judge many runs (`mdc compare`, `mdc scaling`,
`mdc study`): a parent MLflow run whose children are the runs; as many runs at once as the cluster
holds (pipelines/run/concurrency.py); each run trained and evaluated (pipelines/run/evaluation.py)
and its result written last, where a relaunch finds it and reruns nothing; a run that fails leaves
its traceback beside that file, does not stop the others, and ends the parent FAILED.
"""

from __future__ import annotations

import contextlib
import functools
import json
import posixpath
import traceback
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow.fs as pafs

from mdc.config import RunConfig
from mdc.data import storage
from pipelines.infra import progress, tracking
from pipelines.infra.console import console, first_line_of
from pipelines.run import concurrency
from pipelines.run.evaluation import train_and_evaluate

ERROR = "error.txt"
K = TypeVar("K", bound=Hashable)


@dataclass
class Failure:
    """A run that failed: its name, its error's line, where its traceback is."""

    run_name: str
    error: str
    error_uri: str

    def as_tuple(self) -> tuple[str, str, str]:  # what console.report_failures takes
        return self.run_name, self.error, self.error_uri


@dataclass
class Parent:
    """The experiment's MLflow parent run and the runs of it that failed."""

    run_id: str
    mlflow_uri: str
    failures: list[Failure] = field(default_factory=list)


@contextlib.contextmanager
def parent_run(base: RunConfig, name: str, params: dict) -> Iterator[Parent]:
    """The parent run `name` (found again on a relaunch), ended FINISHED when every run finished,
    FAILED when one failed or the experiment stopped with an error (KILLED on Ctrl-C)."""
    mlflow_uri = tracking.absolute_tracking_uri(base.mlflow_uri)
    parent = Parent(tracking.get_or_create_run(mlflow_uri, base.experiment, name, params), mlflow_uri)
    try:
        yield parent
    except BaseException:
        tracking.finish_run(mlflow_uri, parent.run_id, "FAILED")
        raise
    tracking.finish_run(mlflow_uri, parent.run_id, "FAILED" if parent.failures else "FINISHED")


def read_result(uri: str, endpoint_url: str | None) -> dict | None:
    """A finished run's stored result, or None (an unreachable store raises: never retrains)."""
    fs, path = storage.open_fs(uri, endpoint_url)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    return json.loads(storage.read_bytes(uri, endpoint_url))


def one_run(parent: Parent, cfg: RunConfig, result_uri: str, channel) -> dict | Failure:
    """A run trained and judged, its result written to `result_uri` last; or its Failure, with
    the traceback in error.txt beside it (an interrupt is raised, not kept)."""
    endpoint = cfg.data.endpoint_url
    child = tracking.get_or_create_run(parent.mlflow_uri, cfg.experiment, cfg.name, cfg.model_dump(), parent.run_id)
    try:
        result = train_and_evaluate(cfg, parent.run_id, channel)
    except SystemError:
        raise  # how Ray passes on an interrupt (Ctrl-C, a timeout) that came while it waited: stop
    except Exception as err:
        error_uri = storage.join(posixpath.dirname(result_uri), ERROR)
        storage.write_bytes(error_uri, traceback.format_exc().encode(), endpoint)
        tracking.finish_run(parent.mlflow_uri, child, "FAILED")
        console.print(f"{cfg.name}: failed: {first_line_of(err)}", highlight=False)
        return Failure(cfg.name, first_line_of(err), error_uri)
    storage.write_bytes(result_uri, json.dumps(result, indent=2).encode(), endpoint)
    return result


def run_runs(
    parent: Parent, configs: dict[K, RunConfig], result_uri: Callable[[RunConfig], str], max_concurrent: int | None
) -> dict[K, dict]:
    """Every run's result, by key in the order given: read back where a launch before finished it,
    else trained and judged, `max_concurrent` at once (default: what the cluster's free resources
    hold). Failed runs are left out and added to `parent.failures`."""
    done = {key: read_result(result_uri(cfg), cfg.data.endpoint_url) for key, cfg in configs.items()}
    for key, result in done.items():
        if result is not None:
            console.print(f"{configs[key].name}: done before, not rerun ({result_uri(configs[key])})", highlight=False)
    pending = {key: cfg for key, cfg in configs.items() if done[key] is None}
    n, pending = concurrency.plan_concurrency(pending, max_concurrent)
    with progress.shared(n, console) as channel:
        calls = {key: functools.partial(one_run, parent, cfg, result_uri(cfg), channel) for key, cfg in pending.items()}
        outcomes = {**{k: v for k, v in done.items() if v is not None}, **concurrency.run_all(calls, n)}
    results = {}
    for key in configs:
        if isinstance(outcomes[key], Failure):
            parent.failures.append(outcomes[key])
        else:
            results[key] = outcomes[key]
    return results
