"""Linear probe (docs/design.md §9): freeze the encoder, pool its output, fit a logistic regression.

Features are the model's `encode_image` (mean of the normalised patch features), standardised with
the training split's statistics. The inverse regularisation C is chosen on a held-out part of the
training split, then the classifier is refitted on the whole training split and scored on the test
split (top-1). Features can be cached on disk, keyed by the checkpoint's content and the split.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from mdc.data.images import ImageTransform
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation.readers import ImageSource, Split, load_image, read_split
from mdc.registry import build_model

DEFAULT_CS = tuple(np.logspace(-3, 2, 6))  # 1e-3 .. 1e2
# Newton's method while its Hessian, (features x classes)^2, is small: exact in a few steps where lbfgs
# crawls (pooled ViT features are near collinear; at random init lbfgs stopped at 1,000 iterations for
# C >= 10, 0.59 instead of 0.65 validation accuracy at C = 100). Beyond it, lbfgs.
NEWTON_MAX_COEFFICIENTS = 1024


def preprocess(sources: Sequence[ImageSource], image_size: int) -> torch.Tensor:
    """(B, 3, S, S) encoder inputs: the same resize, crop and normalisation as training."""
    transform = ImageTransform(image_size)
    return torch.from_numpy(np.stack([transform(load_image(s)) for s in sources]))


@torch.no_grad()
def extract_features(model, sources: Sequence[ImageSource], batch_size: int = 128) -> np.ndarray:
    """(N, D) float32 pooled features, computed a batch at a time in this process."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(sources), batch_size):
        images = preprocess(sources[i : i + batch_size], model.image_size).to(device)
        out.append(model.encode_image(images).float().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, model.dim), np.float32)


def fit_probe(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    cs: Sequence[float] = DEFAULT_CS,
    val_fraction: float = 0.2,
    seed: int = 0,
    max_iter: int = 1000,
) -> dict:
    """Top-1 test accuracy (and balanced accuracy) of a logistic regression whose C is chosen on a
    held-out part of train."""
    # Newton's Cholesky in float32 refuses a Hessian whose reciprocal condition is under float32's
    # epsilon (it falls back to lbfgs): the standardised features are float64 for it
    newton = train_x.shape[1] * len(np.unique(train_y)) <= NEWTON_MAX_COEFFICIENTS
    if newton:
        train_x, test_x = train_x.astype(np.float64), test_x.astype(np.float64)
    solver = "newton-cholesky" if newton else "lbfgs"
    scaler = StandardScaler().fit(train_x)
    train_x, test_x = scaler.transform(train_x), scaler.transform(test_x)
    counts = np.bincount(train_y)
    stratify = train_y if counts[counts > 0].min() >= 2 else None
    fit_x, val_x, fit_y, val_y = train_test_split(
        train_x, train_y, test_size=val_fraction, random_state=seed, stratify=stratify
    )

    unconverged = []

    def fitted(c: float, x: np.ndarray, y: np.ndarray) -> LogisticRegression:
        """A fit that stops at max_iter (weak regularisation of nearly separable features) is
        recorded in the result instead of a warning printed per fit."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            classifier = LogisticRegression(C=c, solver=solver, max_iter=max_iter, random_state=seed).fit(x, y)
        if any(issubclass(w.category, ConvergenceWarning) for w in caught):
            unconverged.append(float(c))
        return classifier

    val_accuracy = {float(c): float(fitted(c, fit_x, fit_y).score(val_x, val_y)) for c in cs}
    best = max(val_accuracy, key=val_accuracy.get)  # the first (strongest regularisation) on ties
    predicted = fitted(best, train_x, train_y).predict(test_x)
    return {
        "accuracy": float(np.mean(predicted == test_y)),
        "balanced_accuracy": balanced_accuracy(test_y, predicted),
        "best_c": best,
        "val_accuracy": val_accuracy,
        "num_train": int(len(train_y)),
        "num_test": int(len(test_y)),
        "unconverged_c": sorted(set(unconverged)),
    }


def balanced_accuracy(labels: np.ndarray, predicted: np.ndarray) -> float:
    """The mean over the test set's classes of each class's recall: a probe that answers the
    largest class everywhere scores 1/classes, whatever that class's share of the test set."""
    return float(np.mean([np.mean(predicted[labels == c] == c) for c in np.unique(labels)]))


def linear_probe(train: Split, test: Split, features: Callable[[Split], np.ndarray], **fit_options) -> dict:
    """Probe result for one dataset; `features(split)` gives its (N, D) features (cached, Ray, ...)."""
    result = fit_probe(features(train), train.labels, features(test), test.labels, **fit_options)
    return {"dataset": train.name.split("/")[0], "num_classes": len(train.class_names), **result}


def random_init(cfg, seed: int = 0):
    """The same architecture with fresh random weights from `seed`: the baseline a probe must beat."""
    return build_model(cfg, CaptionTokenizer, seed=seed).eval()


def probe_shapes(model, data_uri: str, endpoint_url: str | None = None, baseline=None, batch_size: int = 128) -> dict:
    """Probe on a shapes (or tuxpaint) shard dataset: fit on train/, test on val/. With a
    `baseline` model (e.g. `random_init(cfg)`) also reports its accuracy as random_init_accuracy."""
    train, test = (read_split("shapes", data_uri, s, endpoint_url) for s in ("train", "test"))
    result = linear_probe(train, test, lambda split: extract_features(model, split.sources, batch_size))
    if baseline is not None:
        base = linear_probe(train, test, lambda split: extract_features(baseline, split.sources, batch_size))
        result["random_init_accuracy"] = base["accuracy"]
    return result


def file_fingerprint(path: str | Path) -> str:
    """A short content hash: the cache key of a checkpoint's features (copies share it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def cached_features(
    cache_dir: str | Path | None, model_key: str, split: Split, root: str, compute: Callable[[], np.ndarray]
) -> np.ndarray:
    """Features from CACHE/MODEL_KEY/DATASET-SPLIT-ROOTHASH.npy, computed and stored if absent."""
    if cache_dir is None:
        return compute()
    root_hash = hashlib.sha256(str(root).encode()).hexdigest()[:8]
    path = Path(cache_dir) / model_key / f"{split.name.replace('/', '-')}-{root_hash}.npy"
    if path.is_file():
        features = np.load(path)
        if len(features) == len(split):
            return features
    features = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial.npy")
    np.save(tmp, features)
    tmp.replace(path)
    return features
