"""Training-time crops and flips (mdc/data/augment.py): boxes as specified, pixels as torchvision's
resized_crop gives them, flips at rate 1/2, the same draws from the same seed."""

import math

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from mdc.data.augment import RATIO, SCALE, augment, draws
from pipelines.data.seeds import augment_seed as _augment_seed


def test_crop_boxes_lie_inside_with_the_area_and_aspect_asked_for():
    for (top, left, h, w), _ in draws(500, 32, seed=0):
        assert 0 <= top and top + h <= 32 and 0 <= left and left + w <= 32
        # rounding w and h to pixels moves the area and aspect by at most half a pixel per side
        assert SCALE[0] * 32 * 32 - (h + w) <= h * w <= SCALE[1] * 32 * 32
        assert RATIO[0] * (h - 0.5) / (h + 0.5) <= w / h <= RATIO[1] * (h + 0.5) / (h - 0.5)


def test_none_is_the_batch_itself_and_crop_is_resized_crop_of_the_drawn_box():
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    assert augment(images, "none", 0) is images
    out = augment(images, "crop", 3)
    for image, got, ((top, left, h, w), _) in zip(images, out, draws(4, 16, seed=3)):
        assert torch.equal(got, TF.resized_crop(image, top, left, h, w, [16, 16], antialias=True))
    assert out.dtype == torch.uint8 and out.shape == images.shape


def test_crop_flip_mirrors_half_the_images():
    """Left half black, right half white: a mirrored crop is brighter on its left. Over n = 400
    images the share mirrored is 1/2 within 4 standard errors (sqrt(1/4n) = 0.025)."""
    images = torch.zeros(400, 3, 16, 16, dtype=torch.uint8)
    images[..., 8:] = 255
    out = augment(images, "crop_flip", 0).float()
    mirrored = (out[..., :8].mean(dim=(1, 2, 3)) > out[..., 8:].mean(dim=(1, 2, 3))).float().mean()
    assert abs(float(mirrored) - 0.5) < 4 * math.sqrt(0.25 / 400)
    unflipped = augment(images, "crop", 0).float()
    assert bool((unflipped[..., :8].mean(dim=(1, 2, 3)) <= unflipped[..., 8:].mean(dim=(1, 2, 3))).all())


def test_a_step_crops_the_same_on_resume_and_differently_from_the_next_step():
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    augment(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), "crop_flip", 7)
    assert torch.equal(torch.rand(1), before)  # training's own random draws are untouched
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    first = augment(images, "crop_flip", _augment_seed(seed=1, step=5, chunk=0))
    assert torch.equal(first, augment(images, "crop_flip", _augment_seed(seed=1, step=5, chunk=0)))
    assert not torch.equal(first, augment(images, "crop_flip", _augment_seed(seed=1, step=6, chunk=0)))
    assert not torch.equal(first, augment(images, "crop_flip", _augment_seed(seed=1, step=5, chunk=1)))


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="'rotate'"):
        augment(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), "rotate", 0)
