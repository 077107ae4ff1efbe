"""Training-time image augmentation on the worker's uint8 batch: random resized crop, optional flip.

Applied after ingest (which ships fixed centre crops) and before normalising, so it costs no data
pipeline change and runs on the training device. Crops follow torchvision's RandomResizedCrop
(area scale, log-uniform aspect ratio, 10 tries then the centre crop) but draw from an explicit
generator: a resumed run augments its steps as the uninterrupted run would have. Flipping is a
separate choice because it changes what a caption says of "left" and "right" (the shapes data).
"""

from __future__ import annotations

import math

import torch
from torchvision.transforms.v2 import functional as TF

SCALE = (0.5, 1.0)  # share of the image's area a crop keeps
RATIO = (3 / 4, 4 / 3)


def crop_box(size: int, generator: torch.Generator, scale=SCALE, ratio=RATIO) -> tuple[int, int, int, int]:
    """(top, left, height, width) of one random crop of a size × size image."""
    area = size * size
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        u = torch.rand(2, generator=generator).tolist()
        target = area * (scale[0] + (scale[1] - scale[0]) * u[0])
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[1])
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= size and 0 < h <= size:
            top = int(torch.randint(0, size - h + 1, (1,), generator=generator))
            left = int(torch.randint(0, size - w + 1, (1,), generator=generator))
            return top, left, h, w
    return 0, 0, size, size


def augment(images: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """uint8 (B, 3, S, S) → uint8 (B, 3, S, S): each image cropped and resized back to S (bilinear,
    antialiased), with `kind == "crop_flip"` also mirrored with probability 1/2. `kind == "none"`
    returns the batch unchanged. `generator` is a CPU generator."""
    if kind == "none":
        return images
    if kind not in ("crop", "crop_flip"):
        raise ValueError(f"augment kind must be none, crop or crop_flip, got {kind!r}")
    size = images.shape[-1]
    out = torch.empty_like(images)
    for i, image in enumerate(images):
        top, left, h, w = crop_box(size, generator)
        image = TF.resized_crop(image, top, left, h, w, [size, size], antialias=True)
        if kind == "crop_flip" and bool(torch.rand(1, generator=generator) < 0.5):
            image = TF.horizontal_flip(image)
        out[i] = image
    return out
