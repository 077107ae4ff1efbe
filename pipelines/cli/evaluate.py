"""`mdc eval ...`: evaluate an exported checkpoint (a local directory or s3://) — linear probe,
zero-shot classification, compositionality, captions, caption infilling.

Every command writes a JSON result (--out) and logs its metrics, the JSON and any page it wrote to
MLflow (pipelines/infra/tracking.py): into the training run with --run-id, else into a new run of the
experiment `mdc-eval`. Probe features of large datasets (at least --ray-threshold images) come from
Ray Data batch inference (pipelines/run/feature_extraction.py).

A checkpoint may also be a registered version, `models:/NAME/VERSION` or `models:/NAME@ALIAS`
(its captioner); `probe` and `compositionality` take `--encoder timm:NAME|local-dir:DIR` to measure
any timm encoder on the same features, splits and C-selection.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from mdc import export
from mdc.data import shards
from mdc.evaluation import captioning, compositionality, infilling, probe, readers, zeroshot
from mdc.sampling import Decoding
from mdc.training import checkpoint as ckpt
from pipelines.infra.console import console
from pipelines.infra.console import user_errors as console_user_errors
from pipelines.run import reports

eval_app = typer.Typer(
    no_args_is_help=True, help="Evaluate a checkpoint: probe, zeroshot, compositionality, captions, infill."
)

CHECKPOINT_HELP = "exported checkpoint directory (model.safetensors + config.yaml), local or s3://, or models:/NAME/VERSION | models:/NAME@ALIAS"
CHECKPOINT = typer.Option(..., help=CHECKPOINT_HELP)
ENCODER = typer.Option(
    None,
    help="probe another encoder instead: timm:NAME (random init, nothing downloaded) or local-dir:DIR (a timm folder)",
)
ENDPOINT = typer.Option(None, help="S3 endpoint for s3:// checkpoints and data")
MLFLOW_URI = typer.Option("sqlite:///mlflow.db", help="MLflow tracking URI ('' to skip logging)")
RUN_ID = typer.Option(None, help="log into this MLflow run (e.g. the training run) instead of a new one")
DEVICE = typer.Option("cpu", help="torch device for the model")
SCORER = typer.Option("auto", help="auto | ar | heuristic | montecarlo | clip | cdlm (auto: by the model's objective)")
SAMPLES = typer.Option(16, min=1, help="Monte Carlo draws of (t, mask) per caption")


def report(
    result: dict,
    metrics: dict,
    out: Path,
    mlflow_uri: str,
    run_id: str | None,
    run_name: str,
    params: dict,
    extra_artifacts: tuple[Path, ...] = (),
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name, value in metrics.items():
        console.print(f"{name}: {value:.4f}")
    console.print(f"result: {out}")
    if mlflow_uri:
        from pipelines.infra.tracking import log_evaluation  # MLflow: seconds to import, only when logging

        logged = log_evaluation(mlflow_uri, metrics, [out, *extra_artifacts], run_id, run_name, params)
        console.print(f"MLflow run {logged} ({mlflow_uri})")


def user_errors():
    """Bad inputs (missing files, fields, unknown names, unreachable storage) end with one line, exit 2."""
    return console_user_errors(FileNotFoundError, ValueError, RuntimeError)


def load(checkpoint: str, endpoint_url: str | None, device: str, mlflow_uri: str):
    """(model, RunConfig, local checkpoint directory); a registered version's is its captioner."""
    if checkpoint.startswith("models:/"):
        from pipelines.run import model_registry  # MLflow: seconds to import, only for registered versions

        directory = model_registry.resolve(checkpoint, mlflow_uri) / export.CAPTIONER
    else:
        directory = ckpt.fetch_checkpoint(checkpoint, endpoint_url)
    model, cfg = ckpt.load_pretrained(directory, device)
    return model, cfg, directory


def run_name(kind: str, target: str, checkpoint: str) -> str:
    return f"{kind}-{target}-{Path(checkpoint.rstrip('/')).name}"


# ------------------------------------------------------------------------------------- commands


@eval_app.command("probe")
def probe_command(
    checkpoint: Optional[str] = typer.Option(None, help=CHECKPOINT_HELP + " (or --encoder)"),
    encoder: Optional[str] = ENCODER,
    dataset: str = typer.Option(..., help=f"one of {', '.join(readers.dataset_kinds())}"),
    root: Optional[str] = typer.Option(None, help="dataset root (fashion-mnist: Debian's by default)"),
    endpoint_url: Optional[str] = ENDPOINT,
    cache_dir: Optional[Path] = typer.Option(None, help="cache features here, by checkpoint and split"),
    baseline: bool = typer.Option(
        True, help="also probe the same architecture at random init (not for timm:NAME, itself at random init)"
    ),
    batch_size: int = typer.Option(128, min=1),
    ray_threshold: int = typer.Option(20_000, help="use Ray batch inference from this many images"),
    num_actors: int = typer.Option(1, min=1, help="Ray inference actors"),
    address: Optional[str] = typer.Option(None, help="Ray cluster address; default: running or local"),
    device: str = DEVICE,
    out: Path = typer.Option(Path("eval_probe.json")),
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Linear probe: frozen pooled features, logistic regression with C chosen on held-out train."""
    with user_errors():
        if root is None and dataset != "fashion-mnist":
            raise ValueError(f"--root is required for {dataset}")
        if (checkpoint is None) == (encoder is None):
            raise ValueError("give --checkpoint or --encoder (one of them)")
        root = root or readers.FASHION_MNIST_ROOT
        common = dict(
            root=root,
            batch_size=batch_size,
            ray_threshold=ray_threshold,
            num_actors=num_actors,
            address=address,
            cache_dir=cache_dir,
            num_gpus=1 if device.startswith("cuda") else 0,
        )
        if encoder:
            trained, untrained = encoder_extractors(encoder, device, baseline, common)
        else:
            trained, untrained = checkpoint_extractors(checkpoint, endpoint_url, device, mlflow_uri, baseline, common)
        train, test = (readers.read_split(dataset, root, s, endpoint_url) for s in ("train", "test"))
        console.print(f"{dataset}: {len(train)} train / {len(test)} test images, {len(train.class_names)} classes")
        result = probe.linear_probe(train, test, trained)
        metrics = {f"eval/probe/{dataset}/accuracy": result["accuracy"]}
        if untrained is not None:
            result["random_init_accuracy"] = probe.linear_probe(train, test, untrained)["accuracy"]
            metrics[f"eval/probe/{dataset}/random_init_accuracy"] = result["random_init_accuracy"]
        source = checkpoint or encoder
        result["checkpoint" if checkpoint else "encoder"] = source
    report(
        result,
        metrics,
        out,
        mlflow_uri,
        run_id,
        run_name("probe", dataset, source),
        {"checkpoint" if checkpoint else "encoder": source, "dataset": dataset, "root": root},
    )


def checkpoint_extractors(checkpoint: str, endpoint_url, device: str, mlflow_uri: str, baseline: bool, common: dict):
    """(features of the checkpoint's encoder, of the same architecture at random init or None)."""
    from pipelines.run.feature_extraction import (  # Ray: seconds to import
        Extractor,
        checkpoint_model,
        random_init_model,
    )

    model, cfg, directory = load(checkpoint, endpoint_url, device, mlflow_uri)
    cached = common["cache_dir"] is not None
    key = probe.file_fingerprint(directory / ckpt.WEIGHTS) if cached else ""
    trained = Extractor(model, functools.partial(checkpoint_model, str(directory), device), key, **common)
    if not baseline:
        return trained, None
    fresh = probe.random_init(cfg).to(device)
    config_hash = probe.file_fingerprint(directory / ckpt.CONFIG) if cached else ""
    untrained = Extractor(
        fresh, functools.partial(random_init_model, cfg, device), f"random-init-{config_hash}", **common
    )
    return trained, untrained


def encoder_extractors(spec: str, device: str, baseline: bool, common: dict):
    """(features of a timm encoder, of its architecture at random init or None): a timm:NAME is
    itself at random init, so it has no baseline of its own."""
    from pipelines.run.feature_extraction import Extractor  # Ray: seconds to import

    model = export.load_encoder(spec, device)
    if spec.startswith("local-dir:"):
        folder = Path(spec[len("local-dir:") :]).expanduser()
        key = f"timm-{probe.file_fingerprint(folder / export.TIMM_WEIGHTS)}" if common["cache_dir"] else ""
    else:
        key = f"timm-{spec[len('timm:') :]}-random-init"
    trained = Extractor(model, functools.partial(export.load_encoder, spec, device), key, **common)
    if not baseline or spec.startswith("timm:"):
        return trained, None
    fresh = export.random_init_encoder(spec, device)
    config_hash = probe.file_fingerprint(folder / export.TIMM_CONFIG) if common["cache_dir"] else ""
    untrained = Extractor(
        fresh, functools.partial(export.random_init_encoder, spec, device), f"timm-random-init-{config_hash}", **common
    )
    return trained, untrained


@eval_app.command("zeroshot")
def zeroshot_command(
    checkpoint: str = CHECKPOINT,
    dataset: str = typer.Option(..., help=f"one of {', '.join(readers.dataset_kinds())}"),
    root: Optional[str] = typer.Option(None, help="dataset root (fashion-mnist: Debian's by default)"),
    template: Optional[List[str]] = typer.Option(
        None, help="caption template with {} for the class name; repeat to ensemble (default by dataset)"
    ),
    scorer: str = SCORER,
    samples: int = SAMPLES,
    seed: int = 0,
    limit: Optional[int] = typer.Option(None, help="classify only the first N test images"),
    batch_size: int = typer.Option(32, min=1),
    endpoint_url: Optional[str] = ENDPOINT,
    device: str = DEVICE,
    out: Path = typer.Option(Path("eval_zeroshot.json")),
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Zero-shot classification: the class whose templated caption the model scores highest."""
    with user_errors():
        model, cfg, _ = load(checkpoint, endpoint_url, device, mlflow_uri)
        test = readers.read_split(dataset, root or readers.FASHION_MNIST_ROOT, "test", endpoint_url)
        name, score = compositionality.get_scorer(scorer, cfg.objective.name)
        templates = tuple(template) if template else zeroshot.templates_for(dataset)
        result = {
            "dataset": dataset,
            "scorer": name,
            "samples": samples,
            "checkpoint": checkpoint,
            **zeroshot.zeroshot_classify(model, test, score, templates, samples, batch_size, seed, limit),
        }
    report(
        result,
        {f"eval/zeroshot/{dataset}/accuracy": result["accuracy"]},
        out,
        mlflow_uri,
        run_id,
        run_name("zeroshot", dataset, checkpoint),
        {"checkpoint": checkpoint, "dataset": dataset, "scorer": name},
    )


@eval_app.command("compositionality")
def compositionality_command(
    checkpoint: Optional[str] = typer.Option(
        None, help=CHECKPOINT_HELP + "; with --encoder, the text side (default: the export's captioner/)"
    ),
    encoder: Optional[str] = typer.Option(
        None, help="score with this image side instead: local-dir:DIR or timm:NAME of the decoder's width"
    ),
    benchmark: str = typer.Option(..., help="aro | sugarcrepe"),
    root: Path = typer.Option(..., help="folder with the benchmark's JSON files"),
    image_dir: Optional[Path] = typer.Option(None, help="image folder (default ROOT/images)"),
    subsets: Optional[str] = typer.Option(None, help="comma-separated subsets (default: every file present)"),
    scorer: str = SCORER,
    samples: int = SAMPLES,
    seed: int = 0,
    normalize: str = typer.Option("none", help="none: summed log-likelihood | token: per-token mean"),
    limit: Optional[int] = typer.Option(None, help="score only the first N items of each subset"),
    batch_size: int = typer.Option(32, min=1),
    endpoint_url: Optional[str] = ENDPOINT,
    device: str = DEVICE,
    out: Path = typer.Option(Path("eval_compositionality.json")),
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """ARO / SugarCrepe: share of images whose true caption scores above every manipulated one, and
    beside it the blind accuracy (each caption pair scored against another item's image)."""
    with user_errors():
        model, cfg = scoring_model(checkpoint, encoder, endpoint_url, device, mlflow_uri)
        items = compositionality.read_benchmark(
            benchmark, root, image_dir, subsets.split(",") if subsets else None, seed=seed
        )
        name, score = compositionality.get_scorer(scorer, cfg.objective.name)
        result = {
            "benchmark": benchmark,
            "scorer": name,
            "samples": samples,
            "checkpoint": checkpoint,
            "encoder": encoder,
            **compositionality.evaluate_compositionality(
                model, items, score, samples, batch_size, seed, limit, normalize
            ),
        }
    print_compositionality(result)
    metrics = {f"eval/{benchmark}/{subset}": acc for subset, acc in result["accuracy"].items()}
    metrics |= {
        f"eval/{benchmark}/{subset}/blind": acc for subset, acc in result["blind_accuracy"].items() if acc is not None
    }
    metrics[f"eval/{benchmark}/macro"] = result["macro_accuracy"]
    report(
        result,
        metrics,
        out,
        mlflow_uri,
        run_id,
        run_name(benchmark, name, encoder or checkpoint),
        {
            "checkpoint": checkpoint,
            "encoder": encoder,
            "benchmark": benchmark,
            "scorer": name,
            "samples": samples,
            "normalize": normalize,
        },
    )


def scoring_model(checkpoint: str | None, encoder: str | None, endpoint_url, device: str, mlflow_uri: str):
    """(model, RunConfig) that scores captions: a checkpoint's captioner, its image side replaced by
    `encoder` when one is given (the text side: `checkpoint`, else the captioner an export holds)."""
    if encoder and checkpoint is None:
        folder = Path(encoder.removeprefix("local-dir:")).expanduser()
        if not encoder.startswith("local-dir:") or not (folder / export.CAPTIONER).is_dir():
            raise ValueError(
                f"--encoder {encoder} has no text side: compositionality scores captions with a decoder; "
                "give --checkpoint, or a folder `mdc export` wrote with its captioner/"
            )
        checkpoint = str(folder / export.CAPTIONER)
    if checkpoint is None:
        raise ValueError("give --checkpoint or --encoder")
    model, cfg, _ = load(checkpoint, endpoint_url, device, mlflow_uri)
    if encoder:
        model = export.swap_encoder(model, export.load_encoder(encoder, device), encoder)
    return model.eval(), cfg


def print_compositionality(result: dict) -> None:
    """Accuracy beside blind accuracy per subset; text-biased subsets marked."""
    table = Table(title=f"{result['benchmark']} ({result['scorer']}, normalize={result['normalize']})")
    for column in ("subset", "items", "accuracy", "blind accuracy", ""):
        table.add_column(column, justify="left" if column in ("subset", "") else "right")
    for subset, accuracy in result["accuracy"].items():
        blind = result["blind_accuracy"][subset]
        flag = (
            f"length/text-biased (blind > {compositionality.BLIND_BIAS_THRESHOLD})"
            if subset in result["text_biased"]
            else ""
        )
        table.add_row(
            subset,
            str(result["num_items"][subset]),
            f"{accuracy:.3f}",
            "n/a" if blind is None else f"{blind:.3f}",
            flag,
        )
    console.print(table)


@eval_app.command("captions")
def captions_command(
    checkpoint: str = CHECKPOINT,
    data: str = typer.Option(..., help="shards with reference captions (local or s3://)"),
    lengths: str = typer.Option(
        "10,15,20",
        help="caption lengths N' (max tokens for autoregressive models); also 'predicted' (the length "
        "head's, models trained with one) and 'reference' (each image's median reference length: an upper bound)",
    ),
    sampler: str = typer.Option("confidence", help="confidence | ancestral (masked diffusion)"),
    steps: Optional[int] = typer.Option(None, help="denoising passes (default N', one token per pass)"),
    schedule: str = typer.Option("fixed", help="fixed (tokens per pass) | cosine (MaskGIT: fewer passes)"),
    threshold: Optional[float] = typer.Option(
        None, help="commit every position at least this probable, at least one a pass (Fast-dLLM)"
    ),
    guidance_scale: float = typer.Option(1.0, help="DDCap guidance s (image-free-trained models; DDCap: 1.06)"),
    limit: Optional[int] = typer.Option(100, help="caption the first N distinct images"),
    batch_size: int = typer.Option(32, min=1),
    endpoint_url: Optional[str] = ENDPOINT,
    device: str = DEVICE,
    out: Path = typer.Option(Path("eval_captions.json")),
    html: Optional[Path] = typer.Option(None, help="captions page (default: report.html beside --out)"),
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Write captions and score them: BLEU-4, CIDEr-D, captions per second, and an HTML page."""
    with user_errors():
        model, cfg, _ = load(checkpoint, endpoint_url, device, mlflow_uri)
        sizes = [n if n in captioning.LENGTH_CHOICES else int(n) for n in lengths.split(",")]
        decoding = Decoding(sampler, steps, schedule, threshold, guidance_scale)
        images = captioning.group_by_image(shards.read_shards(data, endpoint_url), limit)
        if not images:
            raise ValueError(f"no samples in {data}")
        result = {
            "data": data,
            "checkpoint": checkpoint,
            **captioning.evaluate_captions(model, cfg.objective.name, images, sizes, decoding, batch_size),
        }
        skipped = result["skipped_lengths"]
        too_long = [n for n in skipped if n not in captioning.LENGTH_CHOICES]
        if too_long:
            console.print(
                f"[yellow]skipped lengths {too_long}: above the model's max_length {cfg.data.max_length}[/yellow]"
            )
        if len(too_long) < len(skipped):
            console.print(
                f"[yellow]skipped {[n for n in skipped if n in captioning.LENGTH_CHOICES]}: a {cfg.objective.name!r} "
                "model writes at a fixed length (autoregressive ones stop at EOS)[/yellow]"
            )
    html = html or out.with_name("report.html")
    html.parent.mkdir(parents=True, exist_ok=True)
    html.write_text(
        reports.page(
            f"{Path(checkpoint.rstrip('/')).name} on {data}",
            [("Held-out captions", reports.captions_html(images, result, f"Captions written at N' = {lengths}."))],
        )
    )
    console.print(f"report: {html}")
    metrics = {
        f"eval/captions/{'N' + n if n.isdigit() else n}/{k}": v
        for n, m in result["lengths"].items()
        for k, v in m.items()
    }
    report(
        result,
        metrics,
        out,
        mlflow_uri,
        run_id,
        run_name("captions", Path(data.rstrip("/")).name, checkpoint),
        {
            "checkpoint": checkpoint,
            "data": data,
            "sampler": result["sampler"],
            "lengths": lengths,
            "guidance_scale": guidance_scale,
        },
        (html,),
    )


@eval_app.command("infill")
def infill_command(
    checkpoint: str = CHECKPOINT,
    data: str = typer.Option(..., help="shards with reference captions (local or s3://)"),
    ratio: float = typer.Option(0.3, min=0.0, max=1.0, help="share of each caption's tokens masked, as one span"),
    sampler: str = typer.Option("confidence", help="confidence | ancestral"),
    limit: Optional[int] = typer.Option(100, help="infill the first caption of the first N distinct images"),
    seed: int = 0,
    batch_size: int = typer.Option(32, min=1),
    endpoint_url: Optional[str] = ENDPOINT,
    device: str = DEVICE,
    out: Path = typer.Option(Path("eval_infill.json")),
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Caption infilling (DDCap): mask a span of a reference caption, fill it, score BLEU-4 / CIDEr-D."""
    with user_errors():
        model, cfg, _ = load(checkpoint, endpoint_url, device, mlflow_uri)
        images = captioning.group_by_image(shards.read_shards(data, endpoint_url), limit)
        if not images:
            raise ValueError(f"no samples in {data}")
        result = {
            "data": data,
            "checkpoint": checkpoint,
            **infilling.evaluate_infilling(model, cfg.objective.name, images, ratio, sampler, batch_size, seed),
        }
    report(
        result,
        {"eval/infill/bleu4": result["bleu4"], "eval/infill/cider": result["cider"]},
        out,
        mlflow_uri,
        run_id,
        run_name("infill", Path(data.rstrip("/")).name, checkpoint),
        {"checkpoint": checkpoint, "data": data, "sampler": sampler, "ratio": ratio},
    )
