"""Probe features by Ray Data batch inference: an actor pool in which each actor holds one frozen copy
of the model, for datasets of at least `ray_threshold` images; smaller ones in a plain loop in this
process. The `mdc eval` commands that use it are in pipelines/cli/evaluate.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import ray

from mdc.evaluation import probe, readers
from mdc.training.checkpoint import load_pretrained
from pipelines.infra.ray_connection import connect_ray


class FeatureActor:
    """Ray Data actor: builds the frozen model once, then pools features for each batch."""

    def __init__(self, make_model: Callable):
        self.model = make_model()

    def __call__(self, batch: dict) -> dict:
        return {
            "index": batch["index"],
            "feature": probe.extract_features(self.model, list(batch["source"]), len(batch["index"])),
        }


def extract_features_ray(
    make_model: Callable, sources, batch_size: int = 64, num_actors: int = 1, num_cpus: float = 0.5, num_gpus: float = 0
) -> np.ndarray:
    """(N, D) features of `sources` (paths, bytes or arrays), computed by an actor pool on the
    current Ray cluster. `make_model` must pickle (e.g. a functools.partial of a loader)."""
    items = ray.data.from_items([{"index": i, "source": s} for i, s in enumerate(sources)])
    out = items.map_batches(
        FeatureActor,
        fn_constructor_args=(make_model,),
        batch_size=batch_size,
        batch_format="numpy",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        compute=ray.data.ActorPoolStrategy(size=num_actors),
    )
    features = None
    for batch in out.iter_batches(batch_format="numpy"):
        if features is None:
            features = np.zeros((len(sources), batch["feature"].shape[1]), np.float32)
        features[batch["index"]] = batch["feature"]
    return features


def checkpoint_model(directory: str, device: str = "cpu"):
    """A picklable model factory for inference actors."""
    return load_pretrained(directory, device)[0]


def random_init_model(cfg, device: str = "cpu", seed: int = 0):
    """A picklable factory of the random-init baseline."""
    return probe.random_init(cfg, seed=seed).to(device)


class Extractor:
    """Where features come from: this process below `ray_threshold` images, else a Ray actor pool;
    cached under `cache_dir` by `model_key` (the checkpoint's content hash) when one is given."""

    def __init__(
        self,
        model,
        make_model,
        model_key: str,
        root: str,
        batch_size: int = 128,
        ray_threshold: int = 20_000,
        num_actors: int = 1,
        address: str | None = None,
        cache_dir: Path | None = None,
        num_gpus: float = 0,
    ):
        self.model, self.make_model, self.model_key, self.root = model, make_model, model_key, root
        self.batch_size, self.ray_threshold, self.num_actors = batch_size, ray_threshold, num_actors
        self.address, self.cache_dir, self.num_gpus = address, cache_dir, num_gpus

    def __call__(self, split: readers.Split) -> np.ndarray:
        def compute() -> np.ndarray:
            if len(split) < self.ray_threshold:
                return probe.extract_features(self.model, split.sources, self.batch_size)
            connect_ray(self.address)
            return extract_features_ray(
                self.make_model, split.sources, self.batch_size, self.num_actors, num_gpus=self.num_gpus
            )

        return probe.cached_features(self.cache_dir, self.model_key, split, self.root, compute)
