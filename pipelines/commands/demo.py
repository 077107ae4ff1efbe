"""`mdc demo`: the whole product on one machine with nothing running beforehand.

local S3 server (moto, subprocess) → shapes shards into a bucket → 2-worker Ray Train run reading
from the bucket → MLflow in SQLite under the work folder (the encoder registered there) → the run
judged on its eval section as every command judges an encoder (mdc/evaluation/suite.py: the probe
of the shapes labels against random init, ARO-format compositionality, held-out captions) → a
summary with captions beside references, and the encoder as a timm folder in WORKDIR/encoder.

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
from mdc.config import DEFAULT_CONFIG, derive, load_config
from mdc.data.shapes import write_shapes_dataset
from mdc.evaluation import suite
from pipelines.infra import tracking
from pipelines.infra.console import console
from pipelines.infra.local_s3 import create_bucket, local_s3_server
from pipelines.infra.ray_connection import ray_session
from pipelines.run import concurrency, model_registry, reports
from pipelines.run.driver import run_training
from pipelines.run.evaluation import evaluate_run

BUCKET = "mdc-demo"
# Shapes images in the bucket (~2.4 passes of the demo's 600 steps); why 9,000: docs/design.md §11, 'Demo dataset size'
DEMO_IMAGES = 9000
# Captions are written at the paper's fixed lengths that fit the demo's max_length of 16 tokens (its
# 20 does not); the shapes captions are 4 to 12 tokens long.
CAPTION_LENGTHS = (10, 15)
HELD_OUT = 64  # held-out images captioned and scored (the console shows the first 8, the report all)
# The demo's eval section: the probe of the shapes labels (the default on `mdc data` data), the two
# ARO-format subsets, captions of the held-out split; 4 Monte Carlo draws of 100 items a subset.
DEMO_EVAL = [
    "eval.samples=4",
    "eval.limit=100",
    "eval.compositionality=[{benchmark: shapes, subsets: [vg_relation, vg_attribution]}]",
    f"eval.captions=[{{lengths: [{', '.join(map(str, CAPTION_LENGTHS))}], limit: {HELD_OUT}}}]",
]
# Ray Data's advice when an operator gets fewer input blocks than its task concurrency cap (the demo's
# few shards): for tuning big pipelines, two lines of noise on the demo's console
RAY_DATA_CONCURRENCY_WARNING = r"The maximum number of concurrent tasks"


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
                *DEMO_EVAL,
                *overrides,
            ],
        )
        if cfg.model.predict_length:  # also at the length head's N'
            cfg = derive(cfg, {"eval.captions": [{"lengths": [*CAPTION_LENGTHS, "predicted"], "limit": HELD_OUT}]})
        console.print(f"[bold]local S3 server[/bold] {endpoint}; writing {num} shapes images to {data_uri}")
        create_bucket(endpoint, BUCKET)
        write_shapes_dataset(data_uri, num=num, seed=cfg.train.seed, endpoint_url=endpoint)
        with ray_session(workdir / "ray.log", verbose=verbose, num_cpus=2), warnings.catch_warnings():
            warnings.filterwarnings("ignore", RAY_DATA_CONCURRENCY_WARNING, UserWarning)
            result = concurrency.interruptible(lambda: run_training(cfg))  # Ctrl-C: MLflow KILLED
        console.print(
            f"captioning {HELD_OUT} held-out images at N' = {', '.join(map(str, CAPTION_LENGTHS))}, "
            "probing the encoder, scoring compositionality"
        )
        evaluation = evaluate_run(cfg, result)
        encoder, registered = export_demo_encoder(workdir, cfg, result, evaluation.metrics)
    name = suite.caption_set_name(cfg.data.val_uri)
    captions = evaluation.details.get(f"{suite.PREFIX}/captions/{name}")

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
        "metrics": evaluation.metrics,
        "captions": captions,
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    report = write_report(workdir, cfg, result, evaluation.metrics, evaluation.images.get(name, []), captions)
    print_results(summary, evaluation, captions, report, cfg.mlflow_uri, workdir)
    return summary


def lengths_text(lengths: list[str]) -> str:
    """The caption lengths in words: the paper's fixed N', and the length head's when written."""
    fixed = [n for n in lengths if n != "predicted"]
    head = " and at the length head's N' (predicted)" if "predicted" in lengths else ""
    return f"the paper's fixed lengths N' = {', '.join(fixed)}{head}"


def export_demo_encoder(workdir: Path, cfg, result, metrics: dict) -> tuple[Path, str | None]:
    """The trained encoder as a timm folder in WORKDIR/encoder, its card holding the run's headline
    figures (which the evaluation also put on the tags of the version the run registered);
    returns (folder, that version)."""
    facts = {"MLflow run": result.mlflow_run_id, "checkpoint": result.checkpoint_uri, **suite.headline(metrics)}
    folder = export.export_checkpoint(
        result.checkpoint_uri, workdir / "encoder", facts, endpoint_url=cfg.data.endpoint_url
    )
    return folder, model_registry.tag_figures(
        tracking.absolute_tracking_uri(cfg.mlflow_uri), result.mlflow_run_id, metrics
    )


def print_figures(evaluation) -> None:
    """The probe against random init and each compositionality subset beside its blind accuracy,
    each named by its key."""
    metrics = evaluation.metrics
    for spec_key in (k for k in metrics if k.startswith(f"{suite.PREFIX}/probe/") and k.endswith("/accuracy")):
        name = spec_key.split("/")[2]
        base = metrics.get(suite.probe_key(name, "random_init_accuracy"))
        console.print(
            f"linear probe {spec_key} (shape of the first object, held out): {metrics[spec_key]:.3f}"
            + (f" vs {base:.3f} at random init" if base is not None else ""),
            highlight=False,
        )
    for key, details in evaluation.details.items():
        if not key.startswith(f"{suite.PREFIX}/compositionality/"):
            continue
        name = key.split("/")[2]
        console.print(
            f"compositionality {suite.compositionality_key(name, 'SUBSET')} ({details['scorer']}; blind: another "
            "item's image): "
            + ", ".join(
                f"{subset} {accuracy:.3f} (blind {details['blind_accuracy'][subset]:.3f}"
                + (", text-biased)" if subset in details["text_biased"] else ")")
                for subset, accuracy in details["accuracy"].items()
            ),
            highlight=False,
        )


def print_results(summary: dict, evaluation, captions: dict | None, report: Path, mlflow_uri: str, workdir: Path):
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
    print_figures(evaluation)
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
    console.print(
        "the method on real captions: mdc data emoji --out runs/emoji (3,655 Noto emoji named by Unicode), "
        "mdc schedule --config configs/emoji.yaml, and the emoji study: studies/emoji_claims.yaml, docs/results.md",
        highlight=False,
    )


def write_report(workdir: Path, cfg, result, metrics: dict, images, captions: dict | None) -> Path:
    """report.html (and curves.png) in the work folder, also an artifact of the training run: the
    loss curves, the figures under their keys, the held-out images beside their captions."""
    tracking_uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    curves = reports.curves_png(
        tracking.metric_history(tracking_uri, result.mlflow_run_id, reports.CURVES),
        workdir / "curves.png",
        f"{cfg.name}: {cfg.train.steps} steps, global batch {cfg.global_batch}",
    )
    online = reports.online_curves(tracking_uri, result.mlflow_run_id)
    sections = [("Training", reports.image_html(curves, "training and validation loss"))]
    if online:  # evaluated during training (eval.probe_every, eval.compositionality_every)
        during = reports.curves_png(
            online,
            workdir / "online.png",
            f"{cfg.name}: the encoder during training",
            "accuracy",
        )
        sections.append(("Probe during training", reports.image_html(during, "online probe and compositionality")))
    sections.append(("The evaluation", reports.results_html(metrics)))
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
