"""Sweeps: Ray Tune over a search space, each trial a Ray Train run, every trial in MLflow.

Train V2 pattern: a Tune trial is a driver function that builds its own `TorchTrainer` (through
`run_training`); `TuneReportCallback` forwards the workers' reports, so ASHA sees the validation
loss while the trial trains. When training ends the trial is judged on the run config's eval
section (mdc/evaluation/suite.py, as every command judges an encoder: a probe on CIFAR-10, say,
whatever the training data); trials are ranked by the figure `rank_by` names (default: the first
probe's accuracy). MLflow: one parent run per sweep, one child per trial, and on the
parent a results table and a plot. Relaunching the same sweep resumes it (`Tuner.restore`).
Local paths are made absolute in the driver (trials run in Tune's trial folders), and every trial's
rank 0 reports its progress to one display on the driver's console. Trial drivers run on the head
(`TRIAL_DRIVER`): a lost worker node costs a trial a worker-group restart from its checkpoint
(`workers.max_failures`), never the trial.
"""

from __future__ import annotations

import posixpath
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from mdc.config import RunConfig, apply_overrides, build_config
from mdc.evaluation import suite
from pipelines.commands.search_space import SearchSpace, _copy, ranking, to_override_list
from pipelines.infra import progress, tracking
from pipelines.infra.console import console, first_line_of
from pipelines.infra.run_inputs import absolute_paths
from pipelines.run import concurrency, model_registry, reports
from pipelines.run.driver import storage_for
from pipelines.run.evaluation import train_and_evaluate

# A trial function only drives its trainer (Ray Train places the workers): it runs on the head,
# asking no CPU (the head of a GPU cluster often has none), where losing a worker node cannot take
# it, nor the run's actors and evaluator that stay beside it (`pipelines.infra.actors.on_driver_node`).
TRIAL_DRIVER = {"CPU": 0, "node:__internal_head__": 0.01}
# A trial whose driver fails anyway is run once more, and resumes from its own checkpoints.
TRIAL_RETRIES = 1


@dataclass
class SweepSummary:
    parent_run_id: str
    rows: list[dict]
    best: dict | None
    artifacts: list[str]
    failures: list[tuple[str, str, str]]  # (trial, its error's line, where the full error is)


def sweep_name(base_cfg: RunConfig, space: SearchSpace, name: str | None = None) -> str:
    """`mdc tune --name`, else RUN-SPACE (the base config's run name and the space's)."""
    return name or f"{base_cfg.name}-{space.name}"


def sweep_folder(base_cfg: RunConfig, space: SearchSpace, name: str | None = None) -> Path:
    """The sweep's local folder (Ray Tune's experiment folder, or ./mdc-logs for S3 storage)."""
    if "://" in base_cfg.storage_uri:
        return Path("mdc-logs", sweep_name(base_cfg, space, name)).resolve()
    return Path(base_cfg.storage_uri, "sweeps", sweep_name(base_cfg, space, name)).resolve()


def trial_run_name(sweep: str, trial_id: str) -> str:
    """A trial's run name: its Ray Train run and its MLflow child run."""
    return f"{sweep}-{trial_id}"


def run_trial(config: dict, base: dict, parent_run_id: str, sweep: str, channel) -> None:
    """One trial: trained (its reports forwarded to Tune), judged on its eval section, and its
    figures reported to Tune under the same keys as in MLflow."""
    point = config["point"]
    cfg = build_config(apply_overrides(_copy(base), to_override_list(point)))
    cfg.name = trial_run_name(sweep, tune.get_context().get_trial_id())
    cfg.registered_model = cfg.registered_model or sweep  # the trials are versions of the sweep's model
    result = train_and_evaluate(cfg, parent_run_id, channel, ray_callbacks=[TuneReportCallback()])
    headline = suite.headline(result["metrics"])
    progress.Reporter(channel, cfg.name, cfg.train.steps).note(", ".join(f"{k} {v:.3f}" for k, v in headline.items()))
    tune.report({**result["metrics"], "checkpoint_uri": result["checkpoint"], "trial_completed": True})


def build_tuner(
    space: SearchSpace,
    base_cfg: RunConfig,
    parent_run_id: str,
    num_samples: int | None,
    max_concurrent: int,
    channel,
    verbose: bool = False,
    name: str | None = None,
) -> tune.Tuner:
    base = base_cfg.model_dump()
    sweep = sweep_name(base_cfg, space, name)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=base, parent_run_id=parent_run_id, sweep=sweep, channel=channel),
        TRIAL_DRIVER,
    )
    path, filesystem = storage_for(posixpath.join(base_cfg.storage_uri, "sweeps"), base_cfg.data.endpoint_url)
    experiment = posixpath.join(path, sweep)
    if tune.Tuner.can_restore(experiment, storage_filesystem=filesystem):
        return tune.Tuner.restore(experiment, trainable, resume_errored=True, storage_filesystem=filesystem)
    if space.search == "grid":
        param_space = {"point": tune.grid_search(space.grid_points())}
        samples = space.num_samples
    else:  # the draws from train.seed, made here: the same sweep on any cluster
        rng = random.Random(base_cfg.train.seed)
        param_space = {
            "point": tune.grid_search([space.draw(base, rng) for _ in range(num_samples or space.num_samples)])
        }
        samples = 1
    scheduler = (
        ASHAScheduler(
            time_attr="training_iteration",
            grace_period=space.scheduler.grace_period,
            reduction_factor=space.scheduler.reduction_factor,
            max_t=10_000,
        )
        if space.scheduler.type == "asha"
        else FIFOScheduler()
    )
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=space.metric,
            mode=space.mode,
            num_samples=samples,
            max_concurrent_trials=max_concurrent,
            scheduler=scheduler,
        ),
        run_config=tune.RunConfig(
            name=sweep,
            storage_path=path,
            storage_filesystem=filesystem,
            failure_config=tune.FailureConfig(max_failures=TRIAL_RETRIES),
            verbose=1 if verbose else 0,  # its status tables; our display instead
        ),
    )


def results_rows(results: tune.ResultGrid, space: SearchSpace) -> list[dict]:
    rows = []
    for result in results:
        metrics = result.metrics or {}
        point = (result.config or {}).get("point", {})
        rows.append(
            {
                "trial_id": metrics.get("trial_id", ""),
                **{k: v for k, v in point.items() if k not in space.base},
                "iterations": metrics.get("training_iteration", 0),
                "stopped_early": not metrics.get("trial_completed", False) and result.error is None,
                space.metric: metrics.get(space.metric),
                space.rank_by: metrics.get(space.rank_by),
                "error": first_line_of(result.error)[:300] if result.error else "",
                "error_file": posixpath.join(result.path, "error.txt") if result.error else "",
            }
        )
    return rows


def write_artifacts(rows: list[dict], space: SearchSpace, directory: Path) -> list[Path]:
    """results.csv, results.md and a plot of the ranking metric and the early-stopping metric
    against the first swept parameter."""
    columns = list(rows[0]) if rows else []
    reports.write_csv(directory / "results.csv", columns, rows)
    (directory / "results.md").write_text(
        reports.markdown_table(columns, [[_fmt(r[c]) for c in columns] for r in rows])
    )
    x_key = next(k for k in columns if k not in ("trial_id", "iterations"))
    reports.sweep_png(rows, x_key, (space.rank_by, space.metric), directory / "sweep.png", f"sweep {space.name}")
    return [directory / "results.csv", directory / "results.md", directory / "sweep.png"]


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def trial_count(space: SearchSpace, num_samples: int | None = None) -> int:
    """Trials a sweep runs: the grid's points times its repeats, or a random space's draws."""
    if space.search == "grid":
        return len(space.grid_points()) * space.num_samples
    return num_samples or space.num_samples


def run_sweep(
    space: SearchSpace,
    base_cfg: RunConfig,
    num_samples: int | None = None,
    max_concurrent: int | None = None,
    verbose: bool = False,
    name: str | None = None,
) -> SweepSummary:
    """The sweep, `max_concurrent` trials at once (default: as many as the cluster's free
    resources hold, pipelines.run.concurrency.fitting_runs); Ray Tune places them."""
    base_cfg = suite.resolve_section(absolute_paths(base_cfg))
    space = ranking(space, base_cfg)
    if max_concurrent is None:
        max_concurrent = concurrency.fitting_runs([base_cfg] * trial_count(space, num_samples))
        console.print(f"{max_concurrent} trial(s) at once: what the cluster's free resources hold", highlight=False)
    mlflow_uri = tracking.absolute_tracking_uri(base_cfg.mlflow_uri)
    sweep = sweep_name(base_cfg, space, name)
    parent = tracking.get_or_create_run(
        mlflow_uri,
        base_cfg.experiment,
        f"sweep-{sweep}",
        {
            "space": space.model_dump(include={"name", "search", "metric", "mode", "rank_by"}),
            "base": base_cfg.model_dump(),
        },
    )
    with tracking.ended_on_error(mlflow_uri, parent):  # the parent is never left RUNNING
        summary = _sweep(space, base_cfg, parent, num_samples, max_concurrent, verbose, sweep)
    tracking.finish_run(mlflow_uri, parent, "FAILED" if summary.failures else "FINISHED")
    return summary


def _sweep(space, base_cfg, parent, num_samples, max_concurrent, verbose, sweep: str) -> SweepSummary:
    """The trials run, their table and the best logged to the parent run, the best aliased."""
    mlflow_uri = tracking.absolute_tracking_uri(base_cfg.mlflow_uri)
    channel = progress.open_channel()
    with progress.ProgressDisplay(channel, console):
        tuner = build_tuner(space, base_cfg, parent, num_samples, max_concurrent, channel, verbose, sweep)
        results = tuner.fit()
    rows = results_rows(results, space)
    tracking.kill_children(
        mlflow_uri, parent, {trial_run_name(sweep, r["trial_id"]) for r in rows if r["stopped_early"]}
    )
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_artifacts(rows, space, Path(tmp)) if rows else []
        (Path(tmp) / "space.yaml").write_text(yaml.safe_dump(space.model_dump(), sort_keys=False))
        paths.append(Path(tmp) / "space.yaml")
        tracking.log_artifacts(mlflow_uri, parent, paths)
    ranked = [r for r in rows if r[space.rank_by] is not None]
    sign = -1 if space.rank_mode == "min" else 1
    best = max(ranked, key=lambda r: sign * r[space.rank_by]) if ranked else None
    if best:
        tracking.log_metrics(mlflow_uri, parent, {f"best/{space.rank_by}": best[space.rank_by]})
    model_registry.alias_best(
        mlflow_uri, {trial_run_name(sweep, r["trial_id"]): sign * r[space.rank_by] for r in ranked}
    )
    failures = [
        (r["trial_id"] or posixpath.basename(posixpath.dirname(r["error_file"])), r["error"], r["error_file"])
        for r in rows
        if r["error"]
    ]
    return SweepSummary(parent, rows, best, [p.name for p in paths], failures)
