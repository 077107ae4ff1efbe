"""Training-time image augmentation on the worker's uint8 batch: random resized crop, optional flip.

Applied after ingest (which ships fixed centre crops) and before normalising, so it costs no data
pipeline change and runs on the training device. Crop boxes are torchvision's RandomResizedCrop
boxes, drawn from a seed of their own (mdc/seeding.py): a resumed run augments its steps as the
uninterrupted run would have, whatever else draws random numbers meanwhile. Flipping is a
separate choice because it changes what a caption says of "left" and "right" (the shapes data).
"""

from __future__ import annotations

import torch
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as TF

from mdc.seeding import drawing_from

SCALE = (0.5, 1.0)  # share of the image's area a crop keeps
RATIO = (3 / 4, 4 / 3)


def draws(num: int, size: int, seed: int) -> list[tuple[tuple[int, int, int, int], bool]]:
    """Each of `num` images' crop box (top, left, height, width) of a size × size image and whether
    it is mirrored (probability 1/2), from `seed` alone."""
    shape = torch.empty(1, size, size)  # get_params reads only the size
    with drawing_from(seed):
        return [
            (tuple(RandomResizedCrop.get_params(shape, list(SCALE), list(RATIO))), bool(torch.rand(()) < 0.5))
            for _ in range(num)
        ]


def augment(images: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    """uint8 (B, 3, S, S) → uint8 (B, 3, S, S): each image cropped and resized back to S (bilinear,
    antialiased), with `kind == "crop_flip"` also mirrored when its draw says so. `kind == "none"`
    returns the batch unchanged."""
    if kind == "none":
        return images
    if kind not in ("crop", "crop_flip"):
        raise ValueError(f"augment kind must be none, crop or crop_flip, got {kind!r}")
    size = images.shape[-1]
    out = torch.empty_like(images)
    for i, (image, ((top, left, h, w), flip)) in enumerate(zip(images, draws(len(images), size, seed))):
        image = TF.resized_crop(image, top, left, h, w, [size, size], antialias=True)
        out[i] = TF.horizontal_flip(image) if kind == "crop_flip" and flip else image
    return out
