"""`mdc schedule`: which noise interval [ω_l, ω_u] gives MDC's training loss the least variance on your
captions (mdc/schedule.py; no Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from mdc.config import DEFAULT_CONFIG, load_config
from pipelines.infra.console import VERBOSE_OPTION, Settings, console, user_errors


def _ci(ci) -> str:
    return "" if ci is None else f"[{ci[0]:.3g}, {ci[1]:.3g}]"


def print_result(result: dict) -> None:
    # torch and the model stack take seconds to import: only once the arguments are read
    from mdc.schedule import BD3LM_NOTE
    from pipelines.commands.schedule import FULL, PAPER

    table = Table(title=f"MDC loss estimator, {result['draws_label']}")
    for column in (
        "[ω_l, ω_u]",
        "mean loss",
        "loss Var/mean²",
        "95% CI",
        "masking alone (closed form)",
        "grad tr Cov/|Eg|²",
        "95% CI",
    ):
        table.add_column(column, justify="right")
    for (low, high), r in sorted(result["rows"].items()):
        mark = " *" if (low, high) == result["recommended"] else ""
        grad = "" if r["grad_relvar"] is None else f"{r['grad_relvar']:.3g}"
        table.add_row(
            f"[{low:g}, {high:g}]{mark}",
            f"{r['mean_loss']:.4g}",
            f"{r['loss_relvar']:.3g}",
            _ci(r["loss_relvar_ci"]),
            f"{r['closed_form_masking_relvar']:.3g}",
            grad,
            _ci(r["grad_relvar_ci"]),
        )
    console.print(table)
    console.print(
        "loss: the mean estimate; Var/mean²: the loss estimator's relative variance; closed form: what the "
        "masking alone adds for a constant per-token loss; grad: tr Cov(g) / |E g|² on the sampled coordinates"
    )
    rows = result["rows"]
    for quantity, ci in result["ratios"].items():
        key = f"{quantity}_relvar"
        point = rows[FULL][key] / rows[PAPER][key]
        verdict = "excludes 1" if ci[0] > 1 or ci[1] < 1 else "does NOT exclude 1"
        console.print(f"{quantity}: [0, 1] / [0.5, 1] relative variance = {point:.3g}, 95% CI {_ci(ci)} ({verdict})")
    low, high = result["recommended"]
    console.print(
        f"recommended: [{low:g}, {high:g}] (least loss Var/mean² among intervals at least "
        f"{result['options']['min_width']:g} wide)"
        + (
            f"; by the gradient: {list(result['recommended_by_gradient'])}"
            if "recommended_by_gradient" in result
            else ""
        )
    )
    console.print(f"the paper: [0.5, 1] (CC3M). {BD3LM_NOTE}.")
    console.print(f"heat map: {result['heat_map']}  ({result['seconds']:.0f} s)")


def schedule_command(
    ctx: typer.Context,
    config: Path = typer.Option(DEFAULT_CONFIG, help="YAML run config: its data.train_uri's captions, its model"),
    checkpoint: Optional[str] = typer.Option(None, help="a checkpoint to measure instead of random init"),
    step: float = typer.Option(0.25, min=0.01, max=0.5, help="grid step of ω_l and ω_u (BD3-LM: 0.05)"),
    draws: int = typer.Option(200, min=10, help="seeded draws (batch, t, masks) per interval"),
    batch_size: Optional[int] = typer.Option(None, min=1, help="captions per draw (default: train.batch_size)"),
    captions: int = typer.Option(512, min=2, help="captions drawn from data.train_uri"),
    grad_coordinates: int = typer.Option(2048, min=0, help="gradient coordinates sampled (0: the loss only)"),
    min_width: float = typer.Option(0.5, min=0.0, max=1.0, help="narrowest interval recommended"),
    seed: int = 0,
    threads: int = typer.Option(1, min=1, help="torch threads: tiny draws run faster on one"),
    out: Path = typer.Option(Path("runs/schedule"), help="schedule.json and schedule.png go here"),
    no_mlflow: bool = typer.Option(False, "--no-mlflow", help="do not log to the config's MLflow"),
    verbose: bool = VERBOSE_OPTION,
):
    """Estimate, over seeded draws, the relative variance of MDC's training loss (and gradient) for a
    grid of [ω_l, ω_u] on the config's captions; print a table, write a heat map, recommend the
    interval. Extra arguments are `section.key=value` overrides."""
    Settings.verbose = verbose
    with user_errors(ValueError, FileNotFoundError):
        cfg = load_config(config, list(ctx.args))
        import torch  # seconds to import: after the config is read

        torch.set_num_threads(threads)
        from pipelines.commands.schedule import ScheduleOptions, metrics, run_schedule  # torch: seconds

        opts = ScheduleOptions(step, draws, batch_size, captions, grad_coordinates, min_width, seed=seed)
        result = run_schedule(cfg, checkpoint, opts, out)
    result["draws_label"] = f"{draws} draws of {result['batch_size']} captions ({result['mean_words']:.1f} words)"
    print_result(result)
    if not no_mlflow:
        from pipelines.infra import tracking  # MLflow: seconds to import, and not with --no-mlflow

        params = {"config": str(config), "checkpoint": checkpoint or "random init", **opts.__dict__}
        run_id = tracking.log_evaluation(
            cfg.mlflow_uri, metrics(result), [out / "schedule.json", out / "schedule.png"], None, "schedule", params
        )
        console.print(f"MLflow: run {run_id} ({cfg.mlflow_uri})")
