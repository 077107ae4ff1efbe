"""Ingest throughput: the Ray Data pipeline (read → parse → decode+resize → tokenize, streamed)
against a plain single-process loop over the same shards. Reported as images/s and their ratio.

    python -m benchmarks.ingest [--num 4000] [--image-size 224] [--actors 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import ray

from mdc import shards
from mdc.datasets.shapes import write_shapes_dataset
from mdc.images import preprocess_batch
from mdc.tokenizer import CaptionTokenizer
from pipelines.ingest import build_dataset
from pipelines.runtime import connect_ray


def plain_loop(uri: str, image_size: int, max_length: int, batch: int = 64) -> int:
    tokenizer = CaptionTokenizer(max_length)
    pending, count = [], 0

    def flush():
        images, ok = preprocess_batch([s.image for s in pending], image_size)
        tokenizer.encode([s.caption for s, good in zip(pending, ok) if good])
        return int(np.sum(ok))

    for sample in shards.read_shards(uri):
        pending.append(sample)
        if len(pending) == batch:
            count += flush()
            pending = []
    return count + (flush() if pending else 0)


def ray_pipeline(uri: str, image_size: int, max_length: int, actors: int, cpus: float) -> int:
    ds = build_dataset(uri, image_size, max_length, tokenizer_actors=actors, cpus=cpus)
    return sum(len(b["tokens"]) for b in ds.iter_batches(batch_size=64, batch_format="numpy"))


def timed(fn, *args) -> tuple[int, float]:
    start = time.perf_counter()
    n = fn(*args)
    return n, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=4000)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--cpus", type=float, default=0.25, help="logical CPUs per ingest task/actor "
                        "(the pipeline's default; actors × cpus must leave room for the read tasks)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        write_shapes_dataset(root, num=args.num, seed=0, val_fraction=0.0, samples_per_shard=250)
        uri = f"{root}/train"
        n_plain, t_plain = timed(plain_loop, uri, args.image_size, 32)
        connect_ray()
        ray_pipeline(uri, args.image_size, 32, args.actors, args.cpus)  # warm: workers, tokenizer
        n_ray, t_ray = timed(ray_pipeline, uri, args.image_size, 32, args.actors, args.cpus)
        ray.shutdown()
    result = {"images": n_plain, "image_size": args.image_size, "plain_images_per_s": n_plain / t_plain,
              "ray_images_per_s": n_ray / t_ray, "ratio_ray_over_plain": (n_ray / t_ray) / (n_plain / t_plain),
              "ray_actors": args.actors}
    assert n_plain == n_ray, (n_plain, n_ray)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
