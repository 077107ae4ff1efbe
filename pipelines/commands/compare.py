"""`mdc compare`: train the chosen objectives at one budget on one dataset and put them in one table.

Every objective is trained through the same Ray Train pipeline with the same config (steps, batch,
model, data; only `objective.name` differs), then its exported checkpoint is evaluated in this process:
- probe: linear-probe top-1 on the dataset's labels (train/ fits, val/ tests), the encoder frozen;
- compositionality: macro accuracy over the dataset's ARO and SugarCrepe files, with the objective's
  own scorer (exact AR likelihood, Monte Carlo ELBO, CLIP cosine, denoising score), beside its
  blind accuracy (each caption pair scored against another item's image) and the subsets whose
  blind accuracy marks them as length- or text-biased;
- BLEU-4 / CIDEr-D and captions per second of captions written at N' = `caption_length` on val/
  (CLIP writes none);
- training images per second over the run (all workers).
The table goes to the console, to compare.md and compare.html, and to MLflow: a parent run holding
every row's metrics and both files, with each objective's training run as its child.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mdc.config import RunConfig, derive, load_config
from mdc.data import shards
from mdc.data.shapes import write_shapes_dataset
from mdc.data.storage import join
from mdc.evaluation import captioning
from mdc.evaluation import compositionality as comp
from mdc.evaluation import probe as linear_probe
from mdc.registry import OBJECTIVES
from mdc.training.checkpoint import load_pretrained
from pipelines.infra import progress, tracking
from pipelines.run import concurrency, reports
from pipelines.run.driver import run_training

DEFAULT_OBJECTIVES = tuple(OBJECTIVES)
COLUMNS = {  # field -> (column title, format)
    "objective": ("objective", "{}"),
    "probe_accuracy": ("probe acc.", "{:.3f}"),
    "compositionality_accuracy": ("compositionality acc.", "{:.3f}"),
    "compositionality_blind_accuracy": ("blind acc.", "{:.3f}"),
    "text_biased": ("text-biased subsets", "{}"),
    "bleu4": ("BLEU-4", "{:.4f}"),
    "cider": ("CIDEr-D", "{:.4f}"),
    "captions_per_s": ("captions/s", "{:.1f}"),
    "train_images_per_s": ("train images/s", "{:.1f}"),
    "final_loss": ("final loss", "{:.3f}"),
}


@dataclass
class Row:
    objective: str
    probe_accuracy: float
    compositionality_accuracy: float
    compositionality_blind_accuracy: float | None
    text_biased: str  # comma-separated subsets whose blind accuracy is above BLIND_BIAS_THRESHOLD
    bleu4: float | None
    cider: float | None
    captions_per_s: float | None
    train_images_per_s: float
    final_loss: float
    checkpoint: str
    mlflow_run_id: str

    def cells(self) -> list[str]:
        """The table row; "n/a" where an objective has no such number (CLIP writes no captions)."""
        return ["n/a" if getattr(self, f) is None else fmt.format(getattr(self, f)) for f, (_, fmt) in COLUMNS.items()]


def evaluate_checkpoint(
    checkpoint: str,
    data_uri: str,
    endpoint_url: str | None = None,
    caption_lengths: Sequence[int] = (10,),
    limit: int | None = 200,
    samples: int = 8,
    seed: int = 0,
    normalize: str = "none",
    probe: bool = True,
    compositionality: bool = True,
) -> dict:
    """Flat metrics of one exported checkpoint on a shapes-like dataset (labels, val/ captions,
    compositionality/ files): `probe_accuracy`; `compositionality_accuracy` and
    `compositionality_blind_accuracy` (macro), `text_biased`, and per subset
    `compositionality/BENCHMARK/SUBSET` and `blind/BENCHMARK/SUBSET`; `captions/N{n}/{bleu4,cider,
    captions_per_s}` for each length the model can write (CLIP writes none)."""
    model, cfg = load_pretrained(checkpoint, endpoint_url=endpoint_url)
    objective = cfg.objective.name
    out = {}
    if probe:
        out["probe_accuracy"] = linear_probe.probe_shapes(model, data_uri, endpoint_url)["accuracy"]
    if compositionality:
        result = comp.evaluate_shapes(
            model, objective, data_uri, endpoint_url, samples=samples, limit=limit, normalize=normalize, seed=seed
        )
        out.update(
            compositionality_accuracy=result["macro_accuracy"],
            compositionality_blind_accuracy=result["macro_blind_accuracy"],
            text_biased=", ".join(result["text_biased"]) or "none",
        )
        out.update({f"compositionality/{subset}": acc for subset, acc in result["accuracy"].items()})
        out.update({f"blind/{subset}": acc for subset, acc in result["blind_accuracy"].items()})
    if OBJECTIVES[objective].write and caption_lengths:
        images = captioning.group_by_image(shards.read_shards(join(data_uri, "val"), endpoint_url), limit)
        result = captioning.evaluate_captions(model, objective, images, lengths=tuple(caption_lengths), seed=seed)
        out.update({f"captions/N{n}/{k}": v for n, m in result["lengths"].items() for k, v in m.items()})
    return out


def compare_config(base: RunConfig, objective: str, data_uri: str, name: str) -> RunConfig:
    """The base config with this objective and run name; training data = data_uri/train, no val loss
    (the held-out evaluation is the table)."""
    return derive(
        base,
        {
            "name": f"{name}-{objective}",
            "objective.name": objective,
            "data.train_uri": join(data_uri, "train"),
            "data.val_uri": None,
        },
    )


def write_tables(title: str, rows: list[Row], workdir: Path, console: Console) -> None:
    """compare.md, compare.html and the console's table."""
    titles = [title for title, _ in COLUMNS.values()]
    (workdir / "compare.md").write_text(f"# {title}\n\n{reports.markdown_table(titles, [row.cells() for row in rows])}")
    (workdir / "compare.html").write_text(
        reports.page(title, [("Objectives", reports.table_html([dict(zip(titles, row.cells())) for row in rows]))])
    )
    table = Table(title=title)
    for field, (header, _) in COLUMNS.items():
        table.add_column(header, justify="left" if field == "objective" else "right")
    for row in rows:
        table.add_row(*row.cells())
    console.print(table)


def row_path(workdir: Path, cfg: RunConfig) -> Path:
    """WORKDIR/runs/RUN/row.json, written last: a relaunch with the same name reruns nothing that has one."""
    return workdir / "runs" / cfg.name / "row.json"


def train_row(cfg: RunConfig, parent: str, evaluation: tuple, workdir: Path, console: Console, channel=None) -> Row:
    """One objective trained (reporting to `channel` when runs train at once) and evaluated (one
    evaluation at a time in this process); its row, also logged to its MLflow run and kept in
    `row_path`. A row kept by an earlier launch is read back, not trained again."""
    path = row_path(workdir, cfg)
    objective = cfg.objective.name
    if path.is_file():
        console.print(f"[bold]{objective}[/bold]: done before ({path})")
        return Row(**json.loads(path.read_text()))
    data_uri, endpoint_url, caption_length, limit, samples = evaluation
    console.print(f"[bold]{objective}[/bold]: training {cfg.train.steps} steps")
    summary = run_training(cfg, parent_run_id=parent, channel=channel)
    with concurrency.serialized():
        metrics = evaluate_checkpoint(
            summary.checkpoint_uri, data_uri, endpoint_url, (caption_length,), limit, samples, cfg.train.seed
        )
    row = Row(
        objective=objective,
        probe_accuracy=metrics["probe_accuracy"],
        compositionality_accuracy=metrics["compositionality_accuracy"],
        compositionality_blind_accuracy=metrics["compositionality_blind_accuracy"],
        text_biased=metrics["text_biased"],
        **{k: metrics.get(f"captions/N{caption_length}/{k}") for k in ("bleu4", "cider", "captions_per_s")},
        train_images_per_s=summary.metrics["images_per_s"],
        final_loss=summary.metrics["loss"],
        checkpoint=summary.checkpoint_uri,
        mlflow_run_id=summary.mlflow_run_id,
    )
    numbers = {f"compare/{k}": v for k, v in asdict(row).items() if isinstance(v, float)}
    tracking.log_evaluation(tracking.absolute_tracking_uri(cfg.mlflow_uri), numbers, [], run_id=summary.mlflow_run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(row), indent=2))  # last: its presence means the row is done
    return row


def run_compare(
    objectives: Sequence[str],
    workdir: Path,
    data_uri: str | None = None,
    config: Path | None = None,
    overrides: Sequence[str] = (),
    name: str | None = None,
    caption_length: int = 10,
    limit: int | None = 200,
    samples: int = 8,
    num_images: int = 2000,
    console: Console | None = None,
    max_concurrent: int | None = None,
) -> list[Row]:
    """Train and evaluate every objective; write the table (console, compare.md/.html, MLflow).

    `config` (default: none, the built-in defaults) and `overrides` make the shared budget; runs,
    MLflow and the tables go under `workdir`. Without `data_uri`, `num_images` shapes are generated
    into workdir/shapes (once). `max_concurrent` objectives train at once (default: what fits
    the cluster)."""
    console = console or Console()
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    name = name or f"compare-{time.strftime('%Y%m%d-%H%M%S')}"  # a reused run name would resume, not train
    base = load_config(
        config, [f"storage_uri={workdir / 'checkpoints'}", f"mlflow_uri=sqlite:///{workdir / 'mlflow.db'}", *overrides]
    )
    endpoint_url = base.data.endpoint_url
    if data_uri is None:
        data_uri = str(workdir / "shapes")
        if not (workdir / "shapes" / shards.MANIFEST).is_file():
            console.print(f"writing {num_images} shapes images to {data_uri}")
            write_shapes_dataset(data_uri, num=num_images, seed=base.train.seed)
    mlflow_uri = tracking.absolute_tracking_uri(base.mlflow_uri)
    parent = tracking.get_or_create_run(
        mlflow_uri,
        base.experiment,
        name,
        {"objectives": ",".join(objectives), "data": data_uri, "caption_length": caption_length, **base.model_dump()},
    )
    try:
        n, configs = concurrency.plan_concurrency(
            {objective: compare_config(base, objective, data_uri, name) for objective in objectives}, max_concurrent
        )
        evaluation = (data_uri, endpoint_url, caption_length, limit, samples)
        with progress.shared(n, console) as channel:
            calls = {
                objective: functools.partial(train_row, cfg, parent, evaluation, workdir, console, channel)
                for objective, cfg in configs.items()
            }
            rows = list(concurrency.run_all(calls, n).values())
    except BaseException:
        tracking.finish_run(mlflow_uri, parent, "FAILED")
        raise

    title = f"mdc compare: {', '.join(objectives)} on {data_uri}, {base.train.steps} steps"
    write_tables(title, rows, workdir, console)
    parent_metrics = {f"{row.objective}/{k}": v for row in rows for k, v in asdict(row).items() if isinstance(v, float)}
    tracking.log_evaluation(
        mlflow_uri, parent_metrics, [workdir / "compare.md", workdir / "compare.html"], run_id=parent
    )
    tracking.finish_run(mlflow_uri, parent)
    console.print(f"table: {workdir / 'compare.md'}, {workdir / 'compare.html'}; MLflow parent run {parent}")
    return rows
