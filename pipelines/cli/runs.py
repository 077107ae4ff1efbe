"""The commands that run something on a Ray cluster: train, tune, demo, compare, scaling, study, submit.
Each checks its config and inputs first; a user error is one line and exit code 2, a run in which
everything failed exit code 1.

The Ray programs (torch, Ray Train, Ray Tune, MLflow: seconds to import) are imported inside each
command after its checks, so that a user error never waits for them."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from mdc.config import DEFAULT_CONFIG, derive, load_config
from mdc.data import storage
from mdc.objectives.sections import SECTIONS as OBJECTIVES  # the names, without torch
from pipelines.commands.search_space import load_space, ranking
from pipelines.infra import run_inputs
from pipelines.infra.console import VERBOSE_OPTION, Settings, console, report_failures, user_errors, warn


def suite():
    """mdc.evaluation.suite: the evaluation stack (torch, torchvision) takes seconds to import, so
    it comes in after the arguments are read."""
    from mdc.evaluation import suite as evaluation_suite  # seconds to import: only for a command that runs

    return evaluation_suite


def resolved(cfg):
    """The config with its eval section concrete (the training data's defaults, absolute folders),
    checked: a missing probe or an unreachable benchmark is one line before Ray starts."""
    return suite().resolve_section(cfg)


def ray_session(log_file: Path, address: str | None, verbose: bool):
    """pipelines.infra.ray_connection.ray_session, Ray imported only now: after a command's checks."""
    from pipelines.infra import ray_connection  # Ray: seconds to import

    return ray_connection.ray_session(log_file, address, verbose)


def checked(cfg):
    """`cfg` once everything it and its data's side files tell is checked (pipelines/infra/run_inputs.py):
    a mistake is one line in seconds, before torch, Ray or MLflow is imported; a warning is said."""
    run_inputs.check_data(cfg)
    for line in run_inputs.config_warnings(cfg):
        warn(line)
    return cfg


MAX_CONCURRENT_HELP = "runs at once (default: as many as the cluster's free CPUs/GPUs hold; 1 on a 2-core machine)"


def train(
    ctx: typer.Context,
    config: Path = typer.Option(DEFAULT_CONFIG, help="YAML run config"),
    data: Optional[str] = typer.Option(None, help="training shards URI (data.train_uri)"),
    val: Optional[str] = typer.Option(
        None, help="validation shards URI (data.val_uri); with --data and no --val, no validation split"
    ),
    storage: Optional[str] = typer.Option(None, help="checkpoint storage URI (storage_uri)"),
    mlflow_uri: Optional[str] = None,
    name: Optional[str] = None,
    num_workers: Optional[int] = None,
    use_gpu: Optional[bool] = None,
    address: Optional[str] = typer.Option(None, help="Ray cluster address; default: running or local"),
    verbose: bool = VERBOSE_OPTION,
):
    """Pretrain on the current Ray cluster. Extra arguments are `section.key=value` overrides."""
    Settings.verbose = verbose
    overrides = list(ctx.args)
    if data is not None and val is None and not any(o.startswith("data.val_uri=") for o in overrides):
        val = "null"  # the config's validation split belongs to its own training data (the demo's)
    for key, value in {
        "data.train_uri": data,
        "data.val_uri": val,
        "storage_uri": storage,
        "mlflow_uri": mlflow_uri,
        "name": name,
        "workers.count": num_workers,
        "workers.use_gpu": use_gpu,
    }.items():
        if value is not None:
            overrides.append(f"{key}={value}")
    with user_errors():
        cfg = resolved(run_inputs.absolute_paths(checked(load_config(config, overrides))))
        suite().check_section(cfg.eval, cfg.data.endpoint_url)  # the sets it names, before Ray starts
        # Ray and the Ray program: seconds to import, so after the checks
        from pipelines.infra.ray_output import run_log_path
        from pipelines.run.concurrency import interruptible
        from pipelines.run.driver import run_training

        with ray_session(run_log_path(cfg), address, verbose):
            summary = interruptible(lambda: run_training(cfg))  # Ctrl-C: MLflow KILLED, out at once
    console.print(
        f"[green]done[/green] {summary.run_name}: loss {summary.metrics.get('loss', float('nan')):.4f}, "
        f"checkpoint {summary.checkpoint_uri}, MLflow run {summary.mlflow_run_id}, "
        f"skipped {summary.bad_records or 'none'}",
        highlight=False,
    )


def tune(
    ctx: typer.Context,
    space: Path = typer.Option(..., help="search space YAML (tune_spaces/)"),
    config: Path = typer.Option(DEFAULT_CONFIG, help="base run config"),
    samples: Optional[int] = typer.Option(None, help="trials for a random space"),
    max_concurrent: Optional[int] = typer.Option(None, min=1, help=MAX_CONCURRENT_HELP.replace("runs", "trials")),
    name: Optional[str] = typer.Option(
        None, help="the sweep's name: its folder, MLflow parent run and registered model (default: RUN-SPACE)"
    ),
    address: Optional[str] = None,
    verbose: bool = typer.Option(False, "--verbose", help="Ray's own output, Ray Tune's status tables and tracebacks"),
):
    """Sweep a search space with Ray Tune (ASHA); every trial an MLflow child run and one progress
    line. Extra arguments are `section.key=value` overrides of the base config."""
    Settings.verbose = verbose
    with user_errors():
        base = load_config(config, list(ctx.args))
        search_space = load_space(space, base)  # a mistake in the space first: it is what the user just wrote
        base = resolved(run_inputs.absolute_paths(checked(base)))
        search_space = ranking(search_space, base)
        suite().check_section(base.eval, base.data.endpoint_url)
        from pipelines.commands.tune import (  # the Ray program: seconds to import, so after the checks
            run_sweep,
            sweep_folder,
        )

        with ray_session(sweep_folder(base, search_space, name) / "ray.log", address, verbose):
            summary = run_sweep(search_space, base, samples, max_concurrent, verbose, name)
    report_failures("trial", len(summary.rows), summary.failures)
    console.print(
        f"[green]best[/green] {summary.best}\nMLflow parent run {summary.parent_run_id}: "
        f"mlflow ui --backend-store-uri {base.mlflow_uri}",
        highlight=False,
    )


def demo(
    workdir: Path = typer.Option(Path("mdc-demo"), help="where runs, MLflow and the summary go"),
    num: Optional[int] = typer.Option(None, help="shapes images to generate (default: the demo's 9,000)"),
    steps: Optional[int] = None,
    verbose: bool = VERBOSE_OPTION,
):
    """The embedded default, end to end on this machine: local S3 server, shapes shards in a bucket,
    2-worker Ray training, MLflow in SQLite, then a summary with sample captions and report.html."""
    from pipelines.commands.demo import DEMO_IMAGES, run_demo  # the Ray program: seconds to import

    Settings.verbose = verbose
    overrides = [f"train.steps={steps}"] if steps else []
    with user_errors():
        run_demo(workdir, num=num or DEMO_IMAGES, overrides=overrides, verbose=verbose)


def compare(
    ctx: typer.Context,
    objectives: str = typer.Option(",".join(OBJECTIVES), help="comma-separated objectives"),
    workdir: Path = typer.Option(Path("mdc-compare"), help="runs, MLflow, the shapes data and the tables"),
    data: Optional[str] = typer.Option(
        None,
        help="training shards (an img2dataset folder, say), or a dataset `mdc data` wrote (its train/); "
        "default: shapes generated in WORKDIR",
    ),
    config: Path = typer.Option(DEFAULT_CONFIG, help="base YAML run config (its data paths are replaced)"),
    steps: Optional[int] = None,
    name: Optional[str] = None,
    max_concurrent: Optional[int] = typer.Option(None, min=1, help=MAX_CONCURRENT_HELP),
    address: Optional[str] = None,
    verbose: bool = VERBOSE_OPTION,
):
    """Train the objectives at one budget on one dataset; judge each on the config's eval section
    (eval.probes, eval.compositionality, eval.captions; by default the labels, pairs and val split
    of a dataset `mdc data` wrote); one table of probe and compositionality accuracy, BLEU-4/CIDEr-D,
    captions/s and training images/s (console, compare.md/.html, MLflow). Extra arguments are
    `section.key=value` overrides of the shared config (eval.samples=4, eval.limit=100, ...)."""
    Settings.verbose = verbose
    names = [o.strip() for o in objectives.split(",") if o.strip()]
    overrides = [*ctx.args, *([f"train.steps={steps}"] if steps else [])]
    with user_errors():
        base = load_config(config, overrides)
        for objective in names:  # every objective's config must be valid before anything trains
            derive(base, {"objective.name": objective})
        suite().check_section(base.eval, base.data.endpoint_url)  # the sets it names, before Ray starts
        if data:
            data = run_inputs.absolute_uri(data)
            storage.check_reachable(data, base.data.endpoint_url)
            train = suite().training_split(data, base.data.endpoint_url)
            probe_cfg = checked(derive(base, {"data.train_uri": train, "data.val_uri": None}))
            probe_cfg = resolved(probe_cfg)  # what judges the runs
            suite().require(probe_cfg, "probes", "mdc compare (its table's first column)")
        workdir = workdir.resolve()
        from pipelines.commands.compare import run_compare  # the Ray program: seconds to import, so after the checks

        with ray_session(workdir / "ray.log", address, verbose):
            rows, failures = run_compare(
                names, workdir, data, config, overrides, name, console=console, max_concurrent=max_concurrent
            )
    report_failures("objective", len(names), [f.as_tuple() for f in failures])


def scaling(
    ctx: typer.Context,
    sizes: str = typer.Option(..., help="subset sizes in pairs, K/M/B suffixes: 5M,10M,20M"),
    data: str = typer.Option(..., help="training split (local or s3://); manifest.json is in its parent"),
    name: str = typer.Option(..., help="experiment name: the parent MLflow run; runs are NAME-SIZE"),
    config: Path = typer.Option(DEFAULT_CONFIG, help="YAML run config shared by every size"),
    total: Optional[int] = typer.Option(None, min=1, help="pairs in the split (default: from manifest.json)"),
    storage_uri: Optional[str] = typer.Option(None, "--storage", help="checkpoint storage URI (storage_uri)"),
    mlflow_uri: Optional[str] = None,
    max_concurrent: Optional[int] = typer.Option(None, min=1, help=MAX_CONCURRENT_HELP),
    address: Optional[str] = typer.Option(None, help="Ray cluster address; default: running or local"),
    verbose: bool = VERBOSE_OPTION,
):
    """Dataset scaling: one model per nested subset size, the same steps each, judged on the config's
    eval section (the curve: its first probe's accuracy; by default the labels of a dataset `mdc data`
    wrote, else name one: 'eval.probes=[{dataset: cifar10, root: DIR}]'); a size with a stored result
    is skipped. Extra arguments are `section.key=value` overrides; the validation split is the `val`
    beside --data when the manifest lists one, unless `data.val_uri=` is given."""
    from pipelines.commands import scaling as experiment  # the Ray program: seconds to import

    Settings.verbose = verbose
    with user_errors():
        data = run_inputs.absolute_uri(data)
        overrides = [f"data.train_uri={data}"]
        overrides += [f"{k}={v}" for k, v in {"storage_uri": storage_uri, "mlflow_uri": mlflow_uri}.items() if v]
        base = run_inputs.absolute_paths(load_config(config, overrides + list(ctx.args)))
        size_list = experiment.parse_sizes(sizes)
        root = suite().dataset_root(data)
        manifest_uri, manifest = experiment.read_dataset_manifest(root, base.data.endpoint_url)
        total = total or experiment.split_total(data, manifest_uri, manifest, base.data.endpoint_url)
        for size in size_list:
            experiment.subset_fraction(size, total)
        if "val" in manifest.get("splits", {}) and not any(arg.startswith("data.val_uri=") for arg in ctx.args):
            base = derive(base, {"data.val_uri": storage.join(root, "val")})
        base = resolved(base)
        suite().require(base, "probes", "mdc scaling (its curve is the first probe's accuracy)")
        run_inputs.check_inputs(checked(base))  # after the sizes and the manifest: what the user just named
        log = (Path(base.storage_uri) if "://" not in base.storage_uri else Path("mdc-logs")).resolve() / name
        with ray_session(log / "ray.log", address, verbose):
            rows, failures = experiment.run_scaling(base, size_list, total, name, max_concurrent)
    report_failures("size", len(size_list), [f.as_tuple() for f in failures])


def print_claims(claims: list[dict]) -> None:
    table = Table(title="claims (a − b, paired by seed, 95% Student-t interval)")
    for column in ("claim", "metric", "a", "b", "n", "mean a − b", "95% CI", "verdict"):
        table.add_column(column)
    for c in claims:
        table.add_row(
            c["name"],
            c["metric"],
            c["arm_a"],
            c["arm_b"] or "0",
            str(len(c["seeds"])),
            f"{c['mean_diff']:+.4f}",
            f"[{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]",
            c["verdict"],
        )
    console.print(table)


def study(
    plan: Path = typer.Option(..., help="study plan YAML (studies/)"),
    out: Optional[Path] = typer.Option(None, help="runs, MLflow and the report (default: runs/study-NAME)"),
    max_concurrent: Optional[int] = typer.Option(None, min=1, help=MAX_CONCURRENT_HELP),
    address: Optional[str] = typer.Option(None, help="Ray cluster address; default: running or local"),
    verbose: bool = VERBOSE_OPTION,
):
    """Run a study plan: every arm × seed trained through Ray Train (finished runs are not repeated),
    evaluated, and each claim judged by a Student-t interval over seed-paired differences
    (study.json, results.md, claims.png; MLflow)."""
    from pipelines.commands import study as studies  # the Ray program: seconds to import

    Settings.verbose = verbose
    with user_errors(studies.StudyError):
        parsed = studies.load_plan(plan)
        directory = (out or Path("runs") / f"study-{parsed.name}").resolve()
        configs = studies.run_configs(parsed, plan, directory)
        studies.check_data(parsed)
        studies.check_sets(configs, directory)
        with ray_session(directory / "ray.log", address, verbose):
            claims, failures = studies.run_study(parsed, plan, directory, max_concurrent)
    report_failures("run", len(parsed.arms) * len(parsed.seeds), [f.as_tuple() for f in failures])
    if failures:
        console.print("the claims are judged once every run has finished: launch the study again", highlight=False)
        raise typer.Exit(1)
    print_claims(claims)
    console.print(f"report: {directory / 'results.md'}, {directory / 'study.json'}, {directory / 'claims.png'}")


def submit(
    ctx: typer.Context,
    address: Optional[str] = typer.Option(
        None, help="Ray dashboard URL, e.g. http://HEAD:8265 (default: RAY_ADDRESS, else the local head)"
    ),
    submission_id: Optional[str] = typer.Option(None, help="stable job id (default: mdc-<run name>)"),
    working_dir: Path = typer.Option(Path("."), help="uploaded as the job's working directory"),
    no_upload: bool = typer.Option(
        False, "--no-upload", help="upload nothing: run the code installed in the cluster image"
    ),
    env: List[str] = typer.Option([], help="KEY=VALUE environment variable for the job (repeatable)"),
    pip: List[str] = typer.Option([], help="extra pip requirement for the job (repeatable)"),
    no_wait: bool = typer.Option(False, "--no-wait", help="submit and exit without following the log"),
):
    """Run `-- mdc train|scaling ...` as a Ray job on the cluster: idempotent by submission id, follows
    its log, exits with its outcome."""
    from pipelines.commands import submit as submission  # Ray's job client: seconds to import

    entrypoint = list(ctx.args)
    if not entrypoint:
        submission.console.print(
            "[red]error:[/red] give the command after --, e.g. mdc submit -- mdc train --name run-1"
        )
        raise typer.Exit(2)
    upload = None if no_upload else working_dir
    if submission_id is None:
        name = submission.run_name_of(entrypoint, upload)
        if name is None:
            submission.console.print(
                "[red]error:[/red] the command names no run (--name or a config with `name`): give --submission-id"
            )
            raise typer.Exit(2)
        submission_id = submission.default_submission_id(name)
    try:
        environment = submission.runtime_env(upload, env, pip)
    except ValueError as err:
        submission.console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None

    client, statuses = submission.connect(address)
    plan = submission.plan_submission(submission_id, statuses)
    if plan.action == "done":
        submission.console.print(f"{plan.submission_id} already SUCCEEDED: nothing to do")
        return
    if plan.action == "follow":
        submission.console.print(f"{plan.submission_id} is {plan.status}: following it instead of submitting again")
    else:
        if plan.status:
            submission.console.print(
                f"{submission_id}: the last attempt {plan.status}; resubmitting as {plan.submission_id}"
            )
        client.submit_job(
            entrypoint=shlex.join(entrypoint),
            submission_id=plan.submission_id,
            runtime_env=environment,
            metadata={"mdc.submission": submission_id},
        )
        submission.console.print(f"submitted {plan.submission_id}: {shlex.join(entrypoint)}")
    if no_wait:
        return
    status = submission.follow(client, plan.submission_id)
    submission.console.print(f"{plan.submission_id} {status}")
    if status != "SUCCEEDED":
        raise typer.Exit(1)
