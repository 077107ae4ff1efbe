"""Sweeps: a 2-trial Ray Tune sweep of the tiny model on an unlabelled img2dataset folder, ranked by
a probe on CIFAR-10's python batches, ASHA, MLflow parent/children and artifacts, every figure under
the key every command uses; bad space files rejected before any trial starts."""

import json
import os
import textwrap

import pytest
from helpers import EVAL_KEYS, eval_overrides
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from mdc.config import ConfigError, RunConfig, load_config
from mdc.evaluation import suite
from pipelines.cli import app
from pipelines.commands.search_space import load_space, ranking

SPACE = """\
name: test_schedule
search: grid
metric: val_loss
mode: min
params:
  optim.lr:
    grid: [0.002, 0.000001]
base:
  objective.name: mdc
scheduler:
  type: asha
  grace_period: 1
  reduction_factor: 2
"""


def write(tmp_path, text, name="space.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            "params:\n  objective.omega_l:\n    grid: [0.6]\n  objective.omega_u:\n    grid: [0.5]\n",
            "omega_l must be < omega_u, got 0.6 >= 0.5",
        ),
        ("params:\n  objective.omega_x:\n    grid: [0.1]\n", "'objective.omega_x' is not a run config field"),
        ("params:\n  objective.omega_l:\n    uniform: [0.5, 0.5]\n", "uniform range is empty"),
        ("params:\n  objective.omega_l:\n    grid: []\n", "grid is empty"),
        ("params:\n  objective.omega_l:\n    grid: [0.1]\nsearhc: grid\n", "searhc: unknown key"),
    ],
)
def test_bad_space_is_rejected_with_the_key(tmp_path, bad, message):
    head = "name: bad\n" + ("" if "searhc" in bad else "search: grid\n")
    path = write(tmp_path, head + bad)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_space(path, RunConfig())


def test_cli_rejects_bad_space_before_ray(tmp_path, ray_forbidden):
    path = write(tmp_path, "name: bad\nsearch: grid\nparams:\n  objective.nme:\n    grid: [mdc]\n")
    result = CliRunner().invoke(app, ["tune", "--space", str(path)])
    assert result.exit_code == 2
    assert "objective.nme" in result.output


def test_tune_name_names_the_sweep_and_verbose_alone_shows_tunes_tables(tmp_path, shapes_dir, monkeypatch):
    """`mdc tune --name birds`: the sweep's folder and name, not RUN-SPACE; Ray Tune's own tables
    (its `verbose`) only with --verbose. Ray-free: the sweep itself is replaced."""
    import contextlib

    import pipelines.commands.tune as tune_command
    from pipelines.infra import ray_connection

    seen = []
    monkeypatch.setattr(
        ray_connection, "ray_session", lambda log, *a, **k: seen.append(log) or contextlib.nullcontext()
    )

    def sweep(space, base, samples, max_concurrent, verbose, name):
        seen.append((tune_command.sweep_name(base, space, name), verbose))
        raise SystemExit(0)

    monkeypatch.setattr(tune_command, "run_sweep", sweep)
    args = ["tune", "--space", "tune_spaces/noise_schedule.yaml", f"storage_uri={tmp_path}"]
    args += [f"data.train_uri={shapes_dir / 'train'}", f"data.val_uri={shapes_dir / 'val'}"]
    CliRunner().invoke(app, [*args, "--name", "birds"])
    CliRunner().invoke(app, [*args, "--verbose"])
    assert seen[:2] == [tmp_path / "sweeps" / "birds" / "ray.log", ("birds", False)]
    assert seen[3] == ("mdc-demo-noise_schedule", True)


def test_random_space_never_proposes_an_empty_interval():
    import random

    space = load_space("tune_spaces/noise_schedule_random.yaml", RunConfig())
    rng = random.Random(0)
    draws = [space.draw(RunConfig().model_dump(), rng) for _ in range(300)]
    assert all(d["objective.omega_l"] < d["objective.omega_u"] for d in draws)
    assert min(d["objective.omega_l"] for d in draws) < 0.1 and max(d["objective.omega_u"] for d in draws) > 0.9


def test_shipped_spaces_load():
    for name in ("noise_schedule", "noise_schedule_random", "masking_ratio", "objectives"):
        load_space(f"tune_spaces/{name}.yaml", RunConfig())


def test_stopped_trials_are_killed_and_errored_ones_stay_failed(tmp_path):
    from pipelines.infra import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    parent = tracking.get_or_create_run(uri, "e", "sweep-s", {})
    runs = {name: tracking.get_or_create_run(uri, "e", f"s-{name}", {}, parent) for name in ("a", "b", "c", "d")}
    tracking.finish_run(uri, runs["b"], "FAILED")  # stopped by ASHA while its trainer was torn down
    tracking.finish_run(uri, runs["c"], "FAILED")  # a real error
    tracking.finish_run(uri, runs["d"])
    rows = [
        {"trial_id": "a", "stopped_early": True},
        {"trial_id": "b", "stopped_early": True},
        {"trial_id": "c", "stopped_early": False},
        {"trial_id": "d", "stopped_early": False},
    ]
    tracking.kill_children(uri, parent, {f"s-{r['trial_id']}" for r in rows if r["stopped_early"]})
    status = {name: client.get_run(run_id).info.status for name, run_id in runs.items()}
    assert status == {"a": "KILLED", "b": "KILLED", "c": "FAILED", "d": "FINISHED"}


def test_trials_are_ranked_by_the_first_probe_or_a_figure_the_section_measures(tmp_path, cifar10_dir, shapes_dir):
    base = suite.resolve_section(
        load_config(None, [f"data.train_uri={shapes_dir / 'train'}", *eval_overrides(cifar10_dir, shapes_dir)])
    )
    space = load_space(write(tmp_path, SPACE), base)
    assert space.rank_by is None and ranking(space, base).rank_by == "eval/probe/cifar10/accuracy"
    chosen = space.model_copy(update={"rank_by": "eval/compositionality/aro/vg_relation"})
    assert ranking(chosen, base).rank_by == "eval/compositionality/aro/vg_relation"
    with pytest.raises(ConfigError, match=r"rank_by: 'probe_accuracy' is not a figure the eval section measures"):
        ranking(space.model_copy(update={"rank_by": "probe_accuracy"}), base)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_sweep_on_unlabelled_data_ranked_by_a_cifar_probe(
    ray_cluster, img2dataset_dir, cifar10_dir, shapes_dir, tmp_path, monkeypatch
):
    """Given relative paths (trials run in Tune's trial folders, so the driver must resolve them).
    ASHA stops the lr=1e-6 trial; the other is judged on the eval section and ranks first."""
    from pipelines.commands.tune import run_sweep
    from pipelines.run import model_registry

    monkeypatch.chdir(tmp_path)
    data = os.path.relpath(img2dataset_dir, tmp_path)
    base = load_config(
        None,
        [
            "name=sweep",
            "storage_uri=store",
            "mlflow_uri=sqlite:///mlflow.db",
            f"data.train_uri={data}",
            f"data.val_uri={data}",  # ASHA's val_loss (no split of its own: the folder itself)
            "data.max_length=16",
            "train.batch_size=8",
            "workers.count=1",
            "train.steps=6",
            "train.log_every=2",
            "validation.every=2",
            "validation.batches=2",
            "checkpoint.every=6",
            "optim.warmup_steps=2",
            *eval_overrides(cifar10_dir, shapes_dir),
        ],
    )
    space = load_space(write(tmp_path, SPACE), base)
    summary = run_sweep(space, base, max_concurrent=1)  # one at a time: ASHA stops the lr=1e-6 trial

    assert summary.failures == []
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(summary.parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{summary.parent_run_id}'"
    )
    assert sorted(float(c.data.params["optim.lr"]) for c in children) == [0.000001, 0.002]
    assert sorted((r["optim.lr"], r["stopped_early"]) for r in summary.rows) == [(0.000001, True), (0.002, False)]
    [finished] = [c for c in children if float(c.data.params["optim.lr"]) == 0.002]
    assert {k for k in finished.data.metrics if k.startswith("eval/")} == EVAL_KEYS  # the keys every command logs
    checkpoint, _ = model_registry.run_checkpoint(f"sqlite:///{tmp_path / 'mlflow.db'}", finished.info.run_id)
    out = tmp_path / "all.json"
    result = CliRunner().invoke(app, ["eval", "all", "--checkpoint", checkpoint, "--out", str(out), "--mlflow-uri", ""])
    assert result.exit_code == 0, result.output
    again = json.loads(out.read_text())["metrics"]
    assert {k: v for k, v in again.items() if "per_s" not in k} == {
        k: v for k, v in finished.data.metrics.items() if k.startswith("eval/") and "per_s" not in k
    }
    assert all(c.info.status in ("FINISHED", "KILLED") for c in children), [
        (c.data.tags.get("mdc.run_name"), c.info.status) for c in children
    ]
    artifacts = {a.path for a in client.list_artifacts(summary.parent_run_id)}
    assert {"results.csv", "results.md", "sweep.png"} <= artifacts
    assert summary.best is not None and summary.best["optim.lr"] == 0.002
    assert summary.best["eval/probe/cifar10/accuracy"] == finished.data.metrics["eval/probe/cifar10/accuracy"]
    assert parent.data.metrics["best/eval/probe/cifar10/accuracy"] == summary.best["eval/probe/cifar10/accuracy"]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_sweep_whose_trials_all_fail_exits_non_zero(ray_cluster, shapes_dir, tmp_path):
    """Every trial's validation folder is missing (the base config's is fine, so the driver's
    check passes and the trials fail on their own): exit 1 and the first failure in one line."""
    path = write(
        tmp_path,
        f"""\
        name: failing
        search: grid
        metric: val_loss
        params:
          data.val_uri:
            grid: [{tmp_path / "gone-a"}, {tmp_path / "gone-b"}]
        scheduler: {{type: none}}
        """,
    )
    result = CliRunner().invoke(
        app,
        [
            "tune",
            "--space",
            str(path),
            "name=failing",
            f"storage_uri={tmp_path / 'store'}",
            f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"data.train_uri={shapes_dir / 'train'}",
            f"data.val_uri={shapes_dir / 'val'}",
        ],
    )
    assert result.exit_code == 1, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "all 2 trials failed" in line and "does not exist" in line and "gone-" in line, result.output
    assert "Traceback" not in result.output
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # MLflow tells the truth (issue 52)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parents = [r for r in runs if r.info.run_name.startswith("sweep-")]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    parent = parents[0]
    assert parent.info.status == "FAILED" and all(r.info.status != "RUNNING" for r in runs)
    assert client.search_model_versions() == []
