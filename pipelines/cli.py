"""`mdc` command line. Configs and inputs are checked before Ray starts; a user error is one line
and exit code 2, a run in which everything failed exit code 1."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mdc.config import DEFAULT_CONFIG, load_config
from mdc.registry import OBJECTIVES
from pipelines.console import VERBOSE_OPTION, Settings, console, report_failures, user_errors
from pipelines.evaluate import eval_app
from pipelines.scaling import scaling
from pipelines.study import study
from pipelines.submit import submit

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
data_app = typer.Typer(no_args_is_help=True, help="Write datasets as shards (local path or s3://).")
app.add_typer(data_app, name="data")
app.add_typer(eval_app, name="eval")



@data_app.command("shapes")
def data_shapes(out: str = typer.Option(..., help="output folder or s3://bucket/prefix"),
                num: int = typer.Option(2000, min=1), seed: int = 0,
                format: str = typer.Option("webdataset", help="webdataset | parquet"),
                endpoint_url: Optional[str] = None):
    """The generated compositional shapes dataset (train/, val/, compositionality files)."""
    from mdc.data.shapes import write_shapes_dataset

    manifest = write_shapes_dataset(out, num=num, seed=seed, format=format, endpoint_url=endpoint_url)
    console.print(manifest)


@data_app.command("tuxpaint")
def data_tuxpaint(out: str = typer.Option(..., help="output folder or s3://bucket/prefix"),
                  format: str = typer.Option("webdataset", help="webdataset | parquet"),
                  endpoint_url: Optional[str] = None):
    """Debian's tuxpaint-stamps-default (real images with English captions) as shards."""
    from mdc.data.tuxpaint import write_tuxpaint_dataset

    manifest = write_tuxpaint_dataset(out, format=format, endpoint_url=endpoint_url)
    console.print(manifest)


@data_app.command("img2dataset")
def data_img2dataset(out: str = typer.Option(..., help="output folder (local)"),
                     format: str = typer.Option("webdataset", help="img2dataset's --output_format: webdataset | parquet"),
                     num: int = typer.Option(200, min=1), samples_per_shard: int = typer.Option(50, min=1),
                     image_size: int = typer.Option(64, min=8, help="shorter side of the JPEGs"),
                     damaged: bool = typer.Option(False, help="also break it as real downloads break")):
    """A folder laid out exactly as img2dataset writes it (side files, failed rows), from generated images."""
    from mdc.data.img2dataset import damage_folder, generated_rows, write_img2dataset_folder

    with user_errors(ValueError):
        stats = write_img2dataset_folder(generated_rows(num, image_size), out, format, samples_per_shard)
    console.print({k: stats[k] for k in ("count", "successes", "failed_to_download", "failed_to_resize")})
    if damaged:
        console.print({"damaged": damage_folder(out, format)})


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(ctx: typer.Context,
          config: Path = typer.Option(DEFAULT_CONFIG, help="YAML run config"),
          data: Optional[str] = typer.Option(None, help="training shards URI (data.train_uri)"),
          val: Optional[str] = typer.Option(None, help="validation shards URI (data.val_uri); with --data "
                                                       "and no --val, no validation split"),
          storage: Optional[str] = typer.Option(None, help="checkpoint storage URI (storage_uri)"),
          mlflow_uri: Optional[str] = None, name: Optional[str] = None,
          num_workers: Optional[int] = None, use_gpu: Optional[bool] = None,
          address: Optional[str] = typer.Option(None, help="Ray cluster address; default: running or local"),
          verbose: bool = VERBOSE_OPTION):
    """Pretrain on the current Ray cluster. Extra arguments are `section.key=value` overrides."""
    Settings.verbose = verbose
    overrides = list(ctx.args)
    if data is not None and val is None and not any(o.startswith("data.val_uri=") for o in overrides):
        val = "null"  # the config's validation split belongs to its own training data (the demo's)
    for key, value in {"data.train_uri": data, "data.val_uri": val, "storage_uri": storage, "mlflow_uri": mlflow_uri,
                       "name": name, "train.num_workers": num_workers, "train.use_gpu": use_gpu}.items():
        if value is not None:
            overrides.append(f"{key}={value}")
    with user_errors():
        from pipelines.runtime import absolute_paths, check_inputs, ray_session, run_log_path

        cfg = absolute_paths(load_config(config, overrides))
        check_inputs(cfg)
        from pipelines.train import run_training  # torch and Ray Train: seconds, so after the checks

        with ray_session(run_log_path(cfg), address, verbose):
            summary = run_training(cfg)
    console.print(f"[green]done[/green] {summary.run_name}: loss {summary.metrics.get('loss', float('nan')):.4f}, "
                  f"checkpoint {summary.checkpoint_uri}, MLflow run {summary.mlflow_run_id}, "
                  f"skipped {summary.skipped or 'none'}", highlight=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def tune(ctx: typer.Context,
         space: Path = typer.Option(..., help="search space YAML (tune_spaces/)"),
         config: Path = typer.Option(DEFAULT_CONFIG, help="base run config"),
         samples: Optional[int] = typer.Option(None, help="trials for a random space"),
         max_concurrent: int = typer.Option(1, help="trials at once (1–2 on a 2-core machine)"),
         address: Optional[str] = None, verbose: bool = VERBOSE_OPTION):
    """Sweep a search space with Ray Tune (ASHA); every trial an MLflow child run. Extra
    arguments are `section.key=value` overrides of the base config."""
    Settings.verbose = verbose
    with user_errors():
        from pipelines.runtime import absolute_paths, check_inputs, ray_session
        from pipelines.search_space import load_space
        from pipelines.tune import run_sweep, sweep_folder

        base = absolute_paths(load_config(config, list(ctx.args)))
        search_space = load_space(space, base)
        check_inputs(base)
        with ray_session(sweep_folder(base, search_space) / "ray.log", address, verbose):
            summary = run_sweep(search_space, base, samples, max_concurrent)
    report_failures("trial", len(summary.rows), summary.failures)
    console.print(f"[green]best[/green] {summary.best}\nMLflow parent run {summary.parent_run_id}: "
                  f"mlflow ui --backend-store-uri {base.mlflow_uri}", highlight=False)


@app.command()
def demo(workdir: Path = typer.Option(Path("mdc-demo"), help="where runs, MLflow and the summary go"),
         num: Optional[int] = typer.Option(None, help="shapes images to generate (default: the demo's 9,000)"),
         steps: Optional[int] = None, verbose: bool = VERBOSE_OPTION):
    """The embedded default, end to end on this machine: local S3 server, shapes shards in a bucket,
    2-worker Ray training, MLflow in SQLite, then a summary with sample captions and report.html."""
    from pipelines.demo import DEMO_IMAGES, run_demo

    Settings.verbose = verbose
    overrides = [f"train.steps={steps}"] if steps else []
    with user_errors():
        run_demo(workdir, num=num or DEMO_IMAGES, overrides=overrides, verbose=verbose)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def compare(ctx: typer.Context,
            objectives: str = typer.Option(",".join(OBJECTIVES), help="comma-separated objectives"),
            workdir: Path = typer.Option(Path("mdc-compare"), help="runs, MLflow, the shapes data and the tables"),
            data: Optional[str] = typer.Option(None, help="shapes-like shards (default: generate shapes in WORKDIR)"),
            config: Path = typer.Option(DEFAULT_CONFIG, help="base YAML run config (its data paths are replaced)"),
            steps: Optional[int] = None, name: Optional[str] = None,
            caption_length: int = typer.Option(10, min=1, help="caption length N' for BLEU-4 / CIDEr-D"),
            limit: int = typer.Option(200, min=1, help="images per evaluation (captions, each compositionality subset)"),
            samples: int = typer.Option(8, min=1, help="Monte Carlo draws per caption score"),
            address: Optional[str] = None, verbose: bool = VERBOSE_OPTION):
    """Train the objectives at one budget on one dataset; one table of probe and compositionality
    accuracy, BLEU-4/CIDEr-D, captions/s and training images/s (console, compare.md/.html, MLflow).
    Extra arguments are `section.key=value` overrides of the shared config."""
    Settings.verbose = verbose
    names = [o.strip() for o in objectives.split(",") if o.strip()]
    overrides = [*ctx.args, *([f"train.steps={steps}"] if steps else [])]
    with user_errors():
        from mdc.data.storage import check_reachable, join
        from pipelines.compare import run_compare
        from pipelines.runtime import absolute_uri, ray_session

        base = load_config(config, overrides)
        for objective in names:  # every objective's config must be valid before anything trains
            load_config(config, [*overrides, f"objective.name={objective}"])
        if data:
            data = absolute_uri(data)
            check_reachable(join(data, "train"), base.data.endpoint_url)
        workdir = workdir.resolve()
        with ray_session(workdir / "ray.log", address, verbose):
            run_compare(names, workdir, data, config, overrides, name, caption_length, limit, samples,
                        console=console)


EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
app.command("submit", context_settings=EXTRA_ARGS)(submit)
app.command("scaling", context_settings=EXTRA_ARGS)(scaling)
app.command("study")(study)


if __name__ == "__main__":
    app()
