"""Every table and plot a person looks at after a run: Markdown, CSV and HTML tables, the training
curves, the scaling curve, a sweep's metrics and a study's claim intervals as PNGs, captions beside
their images, put together as one self-contained HTML page (images inline). Used by the demo,
`mdc eval captions`, the end of every training run, `mdc compare`, `mdc scaling`, `mdc tune` and
`mdc study`; pipelines/infra/tracking.py logs them to MLflow."""

from __future__ import annotations

import base64
import csv
import html
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window: runs on headless workers
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from mdc.data import shards
from mdc.evaluation import captioning, suite
from mdc.registry import OBJECTIVES
from mdc.training.checkpoint import load_pretrained
from pipelines.infra import tracking

CURVES = ("loss", "val_loss")


def escape(text: str) -> str:
    """Text for an element's content or a double-quoted attribute."""
    return html.escape(text, quote=False).replace('"', "&quot;")


STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:auto}td,th{vertical-align:top;padding:4px 10px;"
    "border-bottom:1px solid #ddd;text-align:left}img{image-rendering:pixelated}"
)


def curves_png(history: dict[str, list[tuple[int, float]]], path: Path, title: str = "", ylabel: str = "loss") -> Path:
    """Metrics against the step, one axis: the training and validation losses, or the online
    evaluation's accuracies."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, points in history.items():
        ax.plot([s for s, _ in points], [v for _, v in points], label=key, marker="o" if len(points) < 20 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def online_curves(tracking_uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """The run's headline evaluation figures (suite.headline) logged at more than one step: its
    evaluation during training, drawn against the step."""
    keys = suite.headline(tracking.latest_metrics(tracking_uri, run_id))
    history = tracking.metric_history(tracking_uri, run_id, [k for k in keys if not k.endswith("/gain")])
    return {key: points for key, points in history.items() if len(points) > 1}


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of formatted cells, one row per sequence."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def scaling_png(sizes: Sequence[int], accuracies: Sequence[float], path: Path, title: str) -> Path:
    """Probe accuracy against the number of distinct training pairs, log x."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(sizes, accuracies, marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("distinct pairs in the training subset")
    ax.set_ylabel("linear probe top-1")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep_png(rows: Sequence[dict], x_key: str, metrics: Sequence[str], path: Path, title: str) -> Path:
    """One bar chart per metric over the trials, labelled by the swept parameter `x_key`."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.5))
    for ax, metric in zip(axes, metrics):
        sweep_panel(ax, rows, x_key, metric)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep_panel(ax, rows: Sequence[dict], x_key: str, metric: str) -> None:
    """The trials' `metric` as bars; a panel no trial reported to says so, and why, instead of
    staying empty."""
    points = [(r[x_key], r[metric]) for r in rows if r.get(metric) is not None]
    ax.bar(range(len(points)), [y for _, y in points], tick_label=[str(x) for x, _ in points])
    if not points:
        failed = sum(1 for r in rows if r.get("error"))
        ax.text(
            0.5,
            0.5,
            f"no trial reported {metric}\n({failed} of {len(rows)} failed: results.md has their errors)",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=8,
        )
    ax.set_xlabel(x_key)
    ax.set_ylabel(metric)
    ax.tick_params(axis="x", rotation=30)


def claim_x_range(c: dict) -> tuple[float, float]:
    """The x range of one claim's row: its interval, 0 and −margin, with a tenth of room each side."""
    low = min(c["ci_low"], 0.0, -c["margin"] if c["expect"] == "at_least" else 0.0)
    high = max(c["ci_high"], 0.0)
    pad = 0.1 * (high - low) or 1.0
    return low - pad, high + pad


def claims_png(claims: Sequence[dict], path: Path, confidence: float) -> Path:
    """Each claim's interval against 0 (and −margin for `at_least`), coloured by verdict, one row
    per claim on its own x scale: metrics differ by orders of magnitude (accuracies, captions/s)."""
    colours = {"holds": "tab:green", "reversed": "tab:red", "inconclusive": "tab:gray"}
    colours["not testable at this budget"] = "tab:olive"  # a gate claim did not hold (study.gated)
    fig, axes = plt.subplots(len(claims), 1, figsize=(8, 0.7 * len(claims) + 0.9), squeeze=False)
    for ax, c in zip(axes[:, 0], claims):
        ax.plot([c["ci_low"], c["ci_high"]], [0, 0], color=colours[c["verdict"]], linewidth=3)
        ax.plot([c["mean_diff"]], [0], "o", color=colours[c["verdict"]])
        if c["expect"] == "at_least":
            ax.plot([-c["margin"]], [0], "|", color="black", markersize=12)
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set_xlim(*claim_x_range(c))
        ax.set_yticks([0], [f"{c['name']} ({c['verdict']})"], fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylim(-1, 1)
    axes[-1, 0].set_xlabel(f"mean a − b, {int(confidence * 100)}% t interval; each row on its own scale")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return "" if value is None else str(value)


def table_html(rows: Sequence[dict], caption: str = "") -> str:
    """A table with every column any row holds, in first-seen order (missing cells empty)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{escape(_cell(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows)
    title = f"<caption>{escape(caption)}</caption>" if caption else ""
    return f"<table>{title}<tr>{head}</tr>{body}</table>"


def captions_html(images, result: dict, note: str = "") -> str:
    """Each captioned image (inline) beside its generated captions (per N') and its references, after
    the scores per N'. `images` are mdc.evaluation.captioning.CaptionImage, `result` what
    captioning.evaluate_captions returned for them."""
    scores = [
        {"N'": n, "BLEU-4": m["bleu4"], "CIDEr-D": m["cider"], "captions/s": m["captions_per_s"]}
        for n, m in result["lengths"].items()
    ]
    rows = []
    for img, entry in zip(images, result["captions"]):
        mime = "image/" + {"jpg": "jpeg"}.get(shards.image_extension(img.image), shards.image_extension(img.image))
        generated = "".join(f"<li><b>N'={n}</b> {escape(c)}</li>" for n, c in entry["generated"].items())
        refs = "".join(f"<li>{escape(r)}</li>" for r in entry["references"])
        rows.append(
            f'<tr><td><img class="caption-image" src="{data_uri(img.image, mime)}" width="96"><br>'
            f"<code>{escape(img.key)}</code></td><td><ul>{generated}</ul></td><td><ul>{refs}</ul></td></tr>"
        )
    return (
        f"<p>{escape(note)} Sampler: {escape(result['sampler'])}; "
        f"{result['num_images']} held-out images.</p>{table_html(scores)}"
        "<table><tr><th>image</th><th>generated</th><th>references</th></tr>" + "".join(rows) + "</table>"
    )


def page(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """A self-contained HTML page of (heading, HTML body) sections."""
    body = "".join(f"<h2>{escape(heading)}</h2>{content}" for heading, content in sections)
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>{body}</body></html>"
    )


def image_html(png: Path, alt: str) -> str:
    return f'<img class="curves" alt="{escape(alt)}" src="{data_uri(png.read_bytes(), "image/png")}">'


def results_html(results: dict) -> str:
    """Evaluation results as two tables: the single numbers, and the per-subset ones (every dict
    of the results keyed by subset becomes a column: accuracy, blind accuracy, ...)."""
    single = [{"measure": k, "value": v} for k, v in results.items() if not isinstance(v, (dict, list))]
    subsets: dict[str, dict] = {}
    for column, values in results.items():
        if isinstance(values, dict):
            for subset, value in values.items():
                subsets.setdefault(subset, {"subset": subset})[column] = value
    return table_html(single) + (table_html(list(subsets.values())) if subsets else "")


def training_report(cfg, summary, directory: Path, num_images: int = 8) -> list[Path]:
    """curves.png (online.png with online evaluation) and captions.html of a finished training run (captions of the first held-out
    images at N' = 10, or the model's maximum when shorter), written to `directory`."""
    mlflow_uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    history = tracking.metric_history(mlflow_uri, summary.mlflow_run_id, CURVES)
    paths = [
        curves_png(history, directory / "curves.png", f"{cfg.name}: {cfg.objective.name}, {cfg.train.steps} steps")
    ]
    online = online_curves(mlflow_uri, summary.mlflow_run_id)
    if online:
        title = f"{cfg.name}: the encoder during training"
        paths.append(curves_png(online, directory / "online.png", title, "accuracy"))
    if cfg.data.val_uri and OBJECTIVES[cfg.objective.name].write:
        model, _ = load_pretrained(summary.checkpoint_uri, endpoint_url=cfg.data.endpoint_url)
        length = min(10, cfg.data.max_length - 1)
        images = captioning.group_by_image(shards.read_shards(cfg.data.val_uri, cfg.data.endpoint_url), num_images)
        result = captioning.evaluate_captions(model, cfg.objective.name, images, (length,))
        (directory / "captions.html").write_text(
            page(
                f"{cfg.name}: held-out captions",
                [
                    ("Training", "".join(image_html(p, "curves against step") for p in paths)),
                    ("Held-out captions", captions_html(images, result, f"Captions written at N' = {length}.")),
                ],
            )
        )
        paths.append(directory / "captions.html")
    return paths
