"""`mdc` command line. Configs are validated before Ray or any storage is touched."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from mdc.config import ConfigError, load_config
from pipelines.evaluate import eval_app
from pipelines.scaling import scaling
from pipelines.submit import submit

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
data_app = typer.Typer(no_args_is_help=True, help="Write datasets as shards (local path or s3://).")
app.add_typer(data_app, name="data")
app.add_typer(eval_app, name="eval")
console = Console()

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


@data_app.command("shapes")
def data_shapes(out: str = typer.Option(..., help="output folder or s3://bucket/prefix"),
                num: int = typer.Option(2000, min=1), seed: int = 0,
                format: str = typer.Option("webdataset", help="webdataset | parquet"),
                endpoint_url: Optional[str] = None):
    """The generated compositional shapes dataset (train/, val/, compositionality files)."""
    from mdc.datasets.shapes import write_shapes_dataset

    manifest = write_shapes_dataset(out, num=num, seed=seed, format=format, endpoint_url=endpoint_url)
    console.print(manifest)


@data_app.command("tuxpaint")
def data_tuxpaint(out: str = typer.Option(..., help="output folder or s3://bucket/prefix"),
                  format: str = typer.Option("webdataset", help="webdataset | parquet"),
                  endpoint_url: Optional[str] = None):
    """Debian's tuxpaint-stamps-default (real images with English captions) as shards."""
    from mdc.datasets.tuxpaint import write_tuxpaint_dataset

    manifest = write_tuxpaint_dataset(out, format=format, endpoint_url=endpoint_url)
    console.print(manifest)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(ctx: typer.Context,
          config: Path = typer.Option(DEFAULT_CONFIG, help="YAML run config"),
          data: Optional[str] = typer.Option(None, help="training shards URI (data.train_uri)"),
          storage: Optional[str] = typer.Option(None, help="checkpoint storage URI (storage_uri)"),
          mlflow_uri: Optional[str] = None, name: Optional[str] = None,
          num_workers: Optional[int] = None, use_gpu: Optional[bool] = None,
          address: Optional[str] = typer.Option(None, help="Ray cluster address; default: running or local")):
    """Pretrain on the current Ray cluster. Extra arguments are `section.key=value` overrides."""
    overrides = list(ctx.args)
    for key, value in {"data.train_uri": data, "storage_uri": storage, "mlflow_uri": mlflow_uri,
                       "name": name, "train.num_workers": num_workers, "train.use_gpu": use_gpu}.items():
        if value is not None:
            overrides.append(f"{key}={value}")
    try:
        cfg = load_config(config, overrides)
    except ConfigError as err:
        _fail(str(err))
    from pipelines.runtime import connect_ray
    from pipelines.train import run_training

    connect_ray(address)
    summary = run_training(cfg)
    console.print(f"[green]done[/green] {summary.run_name}: loss {summary.metrics.get('loss', float('nan')):.4f}, "
                  f"checkpoint {summary.checkpoint_uri}, MLflow run {summary.mlflow_run_id}, "
                  f"skipped {summary.skipped or 'none'}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def tune(ctx: typer.Context,
         space: Path = typer.Option(..., help="search space YAML (tune_spaces/)"),
         config: Path = typer.Option(DEFAULT_CONFIG, help="base run config"),
         samples: Optional[int] = typer.Option(None, help="trials for a random space"),
         max_concurrent: int = typer.Option(1, help="trials at once (1–2 on a 2-core machine)"),
         address: Optional[str] = None):
    """Sweep a search space with Ray Tune (ASHA); every trial an MLflow child run. Extra
    arguments are `section.key=value` overrides of the base config."""
    from pipelines.search_space import load_space

    try:
        base = load_config(config, list(ctx.args))
        search_space = load_space(space, base)
    except ConfigError as err:
        _fail(str(err))
    from pipelines.runtime import connect_ray
    from pipelines.tune import run_sweep

    connect_ray(address)
    summary = run_sweep(search_space, base, samples, max_concurrent)
    for row in summary.rows:
        console.print(row)
    console.print(f"[green]best[/green] {summary.best}\nMLflow parent run {summary.parent_run_id}: "
                  f"mlflow ui --backend-store-uri {base.mlflow_uri}")


@app.command()
def demo(workdir: Path = typer.Option(Path("mdc-demo"), help="where runs, MLflow and the summary go"),
         num: Optional[int] = typer.Option(None, help="shapes images to generate (default: the demo's 9,000)"),
         steps: Optional[int] = None):
    """The embedded default, end to end on this machine: local S3 server, shapes shards in a bucket,
    2-worker Ray training, MLflow in SQLite, then a summary with sample captions."""
    from pipelines.demo import DEMO_IMAGES, run_demo

    overrides = [f"train.steps={steps}"] if steps else []
    run_demo(workdir, num=num or DEMO_IMAGES, overrides=overrides, console=console)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def compare(ctx: typer.Context,
            objectives: str = typer.Option("mdc,ar,cappa,cmlm,bert,clip,cdlm", help="comma-separated objectives"),
            workdir: Path = typer.Option(Path("mdc-compare"), help="runs, MLflow, the shapes data and the tables"),
            data: Optional[str] = typer.Option(None, help="shapes-like shards (default: generate shapes in WORKDIR)"),
            config: Path = typer.Option(DEFAULT_CONFIG, help="base YAML run config (its data paths are replaced)"),
            steps: Optional[int] = None, name: Optional[str] = None,
            caption_length: int = typer.Option(10, min=1, help="caption length N' for BLEU-4 / CIDEr-D"),
            limit: int = typer.Option(200, min=1, help="images per evaluation (captions, each compositionality subset)"),
            samples: int = typer.Option(8, min=1, help="Monte Carlo draws per caption score"),
            address: Optional[str] = None):
    """Train the objectives at one budget on one dataset; one table of probe and compositionality
    accuracy, BLEU-4/CIDEr-D, captions/s and training images/s (console, compare.md/.html, MLflow).
    Extra arguments are `section.key=value` overrides of the shared config."""
    names = [o.strip() for o in objectives.split(",") if o.strip()]
    overrides = [*ctx.args, *([f"train.steps={steps}"] if steps else [])]
    try:
        for objective in names:  # every objective's config must be valid before anything trains
            load_config(config, [*overrides, f"objective.name={objective}"])
    except ConfigError as err:
        _fail(str(err))
    from pipelines.compare import run_compare
    from pipelines.runtime import connect_ray

    connect_ray(address)
    run_compare(names, workdir, data, config, overrides, name, caption_length, limit, samples, console=console)


EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
app.command("submit", context_settings=EXTRA_ARGS)(submit)
app.command("scaling", context_settings=EXTRA_ARGS)(scaling)


if __name__ == "__main__":
    app()
