"""`mdc eval ...`: judge a model — a checkpoint (a local directory or s3://), a folder `mdc export`
wrote, a registered version (`models:/NAME/VERSION`, `models:/NAME@ALIAS`), or any timm encoder
(`--encoder timm:NAME|local-dir:DIR`) — by the one evaluation every command uses
(mdc/evaluation/suite.py), under the same keys: `all` on a whole eval section (the checkpoint's own,
or `--config`'s), `probe`, `compositionality` and `captions` on the one set their options name;
`zeroshot` and `infill` beside them.

Every command writes a JSON result (--out, default named by its run: PROBE-DATASET-CHECKPOINT.json)
and logs its figures, the JSON and any page it wrote to MLflow (pipelines/infra/tracking.py): into
the training run with --run-id (at --step), else into a new run of the experiment `mdc-eval`. Probe
features of large datasets (at least --ray-threshold images) come from Ray Data batch inference
(pipelines/run/feature_extraction.py).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from mdc import export
from mdc.config import EvalConfig, RunConfig, derive, load_config
from mdc.data import shards
from mdc.evaluation import captioning, compositionality, infilling, probe, readers, suite, zeroshot
from mdc.sampling import SAMPLERS, SCHEDULES, Decoding
from mdc.training import checkpoint as ckpt
from pipelines.infra.console import console
from pipelines.infra.console import user_errors as console_user_errors
from pipelines.infra.run_inputs import absolute_uri
from pipelines.run import reports

eval_app = typer.Typer(
    no_args_is_help=True,
    help="Judge a model: all (a whole eval section), probe, compositionality, captions, zeroshot, infill.",
)

CHECKPOINT_HELP = (
    "checkpoint directory (model.safetensors + config.yaml), local or s3://; a folder `mdc export` wrote; "
    "or models:/NAME/VERSION | models:/NAME@ALIAS"
)
CHECKPOINT = typer.Option(..., help=CHECKPOINT_HELP)
ENCODER = typer.Option(
    None,
    help="probe another encoder instead: timm:NAME (random init, nothing downloaded) or local-dir:DIR (a timm folder)",
)
ENDPOINT = typer.Option(None, help="S3 endpoint for s3:// checkpoints and data")
MLFLOW_URI = typer.Option("sqlite:///mlflow.db", help="MLflow tracking URI ('' to skip logging)")
RUN_ID = typer.Option(None, help="log into this MLflow run (e.g. the training run) instead of a new one")
STEP = typer.Option(None, help="the step the figures are logged at (default: the checkpoint's, else 0)")
DEVICE = typer.Option("cpu", help="torch device for the model")
SCORER = typer.Option("auto", help="auto | ar | heuristic | montecarlo | clip | cdlm (auto: by the model's objective)")
SAMPLES = typer.Option(  # the eval section's default: one number of draws wherever a score is estimated
    EvalConfig.model_fields["samples"].default, min=1, help="Monte Carlo draws of (t, mask) per caption"
)
OUT = typer.Option(None, help="the JSON result (default: named by the run, in this folder)")


def report(
    result: dict,
    metrics: dict,
    out: Path,
    mlflow_uri: str,
    run_id: str | None,
    run_name: str,
    params: dict,
    extra_artifacts: tuple[Path, ...] = (),
    step: int = 0,
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    for name, value in metrics.items():
        console.print(f"{name}: {value:.4f}", highlight=False)
    console.print(f"result: {out}")
    if mlflow_uri:
        from pipelines.infra.tracking import log_evaluation  # MLflow: seconds to import, only when logging

        logged = log_evaluation(mlflow_uri, metrics, [out, *extra_artifacts], run_id, run_name, params, step)
        console.print(f"MLflow run {logged} ({mlflow_uri})")


def user_errors():
    """Bad inputs (missing files, fields, unknown names, unreachable storage) end with one line, exit 2."""
    return console_user_errors(FileNotFoundError, ValueError, RuntimeError)


def local_source(source: str, mlflow_uri: str) -> str:
    """A source `suite.load_subject` reads: a registered version becomes its downloaded folder."""
    if source.startswith("models:/"):
        from pipelines.run import model_registry  # MLflow: seconds to import, only for registered versions

        return str(model_registry.resolve(source, mlflow_uri))
    return source


def load(checkpoint: str, endpoint_url: str | None, device: str, mlflow_uri: str):
    """(model, RunConfig) of a checkpoint, an export's captioner or a registered version's."""
    subject, cfg = suite.load_subject(local_source(checkpoint, mlflow_uri), endpoint_url, device)
    if subject.captioner is None:
        raise ValueError(f"{checkpoint}: an encoder alone; this command needs a captioner (a checkpoint)")
    return subject.captioner, cfg


def subject_of(
    checkpoint: str | None, encoder: str | None, endpoint_url, device: str, mlflow_uri: str
) -> suite.Subject:
    """The model judged: `--encoder` (a timm encoder; with `--checkpoint`, that checkpoint's
    decoder scores captions with it) or `--checkpoint`."""
    if checkpoint is None and encoder is None:
        raise ValueError("give --checkpoint or --encoder")
    if encoder is None:
        return suite.load_subject(local_source(checkpoint, mlflow_uri), endpoint_url, device)[0]
    subject, _ = suite.load_subject(encoder, endpoint_url, device)
    if checkpoint is not None:
        model, cfg = load(checkpoint, endpoint_url, device, mlflow_uri)
        subject.captioner, subject.objective = (
            export.swap_encoder(model, subject.encoder, encoder).eval(),
            cfg.objective.name,
        )
    return subject


def run_name(kind: str, target: str, checkpoint: str) -> str:
    """An evaluation's MLflow run and the default name of its files: KIND-TARGET-CHECKPOINT."""
    return f"{kind}-{target}-{Path(checkpoint.rstrip('/')).name}"


def checkpoint_step(source: str, endpoint_url: str | None) -> int:
    """The step a checkpoint was saved at (its completion marker, else its folder's name,
    checkpoint_00000400), else 0 (an export, a timm encoder)."""
    try:
        return ckpt.marked_step(source, endpoint_url)
    except (OSError, ValueError, KeyError, RuntimeError):
        named = re.fullmatch(r"checkpoint_(\d+)", Path(source.rstrip("/")).name)
        return int(named.group(1)) if named else 0


def section(**fields) -> EvalConfig:
    """The eval section of the one set an `mdc eval` command's options name (seed and draws too)."""
    return EvalConfig.model_validate(fields)


# ------------------------------------------------------------------------------------- commands


@eval_app.command("all", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def all_command(
    ctx: typer.Context,
    checkpoint: str = typer.Option(..., help=CHECKPOINT_HELP + "; or timm:NAME | local-dir:DIR (with --config)"),
    config: Optional[Path] = typer.Option(
        None, help="a run config whose eval section to use (default: the checkpoint's own, as it trained)"
    ),
    endpoint_url: Optional[str] = ENDPOINT,
    device: str = DEVICE,
    step: Optional[int] = STEP,
    out: Optional[Path] = OUT,
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Every set of an eval section — probes, compositionality benchmarks, caption sets — under the
    keys training, tune, compare, scaling, study and the demo log. Extra arguments are
    `eval.key=value` overrides (e.g. 'eval.probes=[{dataset: cifar10, root: DIR}]')."""
    with user_errors():
        subject, own = suite.load_subject(local_source(checkpoint, mlflow_uri), endpoint_url, device)
        if config is None and own is None:
            raise ValueError(f"{checkpoint} carries no run config: give --config with the eval section to use")
        cfg = load_config(config, list(ctx.args)) if config else derive(own, list(ctx.args))
        if endpoint_url:
            cfg = derive(cfg, {"data.endpoint_url": endpoint_url})
        cfg = suite.resolve_section(cfg)
        suite.check_section(cfg.eval, cfg.data.endpoint_url)
        evaluation = suite.evaluate(subject, cfg.eval, endpoint_url=cfg.data.endpoint_url)
    for line in evaluation.skipped:
        console.print(f"[yellow]skipped {line}[/yellow]")
    name = run_name("all", cfg.name, checkpoint)
    result = {"checkpoint": checkpoint, "eval": cfg.eval.model_dump(), "metrics": evaluation.metrics}
    params = {"checkpoint": checkpoint, "config": str(config or "the checkpoint's own")}
    step = checkpoint_step(checkpoint, endpoint_url) if step is None else step
    report(result, evaluation.metrics, out or Path(f"{name}.json"), mlflow_uri, run_id, name, params, step=step)


@eval_app.command("probe")
def probe_command(
    checkpoint: Optional[str] = typer.Option(None, help=CHECKPOINT_HELP + " (or --encoder)"),
    encoder: Optional[str] = ENCODER,
    dataset: str = typer.Option(..., help=f"one of {', '.join(readers.dataset_kinds())}"),
    root: Optional[str] = typer.Option(None, help="dataset root (fashion-mnist: Debian's by default)"),
    name: Optional[str] = typer.Option(None, help="its name in the keys eval/probe/NAME/... (default: dataset)"),
    endpoint_url: Optional[str] = ENDPOINT,
    cache_dir: Optional[Path] = typer.Option(None, help="cache features here, by checkpoint and split"),
    baseline: bool = typer.Option(
        True, help="also probe the same architecture at random init (not for timm:NAME, itself at random init)"
    ),
    seed: int = typer.Option(0, help="the random-init baseline's weights"),
    batch_size: int = typer.Option(128, min=1),
    ray_threshold: int = typer.Option(20_000, help="use Ray batch inference from this many images"),
    num_actors: int = typer.Option(1, min=1, help="Ray inference actors"),
    address: Optional[str] = typer.Option(None, help="Ray cluster address; default: running or local"),
    device: str = DEVICE,
    step: Optional[int] = STEP,
    out: Optional[Path] = OUT,
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Linear probe: frozen pooled features, logistic regression with C chosen on held-out train."""
    with user_errors():
        if (checkpoint is None) == (encoder is None):
            raise ValueError("give --checkpoint or --encoder (one of them)")
        if root is None and dataset != "fashion-mnist":
            raise ValueError(f"--root is required for {dataset}")
        root = absolute_uri(root) or readers.FASHION_MNIST_ROOT
        ev = section(probes=[{"dataset": dataset, "root": root, "name": name}], random_init=baseline, seed=seed)
        spec, source = ev.probes[0], checkpoint or encoder
        subject = subject_of(checkpoint, encoder, endpoint_url, device, mlflow_uri)
        common = dict(root=spec.root, batch_size=batch_size, ray_threshold=ray_threshold, num_actors=num_actors)
        common |= dict(address=address, cache_dir=cache_dir, num_gpus=1 if device.startswith("cuda") else 0)
        with_extractors(subject, source, local_source(source, mlflow_uri), endpoint_url, device, seed, common)
        evaluation = suite.evaluate(subject, ev, ("probe",), endpoint_url)
    key = suite.probe_key(spec.key)
    result = {**evaluation.details[key], "checkpoint" if checkpoint else "encoder": source}
    for figure in suite.PROBE_FIGURES:
        if suite.probe_key(spec.key, f"random_init_{figure}") in evaluation.metrics:
            result[f"random_init_{figure}"] = evaluation.metrics[suite.probe_key(spec.key, f"random_init_{figure}")]
    run = run_name("probe", spec.key, source)
    params = {"checkpoint" if checkpoint else "encoder": source, "dataset": dataset, "root": spec.root}
    step = checkpoint_step(source, endpoint_url) if step is None else step
    report(result, evaluation.metrics, out or Path(f"{run}.json"), mlflow_uri, run_id, run, params, step=step)


def with_extractors(
    subject: suite.Subject, source: str, local: str, endpoint_url, device: str, seed: int, common: dict
):
    """The subject's probe features through `Extractor`s: Ray batch inference from `ray_threshold`
    images, cached under `cache_dir` by the weights' content (the baseline's by its config)."""
    from pipelines.run.feature_extraction import (  # Ray: seconds to import
        Extractor,
        checkpoint_model,
        random_init_model,
    )

    cached = common["cache_dir"] is not None
    if source.startswith(export.ENCODER_KINDS):
        folder = Path(source.removeprefix("local-dir:")).expanduser()
        key = (
            f"timm-{probe.file_fingerprint(folder / export.TIMM_WEIGHTS)}"
            if cached and source.startswith("local-dir:")
            else f"timm-{source}"
        )
        subject.features = Extractor(
            subject.encoder, functools.partial(export.load_encoder, source, device), key, **common
        )
        if subject.random_init is not None:
            config_hash = probe.file_fingerprint(folder / export.TIMM_CONFIG) if cached else ""
            fresh = functools.partial(export.random_init_encoder, source, device, seed)
            subject.baseline_features = Extractor(fresh(), fresh, f"timm-random-init-{config_hash}-{seed}", **common)
        return
    directory = ckpt.fetch_checkpoint(
        Path(local) / export.CAPTIONER if (Path(local) / export.CAPTIONER).is_dir() else local, endpoint_url
    )
    key = probe.file_fingerprint(directory / ckpt.WEIGHTS) if cached else ""
    subject.features = Extractor(
        subject.encoder, functools.partial(checkpoint_model, str(directory), device), key, **common
    )
    cfg = ckpt.load_exported_config(directory / ckpt.CONFIG)
    config_hash = probe.file_fingerprint(directory / ckpt.CONFIG) if cached else ""
    fresh = functools.partial(random_init_model, cfg, device, seed)
    subject.baseline_features = Extractor(fresh(), fresh, f"random-init-{config_hash}-{seed}", **common)


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
    out: Optional[Path] = OUT,
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Zero-shot classification: the class whose templated caption the model scores highest."""
    with user_errors():
        model, cfg = load(checkpoint, endpoint_url, device, mlflow_uri)
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
    name = run_name("zeroshot", dataset, checkpoint)
    report(
        result,
        {f"eval/zeroshot/{dataset}/accuracy": result["accuracy"]},
        out or Path(f"{name}.json"),
        mlflow_uri,
        run_id,
        name,
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
    benchmark: str = typer.Option(..., help="aro | sugarcrepe | shapes (a dataset `mdc data shapes` wrote)"),
    root: str = typer.Option(..., help="folder with the benchmark's JSON files (shapes: the dataset, also s3://)"),
    image_dir: Optional[str] = typer.Option(None, help="image folder (default ROOT/images)"),
    subsets: Optional[str] = typer.Option(None, help="comma-separated subsets (default: every file present)"),
    name: Optional[str] = typer.Option(
        None, help="its name in the keys eval/compositionality/NAME/... (default: benchmark)"
    ),
    scorer: str = SCORER,
    samples: int = SAMPLES,
    seed: int = 0,
    normalize: str = typer.Option("none", help="none: summed log-likelihood | token: per-token mean"),
    limit: Optional[int] = typer.Option(None, help="score only the first N items of each subset"),
    batch_size: int = typer.Option(32, min=1),
    endpoint_url: Optional[str] = ENDPOINT,
    device: str = DEVICE,
    step: Optional[int] = STEP,
    out: Optional[Path] = OUT,
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """ARO / SugarCrepe: share of images whose true caption scores above every manipulated one, and
    beside it the blind accuracy (each caption pair scored against another item's image)."""
    with user_errors():
        spec = {"benchmark": benchmark, "root": absolute_uri(root), "image_dir": absolute_uri(image_dir), "name": name}
        spec["subsets"] = subsets.split(",") if subsets else None
        ev = section(compositionality=[spec], samples=samples, seed=seed, normalize=normalize, limit=limit)
        if encoder and checkpoint is None:
            checkpoint = text_side(encoder)
        subject = subject_of(checkpoint, encoder, endpoint_url, device, mlflow_uri)
        evaluation = suite.evaluate(
            subject, ev, ("compositionality",), endpoint_url, batch_size=batch_size, scorer=scorer
        )
    key = ev.compositionality[0].key
    result = {**evaluation.details[f"{suite.PREFIX}/compositionality/{key}"], "samples": samples}
    result |= {"checkpoint": checkpoint, "encoder": encoder}
    print_compositionality(result)
    run = run_name(key, result["scorer"], encoder or checkpoint)
    params = {"checkpoint": checkpoint, "encoder": encoder, "benchmark": benchmark, "scorer": result["scorer"]}
    params |= {"samples": samples, "normalize": normalize}
    step = checkpoint_step(checkpoint, endpoint_url) if step is None else step
    report(result, evaluation.metrics, out or Path(f"{run}.json"), mlflow_uri, run_id, run, params, step=step)


def text_side(encoder: str) -> str:
    """The captioner an export holds beside its encoder, which scores captions with it."""
    folder = Path(encoder.removeprefix("local-dir:")).expanduser()
    if not encoder.startswith("local-dir:") or not (folder / export.CAPTIONER).is_dir():
        raise ValueError(
            f"--encoder {encoder} has no text side: compositionality scores captions with a decoder; "
            "give --checkpoint, or a folder `mdc export` wrote with its captioner/"
        )
    return str(folder / export.CAPTIONER)


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
    lengths: Optional[str] = typer.Option(
        None,
        help="caption lengths N' (max tokens for autoregressive models); default: the paper's 10, 15, 20 that "
        "fit the model's max_length; also 'predicted' (the length head's, models trained with one) and "
        "'reference' (each image's median reference length: an upper bound)",
    ),
    name: Optional[str] = typer.Option(
        None, help="its name in the keys eval/captions/NAME/... (default: the folder's)"
    ),
    sampler: str = typer.Option("confidence", help=f"{' | '.join(SAMPLERS)} (masked diffusion)"),
    steps: Optional[int] = typer.Option(
        None, min=1, help="denoising passes (default N', one token per pass; more than N' are N')"
    ),
    schedule: str = typer.Option(
        "fixed",
        help=f"{' | '.join(SCHEDULES)}: tokens a pass (fixed: N'/steps; linear: spread evenly; cosine: MaskGIT)",
    ),
    threshold: Optional[float] = typer.Option(
        None, help="commit every position at least this probable, at least one a pass (Fast-dLLM)"
    ),
    guidance_scale: float = typer.Option(1.0, help="DDCap guidance s (image-free-trained models; DDCap: 1.06)"),
    limit: Optional[int] = typer.Option(100, help="caption the first N distinct images"),
    seed: int = 0,
    batch_size: int = typer.Option(32, min=1),
    endpoint_url: Optional[str] = ENDPOINT,
    device: str = DEVICE,
    step: Optional[int] = STEP,
    out: Optional[Path] = OUT,
    html: Optional[Path] = typer.Option(None, help="captions page (default: beside --out, named alike)"),
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Write captions and score them: BLEU-4, CIDEr-D, captions per second, and an HTML page."""
    with user_errors():
        decoding = Decoding(sampler, steps, schedule, threshold, guidance_scale)
        model, cfg = load(checkpoint, endpoint_url, device, mlflow_uri)
        sizes = caption_sizes(lengths, cfg.data.max_length)
        spec = {"uri": data, "name": name or suite.caption_set_name(data), "lengths": sizes, "limit": limit}
        ev = section(captions=[spec], seed=seed)
        subject = suite.of_captioner(model, cfg, device)
        evaluation = suite.evaluate(subject, ev, ("captions",), endpoint_url, decoding=decoding, batch_size=batch_size)
        result = {
            "data": data,
            "checkpoint": checkpoint,
            **evaluation.details[f"{suite.PREFIX}/captions/{spec['name']}"],
        }
    caption_notes(result, cfg, steps)
    run = run_name("captions", spec["name"], checkpoint)
    out = out or Path(f"{run}.json")
    html = html or out.with_suffix(".html")
    html.parent.mkdir(parents=True, exist_ok=True)
    written = f"Captions written at N' = {', '.join(map(str, result['lengths']))}."
    images = evaluation.images[spec["name"]]
    html.write_text(
        reports.page(f"{run}: {data}", [("Held-out captions", reports.captions_html(images, result, written))])
    )
    console.print(f"report: {html}")
    params = {
        "checkpoint": checkpoint,
        "data": data,
        "sampler": result["sampler"],
        "lengths": ",".join(map(str, sizes)),
    }
    params |= {"steps": steps, "schedule": schedule, "guidance_scale": guidance_scale}
    step = checkpoint_step(checkpoint, endpoint_url) if step is None else step
    report(result, evaluation.metrics, out, mlflow_uri, run_id, run, params, (html,), step=step)


def caption_sizes(lengths: str | None, max_length: int) -> list[int | str]:
    """--lengths as N's and names; by default the paper's 10, 15, 20 that the model can write."""
    if lengths is None:
        return [n for n in (10, 15, 20) if n <= max_length] or [max_length]
    sizes = [n if n in captioning.LENGTH_CHOICES else int(n) for n in lengths.split(",") if n.strip()]
    if not sizes:
        raise ValueError(f"--lengths {lengths!r}: no length")
    return sizes


def caption_notes(result: dict, cfg: RunConfig, steps: int | None) -> None:
    """What was not written as asked: lengths the model cannot write, steps above N'."""
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
    if result.get("clamped_steps"):
        console.print(
            f"[yellow]--steps {steps} is more passes than N' = {', '.join(map(str, result['clamped_steps']))} has "
            "tokens: those are written in N' passes, one token each[/yellow]"
        )


@eval_app.command("infill")
def infill_command(
    checkpoint: str = CHECKPOINT,
    data: str = typer.Option(..., help="shards with reference captions (local or s3://)"),
    ratio: float = typer.Option(0.3, min=0.0, max=1.0, help="share of each caption's tokens masked, as one span"),
    sampler: str = typer.Option("confidence", help=" | ".join(SAMPLERS)),
    limit: Optional[int] = typer.Option(100, help="infill the first caption of the first N distinct images"),
    seed: int = 0,
    batch_size: int = typer.Option(32, min=1),
    endpoint_url: Optional[str] = ENDPOINT,
    device: str = DEVICE,
    out: Optional[Path] = OUT,
    mlflow_uri: str = MLFLOW_URI,
    run_id: Optional[str] = RUN_ID,
):
    """Caption infilling (DDCap): mask a span of a reference caption, fill it, score BLEU-4 / CIDEr-D."""
    with user_errors():
        model, cfg = load(checkpoint, endpoint_url, device, mlflow_uri)
        images = captioning.group_by_image(shards.read_shards(data, endpoint_url), limit)
        if not images:
            raise ValueError(f"no samples in {data}")
        result = {
            "data": data,
            "checkpoint": checkpoint,
            **infilling.evaluate_infilling(model, cfg.objective.name, images, ratio, sampler, batch_size, seed),
        }
    name = run_name("infill", suite.caption_set_name(data), checkpoint)
    report(
        result,
        {"eval/infill/bleu4": result["bleu4"], "eval/infill/cider": result["cider"]},
        out or Path(f"{name}.json"),
        mlflow_uri,
        run_id,
        name,
        {"checkpoint": checkpoint, "data": data, "sampler": sampler, "ratio": ratio},
    )
