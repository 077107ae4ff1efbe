"""`mdc schedule`: the noise interval [ω_l, ω_u] chosen by the variance of MDC's training-loss estimator
(mdc/schedule.py), on the config's own captions, with a table, a heat map and an MLflow run.

No Ray: one process, minutes on 2 CPU cores. The model is the config's at random init (seeded) or a
checkpoint's, in eval mode (dropout is noise of its own, not the schedule's)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mdc import schedule
from mdc.config import RunConfig
from mdc.data import shards
from mdc.data.images import preprocess_batch
from mdc.data.tokenizer import CaptionTokenizer
from mdc.registry import build_model
from mdc.training import checkpoint as ckpt

PAPER = (0.5, 1.0)  # the paper's choice on CC3M
FULL = (0.0, 1.0)
MAX_READ = 20_000  # samples read from the training data before `captions` are drawn from them


@dataclass
class ScheduleOptions:
    step: float = 0.25
    draws: int = 200
    batch_size: int | None = None  # default: train.batch_size
    captions: int = 512
    grad_coordinates: int = 2048  # 0: the loss only
    min_width: float = 0.5
    resamples: int = 400
    seed: int = 0


def load_captions(cfg: RunConfig, n: int, image_size: int, seed: int, endpoint_url=None):
    """(images, tokens, captions) of n samples drawn (seeded) from the first MAX_READ of data.train_uri."""
    samples = []
    for sample in shards.read_shards(cfg.data.train_uri, endpoint_url or cfg.data.endpoint_url):
        samples.append(sample)
        if len(samples) >= MAX_READ:
            break
    if len(samples) < 2:
        raise ValueError(f"data.train_uri: {cfg.data.train_uri} holds {len(samples)} samples; the estimator needs 2+")
    pick = np.random.default_rng(seed).permutation(len(samples))[:n]
    chosen = [samples[i] for i in pick]
    images, _ = preprocess_batch([s.image for s in chosen], image_size)
    tokens = CaptionTokenizer(cfg.data.max_length).encode([s.caption for s in chosen])
    return torch.from_numpy(images), torch.from_numpy(tokens), [s.caption for s in chosen]


def load_model(cfg: RunConfig, checkpoint: str | None, seed: int, endpoint_url=None):
    if checkpoint:
        model, _ = ckpt.load_pretrained(checkpoint, "cpu", endpoint_url)
    else:
        model = build_model(cfg, CaptionTokenizer, seed=seed)
    if not hasattr(model, "mask_id"):
        raise ValueError(f"objective.name={cfg.objective.name}: not a masked captioner; the MDC estimator needs one")
    return model.eval()


def measure(model, images, tokens, opts: ScheduleOptions, batch_size: int) -> dict:
    """Per interval: mean loss, relative variances of loss and gradient with bootstrap intervals."""
    intervals = schedule.grid(opts.step)
    for extra in (FULL, PAPER):
        if extra not in intervals:
            intervals.append(extra)
    coords = schedule.gradient_coordinates(model, opts.grad_coordinates, opts.seed) if opts.grad_coordinates else None
    draws = {
        iv: schedule.draw_estimates(model, images, tokens, iv, opts.draws, batch_size, opts.seed, coordinates=coords)
        for iv in intervals
    }
    loss_ci, loss_boot = schedule.bootstrap({iv: d.loss for iv, d in draws.items()}, opts.resamples, opts.seed)
    grad_ci, grad_boot = (
        schedule.bootstrap({iv: d.grad for iv, d in draws.items()}, opts.resamples, opts.seed) if coords else ({}, {})
    )
    real_tokens = float((tokens != model.pad_id).sum(dim=1).double().mean()) * batch_size
    rows = {}
    for iv, d in draws.items():
        rows[iv] = {
            "mean_loss": float(d.loss.mean()),
            "loss_relvar": schedule.relative_variance(d.loss),
            "loss_relvar_ci": loss_ci[iv],
            "closed_form_masking_relvar": schedule.closed_form_relative_variance(*iv, round(real_tokens)),
            "grad_relvar": schedule.relative_variance(d.grad) if coords else None,
            "grad_relvar_ci": grad_ci.get(iv),
        }
    ratios = {"loss": schedule.ratio_interval(loss_boot, FULL, PAPER)}
    if coords:
        ratios["grad"] = schedule.ratio_interval(grad_boot, FULL, PAPER)
    return {"rows": rows, "ratios": ratios, "tokens_per_batch": real_tokens}


def recommend(rows: dict, min_width: float, key: str = "loss_relvar") -> tuple[float, float]:
    """The interval of least relative variance among those at least min_width wide: without a floor
    the least-variance interval is a sliver at t = 1 (every token masked, the weight 1), which trains
    captions from the image alone."""
    candidates = {iv: r[key] for iv, r in rows.items() if iv[1] - iv[0] >= min_width - 1e-9 and r[key] is not None}
    if not candidates:
        raise ValueError(f"no interval of the grid is at least --min-width {min_width} wide")
    return min(candidates, key=candidates.get)


def heat_map(rows: dict, recommended: tuple, path: Path) -> Path:
    import matplotlib  # only to draw: seconds to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the headless backend is chosen

    lows = sorted({iv[0] for iv in rows})
    highs = sorted({iv[1] for iv in rows})
    panels = [("loss_relvar", "loss: Var / mean²")] + (
        [("grad_relvar", "gradient: tr Cov / |E g|²")] if next(iter(rows.values()))["grad_relvar"] is not None else []
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        grid = np.full((len(lows), len(highs)), np.nan)
        for iv, r in rows.items():
            grid[lows.index(iv[0]), highs.index(iv[1])] = np.log10(max(r[key], 1e-12))
        image = ax.imshow(grid, origin="lower", cmap="viridis")
        ax.set_xticks(range(len(highs)), [f"{h:g}" for h in highs], rotation=90 if len(highs) > 8 else 0)
        ax.set_yticks(range(len(lows)), [f"{v:g}" for v in lows])
        ax.set_xlabel("ω_u")
        ax.set_ylabel("ω_l")
        ax.set_title(f"log10 {title}")
        for iv, marker in ((recommended, "*"), (PAPER, "o"), (FULL, "x")):
            if iv in rows:
                ax.plot(highs.index(iv[1]), lows.index(iv[0]), marker, color="red", markersize=10, fillstyle="none")
        fig.colorbar(image, ax=ax)
    fig.suptitle("* recommended, o paper's [0.5, 1], x [0, 1]")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_schedule(
    cfg: RunConfig, checkpoint: str | None, opts: ScheduleOptions, out_dir: Path, endpoint_url: str | None = None
) -> dict:
    """Measure, recommend, write schedule.json and schedule.png under out_dir; returns the result."""
    started = time.time()
    model = load_model(cfg, checkpoint, opts.seed, endpoint_url)
    images, tokens, captions = load_captions(cfg, opts.captions, model.image_size, opts.seed, endpoint_url)
    batch_size = opts.batch_size or cfg.train.batch_size
    result = measure(model, images, tokens, opts, batch_size)
    result["recommended"] = recommend(result["rows"], opts.min_width)
    if opts.grad_coordinates:
        result["recommended_by_gradient"] = recommend(result["rows"], opts.min_width, "grad_relvar")
    words = [len(c.split()) for c in captions]
    result |= {
        "captions": len(captions),
        "mean_words": float(np.mean(words)),
        "mean_tokens": float((tokens != model.pad_id).sum(dim=1).double().mean()),
        "batch_size": batch_size,
        "options": opts.__dict__,
        "checkpoint": checkpoint,
        "data": cfg.data.train_uri,
        "seconds": time.time() - started,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    result["heat_map"] = str(heat_map(result["rows"], result["recommended"], out_dir / "schedule.png"))
    serialisable = {**result, "rows": [{"omega_l": iv[0], "omega_u": iv[1], **r} for iv, r in result["rows"].items()]}
    (out_dir / "schedule.json").write_text(json.dumps(serialisable, indent=1, default=list))
    return result


def metrics(result: dict) -> dict[str, float]:
    """The MLflow figures: one key per interval and quantity, the ratio [0, 1] / [0.5, 1], the choice."""
    out = {}
    for (low, high), r in result["rows"].items():
        name = f"{low:.2f}_{high:.2f}"
        out[f"schedule/loss_relvar/{name}"] = r["loss_relvar"]
        if r["grad_relvar"] is not None:
            out[f"schedule/grad_relvar/{name}"] = r["grad_relvar"]
    for quantity, (low, high) in result["ratios"].items():
        out[f"schedule/{quantity}_ratio_full_over_paper_low"] = low
        out[f"schedule/{quantity}_ratio_full_over_paper_high"] = high
    out["schedule/recommended_omega_l"], out["schedule/recommended_omega_u"] = result["recommended"]
    return out
