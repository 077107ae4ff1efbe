"""Ingest benchmarks on img2dataset-style shards of 256-px JPEGs (its `keep_ratio` output), decoded,
resized and cropped to 224 (uint8; training normalises on its device) and tokenized, as training
consumes them.

Speed: the Ray Data pipeline (every CPU of the local Ray) against a plain single-process loop over
the same shards, as images/s, their ratio and the ratio per Ray CPU; and the pipeline as training
reads it — one order whatever the readers (order preserved, seeded shard order and row windows,
blocks of one micro-batch) — against the same pipeline unordered: what the deterministic order costs.
Where that cost lies: the order alone (order preserved, seeded shards and windows, the reader's own
blocks) and the unordered pipeline with one more stage that passes its blocks on unchanged (as the
micro-batch blocking stage adds one). Every variant runs `--repeats` times, interleaved, and the
medians are compared: on 2 cores one run's img/s varies by up to 2x.
Memory (`--memory`): the peak of the summed proportional set size (PSS) of this driver and every
Ray process while the pipeline streams the same samples written as many small shards and as a
few large ones; the ratio says whether memory depends on shard size. Ray's own baseline (the
processes started and idle) is reported beside the peaks.

    python -m benchmarks.ingest [--num 2000] [--shards 4] [--repeats 3]
    python -m benchmarks.ingest --memory [--num 8000] [--shards 8,2]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import threading
import time

import numpy as np
import ray

from mdc.data import shards
from mdc.data.images import preprocess_batch
from mdc.data.img2dataset import generated_rows, write_img2dataset_folder
from mdc.data.tokenizer import CaptionTokenizer
from pipelines.data.ingest import build_dataset, ingest_resources

IMAGE_SIZE, SOURCE_SIZE, MAX_LENGTH, BATCH = 224, 256, 32, 64


def write_folder(root: str, num: int, num_shards: int) -> str:
    out = os.path.join(root, f"{num_shards}-shards")
    write_img2dataset_folder(
        generated_rows(num, SOURCE_SIZE, failed_every=0), out, "webdataset", samples_per_shard=-(-num // num_shards)
    )
    return out


def plain_loop(uri: str) -> int:
    tokenizer = CaptionTokenizer(MAX_LENGTH)
    pending, count = [], 0

    def flush() -> int:
        images, ok = preprocess_batch([s.image for s in pending], IMAGE_SIZE, normalized=False)
        tokenizer.encode([s.caption for s, good in zip(pending, ok) if good])
        return int(np.sum(ok))

    for sample in shards.read_shards(uri):
        pending.append(sample)
        if len(pending) == BATCH:
            count += flush()
            pending = []
    return count + (flush() if pending else 0)


def _unchanged(batch: dict) -> dict:
    return batch


def ray_pipeline(uri: str, variant: str = "unordered") -> int:
    """Images through the pipeline. `in_order`: as training reads it (pipelines/data/ingest.py), order
    preserved, shards and row windows seeded, blocks of one micro-batch (BATCH rows); `order_only`:
    the same without the micro-batch blocks; `one_more_stage`: unordered, then a stage that passes
    each block on unchanged (no CPU, one task at a time, as the blocking stage runs)."""
    ordered = variant in ("in_order", "order_only")
    ds = build_dataset(
        uri,
        IMAGE_SIZE,
        MAX_LENGTH,
        shuffle_seed=0 if ordered else None,
        shuffle_window=256 if ordered else 0,
        rows_per_block=BATCH if variant == "in_order" else None,
    )
    if variant == "one_more_stage":
        ds = ds.map_batches(_unchanged, batch_size=None, num_cpus=0, compute=ray.data.TaskPoolStrategy(size=1))
    ds.context.execution_options.preserve_order = ordered
    return sum(len(b["tokens"]) for b in ds.iter_batches(batch_size=BATCH, batch_format="numpy"))


def timed(fn, *args) -> tuple[int, float]:
    start = time.perf_counter()
    n = fn(*args)
    return n, time.perf_counter() - start


def _descendants(root: int) -> list[int]:
    """`root` and every process below it (the local Ray's raylet, GCS and workers), from /proc."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found


def pss_gib() -> float:
    """Summed proportional set size of this process and its descendants (Linux smaps_rollup)."""
    total_kib = 0
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total_kib += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total_kib / 1024**2


def peak_pss_while(fn, *args, every_s: float = 0.25) -> tuple[float, object]:
    peak, done = [pss_gib()], threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak.append(pss_gib())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn(*args)
    finally:
        done.set()
        thread.join()
    return max(peak), result


VARIANTS = ("unordered", "in_order", "order_only", "one_more_stage")


def speed(args) -> dict:
    rates: dict[str, list[float]] = {name: [] for name in ("plain", *VARIANTS)}
    with tempfile.TemporaryDirectory() as root:
        uri = write_folder(root, args.num, int(args.shards))
        plain_loop(uri)  # warm alike: imports, tokenizer, page cache
        ray.init(object_store_memory=512 * 1024**2)
        ray_pipeline(uri)  # warm: workers, tokenizer
        for _ in range(args.repeats):
            n, seconds = timed(plain_loop, uri)
            rates["plain"].append(n / seconds)
            for variant in VARIANTS:
                m, seconds = timed(ray_pipeline, uri, variant)
                assert m == n, (variant, m, n)
                rates[variant].append(m / seconds)
        cpus = ingest_resources(ray.cluster_resources()["CPU"], 0.0).budget
        ray.shutdown()
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = median["unordered"] / median["plain"]
    return {
        "images": n,
        "source_px": SOURCE_SIZE,
        "image_size": IMAGE_SIZE,
        "repeats": args.repeats,
        "ray_cpus": cpus,
        "plain_images_per_s": median["plain"],
        "ray_images_per_s": median["unordered"],
        "ratio_ray_over_plain": ratio,
        "ray_per_cpu_over_plain": ratio / cpus,
        "ray_in_order_images_per_s": median["in_order"],
        "in_order_over_unordered": median["in_order"] / median["unordered"],
        "in_order_over_plain": median["in_order"] / median["plain"],
        "order_only_over_unordered": median["order_only"] / median["unordered"],
        "one_more_stage_over_unordered": median["one_more_stage"] / median["unordered"],
        "images_per_s_each_run": {name: [round(v) for v in values] for name, values in rates.items()},
    }


def memory(args) -> dict:
    counts = [int(c) for c in args.shards.split(",")]
    result = {"images": args.num, "source_px": SOURCE_SIZE, "image_size": IMAGE_SIZE}
    with tempfile.TemporaryDirectory() as root:
        uris = {c: write_folder(root, args.num, c) for c in counts}
        ray.init(object_store_memory=512 * 1024**2)
        ray_pipeline(uris[counts[0]])  # warm, then measure Ray's idle baseline
        time.sleep(2)
        result["ray_baseline_gib"] = pss_gib()
        for c in counts:
            peak, n = peak_pss_while(ray_pipeline, uris[c])
            assert n == args.num, (c, n)
            result[f"peak_gib_{c}_shards_of_{-(-args.num // c)}"] = peak
        ray.shutdown()
    peaks = [v for k, v in result.items() if k.startswith("peak_gib")]
    result["peak_ratio_few_large_over_many_small"] = peaks[-1] / peaks[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=2000, help="samples")
    parser.add_argument(
        "--shards", default=None, help="shard count (speed, default 4) or counts to compare (--memory, default 8,2)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each speed variant, interleaved (medians)")
    parser.add_argument("--memory", action="store_true", help="peak PSS by shard size instead of speed")
    args = parser.parse_args()
    args.shards = args.shards or ("8,2" if args.memory else "4")
    result = memory(args) if args.memory else speed(args)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
