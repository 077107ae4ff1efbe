"""Zero-shot classification by caption scoring (CapPa's scoring classifier).

Every class name is written into one or more templates ("a photo of a {}."); the image's class is the
one whose captions the model finds most likely, log p(caption | image) estimated by the model's
scorer (exact for autoregressive models, ELBO or pseudo-log-likelihood for masked diffusion). With
several templates the class score is log-mean-exp over them (the mixture of the prompts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from mdc.data.shapes import COLOURS, SIZES
from mdc.evaluation.compositionality import ScoreFn
from mdc.evaluation.probe import preprocess
from mdc.evaluation.readers import Split

DEFAULT_TEMPLATES = ("a photo of a {}.",)
# The shapes captions start "a SIZE COLOUR SHAPE"; a class is scored as any size and colour of it.
SHAPES_TEMPLATES = tuple(f"a {size} {colour} {{}}" for size in SIZES for colour in COLOURS)


def templates_for(dataset: str) -> tuple[str, ...]:
    return SHAPES_TEMPLATES if dataset == "shapes" else DEFAULT_TEMPLATES


@torch.no_grad()
def zeroshot_classify(
    model,
    split: Split,
    score: ScoreFn,
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    samples: int = 16,
    batch_size: int = 32,
    seed: int = 0,
    limit: int | None = None,
) -> dict:
    """Top-1 accuracy of picking the class whose templated captions score highest."""
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    prompts = [template.format(name) for name in split.class_names for template in templates]
    n = min(len(split), limit) if limit else len(split)
    predictions = []
    for i in range(0, n, batch_size):
        images = preprocess(split.sources[i : min(i + batch_size, n)], model.image_size).to(device)
        texts = [[prompt] * len(images) for prompt in prompts]
        scores = score(model, images, texts, samples=samples, generator=generator)  # (B, classes × templates)
        per_class = scores.view(len(images), len(split.class_names), len(templates))
        per_class = per_class.logsumexp(dim=2) - math.log(len(templates))
        predictions.append(per_class.argmax(dim=1).cpu().numpy())
    predicted = np.concatenate(predictions) if predictions else np.zeros(0, np.int64)
    return {
        "accuracy": float((predicted == split.labels[:n]).mean()) if n else float("nan"),
        "num_test": int(n),
        "templates": list(templates),
    }
