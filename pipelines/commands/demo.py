"""`mdc demo`: the whole product on one machine with nothing running beforehand.

local S3 server (moto, subprocess) → shapes shards into a bucket → 2-worker Ray Train run reading
from the bucket → MLflow in SQLite under the work folder (the encoder registered there) → a summary
with captions beside references, and the encoder as a timm folder in WORKDIR/encoder.

The demo's model has no caption-length head (`model.predict_length`): it trains the paper's MDC,
which writes at a fixed N'; the head is DDCap's switch, and turning it on would change what the
demo measures. A model trained with one is also captioned at the head's N' ("predicted").
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from rich.table import Table

from mdc import export
from mdc.config import DEFAULT_CONFIG, load_config
from mdc.data import shards
from mdc.data.shapes import write_shapes_dataset
from mdc.evaluation import captioning
from mdc.evaluation.compositionality import evaluate_shapes
from mdc.evaluation.probe import probe_shapes, random_init
from mdc.registry import OBJECTIVES
from mdc.training.checkpoint import load_pretrained
from pipelines.infra import tracking
from pipelines.infra.console import console
from pipelines.infra.local_s3 import create_bucket, local_s3_server
from pipelines.infra.ray_connection import ray_session
from pipelines.run import model_registry, reports
from pipelines.run.driver import run_training

BUCKET = "mdc-demo"
# Shapes images in the bucket (~2.4 passes of the demo's 600 steps); why 9,000: docs/design.md §11, 'Demo dataset size'
DEMO_IMAGES = 9000
# Captions are written at the paper's fixed lengths that fit the demo's max_length of 16 tokens (its
# 20 does not); the shapes captions are 4 to 12 tokens long.
CAPTION_LENGTHS = (10, 15)
HELD_OUT = 64  # held-out images captioned and scored (the console shows the first 8, the report all)
# Ray Data's advice when an operator gets fewer input blocks than its task concurrency cap (the demo's
# few shards): for tuning big pipelines, two lines of noise on the demo's console
RAY_DATA_CONCURRENCY_WARNING = r"The maximum number of concurrent tasks"


def caption_heldout(checkpoint_dir: str, data_uri: str, endpoint_url: str | None, n: int = HELD_OUT):
    """(images, result) of the first `n` distinct held-out images captioned at the fixed N' of
    CAPTION_LENGTHS (the model is not told the reference's length), with BLEU-4 and CIDEr-D per N';
    (images, None) for a contrastive model, which writes no captions."""
    model, cfg = load_pretrained(checkpoint_dir)
    images = captioning.group_by_image(shards.read_shards(data_uri, endpoint_url), n)
    if OBJECTIVES[cfg.objective.name].write is None:
        return images, None
    lengths = (*CAPTION_LENGTHS, "predicted") if cfg.model.predict_length else CAPTION_LENGTHS
    return images, captioning.evaluate_captions(model, cfg.objective.name, images, lengths)


def evaluate_demo_model(checkpoint_dir: str, data_uri: str, endpoint_url: str) -> dict:
    """Linear probe on the held-out shapes labels (against the same architecture at random init)
    and ARO-style compositionality on the shapes pairs, scored by the objective's own scorer."""
    model, cfg = load_pretrained(checkpoint_dir)
    probe = probe_shapes(model, data_uri, endpoint_url, baseline=random_init(cfg))
    comp = evaluate_shapes(model, cfg.objective.name, data_uri, endpoint_url, samples=4, limit=100, benchmarks=("aro",))
    return {
        "probe_accuracy": probe["accuracy"],
        "probe_random_init_accuracy": probe["random_init_accuracy"],
        "compositionality_scorer": comp["scorer"],
        "compositionality": comp["accuracy"],
        "compositionality_blind": comp["blind_accuracy"],
        "compositionality_text_biased": comp["text_biased"],
    }


def run_demo(workdir: Path, num: int = DEMO_IMAGES, overrides: list[str] = (), verbose: bool = False) -> dict:
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    with local_s3_server() as endpoint:
        data_uri = f"s3://{BUCKET}/shapes"
        cfg = load_config(
            DEFAULT_CONFIG,
            [
                f"data.train_uri={data_uri}/train",
                f"data.val_uri={data_uri}/val",
                f"data.endpoint_url={endpoint}",
                f"storage_uri={workdir / 'checkpoints'}",
                f"mlflow_uri=sqlite:///{workdir / 'mlflow.db'}",
                *overrides,
            ],
        )
        console.print(f"[bold]local S3 server[/bold] {endpoint}; writing {num} shapes images to {data_uri}")
        create_bucket(endpoint, BUCKET)
        write_shapes_dataset(data_uri, num=num, seed=cfg.train.seed, endpoint_url=endpoint)
        with ray_session(workdir / "ray.log", verbose=verbose, num_cpus=2), warnings.catch_warnings():
            warnings.filterwarnings("ignore", RAY_DATA_CONCURRENCY_WARNING, UserWarning)
            result = run_training(cfg)
        console.print(
            f"captioning {HELD_OUT} held-out images at N' = {', '.join(map(str, CAPTION_LENGTHS))}, "
            "probing the encoder, scoring compositionality"
        )
        images, captions = caption_heldout(result.checkpoint_uri, f"{data_uri}/val", endpoint)
        evaluation = evaluate_demo_model(result.checkpoint_uri, data_uri, endpoint)
        encoder, registered = export_demo_encoder(workdir, cfg, result, evaluation)

    summary = {
        "run_name": result.run_name,
        "final_loss": result.metrics.get("loss"),
        "val_loss": result.metrics.get("val_loss"),
        "skipped_records": result.bad_records,
        "checkpoint": result.checkpoint_uri,
        "mlflow_run_id": result.mlflow_run_id,
        "mlflow_uri": cfg.mlflow_uri,
        "encoder": str(encoder),
        "registered_model": registered,
        **evaluation,
        "captions": captions,
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    report = write_report(workdir, cfg, result, evaluation, images, captions)
    print_results(summary, evaluation, captions, report, cfg.mlflow_uri, workdir)
    return summary


def lengths_text(lengths: list[str]) -> str:
    """The caption lengths in words: the paper's fixed N', and the length head's when written."""
    fixed = [n for n in lengths if n != "predicted"]
    head = " and at the length head's N' (predicted)" if "predicted" in lengths else ""
    return f"the paper's fixed lengths N' = {', '.join(fixed)}{head}"


def export_demo_encoder(workdir: Path, cfg, result, evaluation: dict) -> tuple[Path, str | None]:
    """The trained encoder as a timm folder in WORKDIR/encoder, its card holding the demo's figures,
    which also become the tags of the version the run registered; returns (folder, that version)."""
    macro = sum(evaluation["compositionality"].values()) / len(evaluation["compositionality"])
    figures = {"probe": evaluation["probe_accuracy"], "compositionality": macro}
    facts = {
        "MLflow run": result.mlflow_run_id,
        "checkpoint": result.checkpoint_uri,
        "linear probe, held-out shapes": evaluation["probe_accuracy"],
        "the same at random init": evaluation["probe_random_init_accuracy"],
        **{
            f"compositionality {k} ({evaluation['compositionality_scorer']})": v
            for k, v in evaluation["compositionality"].items()
        },
    }
    folder = export.export_checkpoint(
        result.checkpoint_uri, workdir / "encoder", facts, endpoint_url=cfg.data.endpoint_url
    )
    registered = model_registry.tag_figures(
        tracking.absolute_tracking_uri(cfg.mlflow_uri), result.mlflow_run_id, figures
    )
    return folder, registered


def print_results(summary: dict, evaluation: dict, captions: dict | None, report: Path, mlflow_uri: str, workdir: Path):
    """The console's closing lines: held-out captions beside their references, then the figures."""
    if captions:
        lengths = list(captions["lengths"])
        table = Table(
            title=f"held-out captions ({captions['sampler']} sampler, {lengths_text(lengths)}: "
            "not told the reference's length)"
        )
        table.add_column("reference")
        for n in lengths:
            table.add_column(f"N' = {n}")
        for entry in captions["captions"][:8]:
            table.add_row(entry["references"][0], *(entry["generated"][n] for n in lengths))
        console.print(table)
        console.print(
            f"on {captions['num_images']} held-out images: "
            + "; ".join(
                f"N' = {n}: BLEU-4 {m['bleu4']:.3f}, CIDEr-D {m['cider']:.3f}" for n, m in captions["lengths"].items()
            ),
            highlight=False,
        )
    console.print(
        f"final loss {summary['final_loss']:.4f}, val loss {summary['val_loss']:.4f}, "
        f"skipped {summary['skipped_records'] or 'none'}"
    )
    console.print(
        f"linear probe (shape of the first object, held out): {evaluation['probe_accuracy']:.3f} "
        f"vs {evaluation['probe_random_init_accuracy']:.3f} at random init"
    )
    console.print(
        f"compositionality ({evaluation['compositionality_scorer']}; blind: another item's image): "
        + ", ".join(
            f"{k} {v:.3f} (blind {evaluation['compositionality_blind'][k]:.3f}"
            + (", text-biased)" if k in evaluation["compositionality_text_biased"] else ")")
            for k, v in evaluation["compositionality"].items()
        )
    )
    console.print(
        f"report: {report}\ncheckpoint: {summary['checkpoint']}\n"
        f"MLflow: mlflow ui --backend-store-uri {mlflow_uri} (run {summary['mlflow_run_id']})\n"
        f"summary: {workdir / 'summary.json'}"
        + (f"\nregistered: {summary['registered_model']}" if summary["registered_model"] else ""),
        highlight=False,
    )
    console.print(
        f'the encoder, for timm: timm.create_model("local-dir:{summary["encoder"]}", pretrained=True)', highlight=False
    )


def write_report(workdir: Path, cfg, result, evaluation: dict, images, captions: dict | None) -> Path:
    """report.html (and curves.png) in the work folder, also an artifact of the training run: the
    loss curves, the probe and compositionality tables, the held-out images beside their captions."""
    tracking_uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    curves = reports.curves_png(
        tracking.metric_history(tracking_uri, result.mlflow_run_id, reports.CURVES),
        workdir / "curves.png",
        f"{cfg.name}: {cfg.train.steps} steps, global batch {cfg.global_batch}",
    )
    online = tracking.metric_history(tracking_uri, result.mlflow_run_id, reports.ONLINE_CURVES)
    sections = [("Training", reports.image_html(curves, "training and validation loss"))]
    if online:  # evaluated during training (eval.probe_every, eval.compositionality_every)
        during = reports.curves_png(
            online,
            workdir / "online.png",
            f"{cfg.name}: the encoder during training",
            "accuracy",
        )
        sections.append(("Probe during training", reports.image_html(during, "online probe and compositionality")))
    sections.append(("Linear probe and compositionality", reports.results_html(evaluation)))
    if captions:
        sections.append(
            (
                "Held-out captions",
                reports.captions_html(
                    images,
                    captions,
                    f"Written at {lengths_text(list(captions['lengths']))}, not at each reference's own length.",
                ),
            )
        )
    path = workdir / "report.html"
    path.write_text(reports.page(f"mdc demo: {cfg.name}", sections))
    pngs = [curves, workdir / "online.png"] if online else [curves]
    tracking.log_artifacts(tracking_uri, result.mlflow_run_id, [path, *pngs], "report")
    return path
