"""Pages and plots a person looks at after a run: the training curves as a PNG, tables of whatever
columns the results hold, captions beside their images, put together as one self-contained HTML
page (images inline) and logged to MLflow. Used by the demo, `mdc eval captions` and the end of
every training run; a study or a comparison can assemble its own page from the same parts."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Sequence

CURVES = ("loss", "val_loss")


def escape(text: str) -> str:
    """Text for an element's content or a double-quoted attribute."""
    return html.escape(text, quote=False).replace('"', "&quot;")
STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:auto}td,th{vertical-align:top;padding:4px 10px;"
         "border-bottom:1px solid #ddd;text-align:left}img{image-rendering:pixelated}")


def metric_history(tracking_uri: str, run_id: str, keys: Sequence[str] = CURVES) -> dict[str, list[tuple[int, float]]]:
    """(step, value) pairs of each metric the run logged, by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    history = {key: sorted({m.step: m.value for m in client.get_metric_history(run_id, key)}.items()) for key in keys}
    return {key: points for key, points in history.items() if points}


def curves_png(history: dict[str, list[tuple[int, float]]], path: Path, title: str = "") -> Path:
    """The training loss and the validation loss against the step, one axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, points in history.items():
        ax.plot([s for s, _ in points], [v for _, v in points], label=key, marker="o" if len(points) < 20 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    body = "".join("<tr>" + "".join(f"<td>{escape(_cell(row.get(c)))}</td>" for c in columns) + "</tr>"
                   for row in rows)
    title = f"<caption>{escape(caption)}</caption>" if caption else ""
    return f"<table>{title}<tr>{head}</tr>{body}</table>"


def captions_html(images, result: dict, note: str = "") -> str:
    """Each captioned image (inline) beside its generated captions (per N') and its references, after
    the scores per N'. `images` are mdc.evaluation.captioning.CaptionImage, `result` what
    captioning.evaluate_captions returned for them."""
    from mdc.data.shards import image_extension

    scores = [{"N'": n, "BLEU-4": m["bleu4"], "CIDEr-D": m["cider"], "captions/s": m["captions_per_s"]}
              for n, m in result["lengths"].items()]
    rows = []
    for img, entry in zip(images, result["captions"]):
        mime = "image/" + {"jpg": "jpeg"}.get(image_extension(img.image), image_extension(img.image))
        generated = "".join(f"<li><b>N'={n}</b> {escape(c)}</li>" for n, c in entry["generated"].items())
        refs = "".join(f"<li>{escape(r)}</li>" for r in entry["references"])
        rows.append(f"<tr><td><img class=\"caption-image\" src=\"{data_uri(img.image, mime)}\" width=\"96\"><br>"
                    f"<code>{escape(img.key)}</code></td><td><ul>{generated}</ul></td><td><ul>{refs}</ul></td></tr>")
    return (f"<p>{escape(note)} Sampler: {escape(result['sampler'])}; "
            f"{result['num_images']} held-out images.</p>{table_html(scores)}"
            "<table><tr><th>image</th><th>generated</th><th>references</th></tr>" + "".join(rows) + "</table>")


def page(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """A self-contained HTML page of (heading, HTML body) sections."""
    body = "".join(f"<h2>{escape(heading)}</h2>{content}" for heading, content in sections)
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>{body}</body></html>")


def image_html(png: Path, alt: str) -> str:
    return f"<img class=\"curves\" alt=\"{escape(alt)}\" src=\"{data_uri(png.read_bytes(), 'image/png')}\">"


def log_artifacts(tracking_uri: str, run_id: str, paths: Sequence[Path], artifact_path: str = "report") -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    for path in paths:
        client.log_artifact(run_id, str(path), artifact_path=artifact_path)


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
    """curves.png and captions.html of a finished training run (captions of the first held-out
    images at N' = 10, or the model's maximum when shorter), written to `directory`."""
    from mdc.data import shards
    from mdc.train.checkpoint import load_pretrained
    from mdc.evaluation import captioning
    from mdc.registry import OBJECTIVES
    from pipelines import tracking

    history = metric_history(tracking.absolute_tracking_uri(cfg.mlflow_uri), summary.mlflow_run_id)
    paths = [curves_png(history, directory / "curves.png", f"{cfg.name}: {cfg.objective.name}, {cfg.train.steps} steps")]
    if cfg.data.val_uri and OBJECTIVES[cfg.objective.name].write:
        model, _ = load_pretrained(summary.checkpoint_uri, endpoint_url=cfg.data.endpoint_url)
        length = min(10, cfg.data.max_length - 1)
        images = captioning.group_by_image(shards.read_shards(cfg.data.val_uri, cfg.data.endpoint_url), num_images)
        result = captioning.evaluate_captions(model, cfg.objective.name, images, (length,))
        (directory / "captions.html").write_text(page(f"{cfg.name}: held-out captions", [
            ("Training", image_html(paths[0], "training and validation loss")),
            ("Held-out captions", captions_html(images, result, f"Captions written at N' = {length}."))]))
        paths.append(directory / "captions.html")
    return paths
