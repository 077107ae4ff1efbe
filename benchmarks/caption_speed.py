"""CIDEr-D against captions per second: MDC's decoding settings beside AR on one checkpoint pair.

A tiny MDC and a tiny AR captioner (same preset, vocabulary and caption length) are trained here
from scratch, in this process, on the generated shapes dataset; both then caption the same held-out
images. MDC is run at a fixed N' (the held-out captions' median length) at full steps (N' passes,
one token each, as in the paper), with fewer passes (linear and cosine schedules) and with
confidence thresholds (Fast-dLLM); at its length head's N' per image, full steps and thresholds;
and at each image's reference length (an oracle, an upper bound). AR decodes greedily with its KV
cache. Quality is CIDEr-D against the held-out captions; speed is captions per second at
B = 32 and seconds per caption at B = 1, each the median of `--repeats` timed passes after one
untimed warm-up, on `--threads` threads.

    python -m benchmarks.caption_speed            # ~10 min on 2 CPU cores
    python -m benchmarks.caption_speed --steps 600 --out runs/caption-speed

Writes `result.json`, `caption_speed.png` (the curve), `table.md` and the two exported checkpoints
(`checkpoints/mdc`, `checkpoints/ar`, for `mdc eval captions`) under `--out`, and prints the
fastest MDC setting within `--tolerance` CIDEr-D of full-step MDC, with its ratio to AR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mdc.config import OptimConfig, dump_config, load_config
from mdc.data.shapes import generate_shapes
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation.captioning import caption_metrics
from mdc.evaluation.probe import preprocess
from mdc.registry import build_model, write_captions
from mdc.sampling import Decoding
from mdc.training.checkpoint import export_weights
from mdc.training.step import build_optimizer, build_scheduler, train_step

IMAGE_SIZE, MAX_LENGTH = 32, 16
AR = "ar greedy"


def settings(length: int) -> list[Decoding]:
    """Full steps first (the reference), then fewer passes and thresholds."""
    few = [Decoding(schedule=s, steps=k) for s in ("linear", "cosine") for k in (2, 3, 4, 6) if k < length]
    return [Decoding(), *few, *(Decoding(threshold=p) for p in (0.9, 0.7, 0.5))]


def train(objective: str, images: torch.Tensor, tokens: torch.Tensor, steps: int, batch: int):
    """(model, config); MDC with DDCap's length head (its loss is added), so it can also write at
    its predicted N'."""
    cfg = load_config(
        None,
        [f"objective.name={objective}", f"data.max_length={MAX_LENGTH}", f"model.predict_length={objective == 'mdc'}"],
    )
    torch.manual_seed(0)
    model = build_model(cfg, CaptionTokenizer)
    optimizer = build_optimizer(model, OptimConfig(lr=2e-3, weight_decay=0.0))
    scheduler = build_scheduler(optimizer, warmup=20, total=steps)
    generator, order = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    for _ in range(steps):
        rows = torch.randint(0, len(images), (batch,), generator=order)
        train_step(
            model, optimizer, scheduler, images[rows], tokens[rows], cfg.objective, grad_clip=1.0, generator=generator
        )
    return model.eval(), cfg


def timed(write, count: int, batch: int, repeats: int) -> tuple[float, list]:
    """Median seconds to caption images 0..count in batches of `batch` (`write(i, j)` captions
    images i..j; one warm-up pass untimed), and the tokens of the last pass."""
    write(0, batch)
    times = []
    for _ in range(repeats):
        tic, out = time.perf_counter(), [write(i, min(i + batch, count)) for i in range(0, count, batch)]
        times.append(time.perf_counter() - tic)
    return statistics.median(times), out


def measure(name: str, write, count: int, references, tokenizer, args) -> dict:
    seconds, tokens = timed(write, count, 32, args.repeats)
    captions = [c for batch in tokens for c in tokenizer.decode(batch)]
    latency, _ = timed(write, args.latency_images, 1, args.repeats)
    row = {
        "setting": name,
        **caption_metrics(dict(enumerate(captions)), references),
        "captions_per_s_b32": count / seconds,
        "s_per_caption_b1": latency / args.latency_images,
        "example": captions[0],
    }
    print(
        f"{name:>28}: CIDEr-D {row['cider']:.3f}  BLEU-4 {row['bleu4']:.3f}  "
        f"{row['captions_per_s_b32']:7.1f} captions/s (B=32)  {1000 * row['s_per_caption_b1']:6.1f} ms/caption (B=1)"
    )
    return row


def verdict(rows: list[dict], group: str, tolerance: float) -> dict:
    """The fastest MDC setting (B = 32) of a length `group` within `tolerance` CIDEr-D of that
    group's full-step setting (its first row), against AR."""
    mine, ar = [r for r in rows if r["group"] == group], next(r for r in rows if r["group"] == "ar")
    full = mine[0]
    best = max((r for r in mine if r["cider"] >= full["cider"] - tolerance), key=lambda r: r["captions_per_s_b32"])
    return {
        "full_step_cider": full["cider"],
        "fastest_within_tolerance": best["setting"],
        "its_cider": best["cider"],
        "speedup_over_full_steps_b32": best["captions_per_s_b32"] / full["captions_per_s_b32"],
        "mdc_over_ar_b32": best["captions_per_s_b32"] / ar["captions_per_s_b32"],
        "mdc_latency_over_ar_b1": best["s_per_caption_b1"] / ar["s_per_caption_b1"],
        "ar_cider": ar["cider"],
    }


def verdict_line(group: str, v: dict, tolerance: float) -> str:
    return (
        f"{group}: fastest MDC within {tolerance} CIDEr-D of its full steps ({v['full_step_cider']:.3f}): "
        f"{v['fastest_within_tolerance']} (CIDEr-D {v['its_cider']:.3f}), {v['speedup_over_full_steps_b32']:.2f}× "
        f"full steps' captions/s; against AR (CIDEr-D {v['ar_cider']:.3f}): {v['mdc_over_ar_b32']:.2f}× its "
        f"captions/s at B=32, {v['mdc_latency_over_ar_b1']:.2f}× its latency at B=1"
    )


def draw(rows: list[dict], path: Path, length: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        ar = row["group"] == "ar"
        ax.scatter(row["captions_per_s_b32"], row["cider"], marker="s" if ar else "o", c="C3" if ar else "C0")
        ax.annotate(
            row["setting"],
            (row["captions_per_s_b32"], row["cider"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel("captions per second, B = 32 (log)")
    ax.set_ylabel("CIDEr-D")
    ax.set_title(f"MDC decoding settings (N' = {length}) and AR greedy, same data and model size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    lines = ["| setting | CIDEr-D | BLEU-4 | captions/s (B=32) | ms/caption (B=1) |", "| --- | --- | --- | --- | --- |"]
    lines += [
        f"| {r['setting']} | {r['cider']:.3f} | {r['bleu4']:.3f} | {r['captions_per_s_b32']:.1f} | "
        f"{1000 * r['s_per_caption_b1']:.1f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-images", type=int, default=2000)
    parser.add_argument("--eval-images", type=int, default=128)
    parser.add_argument("--latency-images", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300, help="training steps of each model")
    parser.add_argument("--batch", type=int, default=64, help="training batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="threads while decoding (training uses all)")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("runs/caption-speed"))
    args = parser.parse_args()
    tokenizer = CaptionTokenizer(MAX_LENGTH)
    train_set, held_out = (
        generate_shapes(args.train_images, 0, IMAGE_SIZE),
        generate_shapes(args.eval_images, 1, IMAGE_SIZE),
    )
    images = preprocess([r.image for r in train_set], IMAGE_SIZE)
    tokens = torch.from_numpy(tokenizer.encode([r.caption for r in train_set]))
    eval_images = preprocess([r.image for r in held_out], IMAGE_SIZE)
    references = {i: [r.caption] for i, r in enumerate(held_out)}
    lengths = (torch.from_numpy(tokenizer.encode([r.caption for r in held_out])) != tokenizer.pad_id).sum(1)
    length = int(lengths.median())  # N' for MDC: the held-out captions' median length
    tic = time.perf_counter()
    trained = {name: train(name, images, tokens, args.steps, args.batch) for name in ("mdc", "ar")}
    print(f"trained MDC and AR, {args.steps} steps each, in {time.perf_counter() - tic:.0f} s; N' = {length}")
    for name, (model, cfg) in trained.items():  # the pair, for `mdc eval captions --checkpoint`
        export_weights(args.out / "checkpoints" / name, model.state_dict(), dump_config(cfg))
    models = {name: model for name, (model, _) in trained.items()}
    mdc, ar, count = models["mdc"], models["ar"], len(held_out)
    fixed = f"fixed N' = {length}"
    runs = [
        (fixed, d.label(), lambda i, j, d=d: write_captions(mdc, eval_images[i:j], "mdc", length, d))
        for d in settings(length)
    ]
    runs += [  # the length head's N' per image: full steps, then thresholds
        (
            "predicted N'",
            f"predicted N', {d.label()}",
            lambda i, j, d=d: write_captions(mdc, eval_images[i:j], "mdc", None, d),
        )
        for d in (Decoding(), *(Decoding(threshold=p) for p in (0.9, 0.7, 0.5)))
    ]
    runs += [
        ("oracle", "reference N' (oracle)", lambda i, j: write_captions(mdc, eval_images[i:j], "mdc", lengths[i:j])),
        ("ar", AR, lambda i, j: write_captions(ar, eval_images[i:j], "ar", MAX_LENGTH)),
    ]
    torch.set_num_threads(args.threads)  # training used every core; decoding is timed on these
    with torch.no_grad():
        rows = [
            {**measure(name, write, count, references, tokenizer, args), "group": group} for group, name, write in runs
        ]
    summary = {group: verdict(rows, group, args.tolerance) for group in (fixed, "predicted N'")}
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"length": length, "threads": args.threads, "steps": args.steps, "rows": rows, "summary": summary}
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    (args.out / "table.md").write_text(table(rows))
    draw(rows, args.out / "caption_speed.png", length)
    for group, v in summary.items():
        print(verdict_line(group, v, args.tolerance))
    print(f"wrote {args.out}/result.json, table.md, caption_speed.png")


if __name__ == "__main__":
    main()
