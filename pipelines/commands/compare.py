"""`mdc compare`: train the chosen objectives at one budget on one dataset and put them in one table.

Every objective is trained through the same Ray Train pipeline with the same config (steps, batch,
model, data, eval section; only `objective.name` differs) and judged on the run's eval section
(mdc/evaluation/suite.py: the probes, benchmarks and caption sets it names), as every command
judges an encoder; each figure is logged to the objective's run under its eval key. The table shows
the first probe's accuracy, the first benchmark's macro accuracy beside its blind accuracy and
text-biased subsets, BLEU-4 / CIDEr-D / captions per second of the first caption set at its first
N' (CLIP writes none), training images per second and the final loss, each column headed by its
key. It goes to the console, to compare.md and compare.html, and to MLflow: a parent run holding
both files, with each objective's training run as its child (pipelines/commands/experiment.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mdc.config import RunConfig, derive, load_config
from mdc.data import shards
from mdc.data.shapes import write_shapes_dataset
from mdc.evaluation import suite
from mdc.registry import OBJECTIVES
from pipelines.commands import experiment
from pipelines.infra import tracking
from pipelines.run import reports

DEFAULT_OBJECTIVES = tuple(OBJECTIVES)
RESULT = "row.json"  # WORKDIR/runs/RUN/row.json, written last


def columns(cfg: RunConfig) -> dict[str, str]:
    """The table's columns: title -> the figure's key (the eval section's first sets)."""
    ev, out = cfg.eval, {}
    if ev.probes:
        out[suite.probe_key(ev.probes[0].key)] = suite.probe_key(ev.probes[0].key)
    if ev.compositionality:
        name = ev.compositionality[0].key
        out[suite.compositionality_key(name, suite.MACRO)] = suite.compositionality_key(name, suite.MACRO)
        out["blind"] = suite.compositionality_key(name, suite.MACRO, blind=True)
        out["text-biased subsets"] = f"text_biased:{name}"
    if ev.captions:
        spec = ev.captions[0]
        for figure in suite.CAPTION_FIGURES:
            key = suite.captions_key(spec.name, spec.lengths[0], figure)
            out[key] = key
    return out | {"train images/s": "images_per_s", "final loss": "loss"}


def cells(row: dict, table: dict[str, str]) -> list[str]:
    """One row of the table: "n/a" where an objective has no such figure (CLIP writes no captions)."""
    metrics, out = row["metrics"], [row["objective"]]
    for key in table.values():
        if key.startswith("text_biased:"):
            out.append(", ".join(suite.text_biased(metrics, key.split(":", 1)[1])) or "none")
        else:
            out.append("n/a" if metrics.get(key) is None else f"{metrics[key]:.4g}")
    return out


def compare_config(base: RunConfig, objective: str, train_uri: str, name: str) -> RunConfig:
    """The base config with this objective and run name on the shared training data, no val loss
    (the evaluation is the table), its eval section made concrete."""
    return suite.resolve_section(
        derive(
            base,
            {
                "name": f"{name}-{objective}",
                "objective.name": objective,
                "data.train_uri": train_uri,
                "data.val_uri": None,
            },
        )
    )


def write_tables(title: str, rows: list[dict], table: dict[str, str], workdir: Path, console: Console) -> list[Path]:
    """compare.md, compare.html and the console's table."""
    titles = ["objective", *table]
    body = [cells(row, table) for row in rows]
    (workdir / "compare.md").write_text(f"# {title}\n\n{reports.markdown_table(titles, body)}")
    (workdir / "compare.html").write_text(
        reports.page(title, [("Objectives", reports.table_html([dict(zip(titles, line)) for line in body]))])
    )
    rich = Table(title=title)
    for header in titles:
        rich.add_column(header, justify="left" if header == "objective" else "right")
    for line in body:
        rich.add_row(*line)
    console.print(rich)
    return [workdir / "compare.md", workdir / "compare.html"]


def compare_configs(
    objectives: Sequence[str],
    workdir: Path,
    data_uri: str | None,
    base: RunConfig,
    name: str,
    num_images: int,
    console: Console,
) -> dict[str, RunConfig]:
    """Every objective's config, checked before anything trains (its eval section too); without
    `data_uri`, `num_images` shapes are generated into workdir/shapes (once)."""
    if data_uri is None:
        data_uri = str(workdir / "shapes")
        if not (workdir / "shapes" / shards.MANIFEST).is_file():
            console.print(f"writing {num_images} shapes images to {data_uri}")
            write_shapes_dataset(data_uri, num=num_images, seed=base.train.seed)
    train_uri = suite.training_split(data_uri, base.data.endpoint_url)
    configs = {objective: compare_config(base, objective, train_uri, name) for objective in objectives}
    suite.require(next(iter(configs.values())), "probes", "mdc compare (its table's first column)")
    return configs


def run_compare(
    objectives: Sequence[str],
    workdir: Path,
    data_uri: str | None = None,
    config: Path | None = None,
    overrides: Sequence[str] = (),
    name: str | None = None,
    num_images: int = 2000,
    console: Console | None = None,
    max_concurrent: int | None = None,
) -> tuple[list[dict], list[experiment.Failure]]:
    """Train and judge every objective; write the table (console, compare.md/.html, MLflow).
    Returns the rows (one per objective that finished) and the failures.

    `config` (default: none, the built-in defaults) and `overrides` make the shared budget; runs,
    MLflow and the tables go under `workdir`. `data_uri`: the training shards, or a dataset `mdc data`
    wrote (its train/ split); without it, `num_images` shapes are generated into workdir/shapes (once).
    `max_concurrent` objectives train at once (default: what fits the cluster)."""
    console = console or Console()
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    name = name or f"compare-{time.strftime('%Y%m%d-%H%M%S')}"  # a reused run name would resume, not train
    base = load_config(
        config, [f"storage_uri={workdir / 'checkpoints'}", f"mlflow_uri=sqlite:///{workdir / 'mlflow.db'}", *overrides]
    )
    configs = compare_configs(objectives, workdir, data_uri, base, name, num_images, console)
    first = next(iter(configs.values()))
    params = {"objectives": ",".join(objectives), **first.model_dump()}
    with experiment.parent_run(first, name, params) as parent:
        results = experiment.run_runs(
            parent, configs, lambda cfg: str(workdir / "runs" / cfg.name / RESULT), max_concurrent
        )
        rows = [{"objective": objective, **result} for objective, result in results.items()]
        title = f"mdc compare: {', '.join(objectives)} on {first.data.train_uri}, {base.train.steps} steps"
        files = write_tables(title, rows, columns(first), workdir, console)
        tracking.log_artifacts(parent.mlflow_uri, parent.run_id, files, "eval")
    console.print(f"table: {workdir / 'compare.md'}, {workdir / 'compare.html'}; MLflow parent run {parent.run_id}")
    return rows, parent.failures
