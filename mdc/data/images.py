"""Image decoding and the encoder's input transform (CLIP-style resize, centre crop, normalise)."""

from __future__ import annotations

import functools
import io

import numpy as np
import torch
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
WHITE = (255, 255, 255)


def decode_image(data: bytes) -> Image.Image:
    """Decode encoded bytes to an RGB image; transparent pixels become white (not black).

    Raises ValueError for anything PIL cannot fully decode (truncated, corrupt, not an image)."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # PIL raises OSError, SyntaxError, struct.error, ... for bad data
        raise ValueError(f"undecodable image ({len(data)} bytes): {e}") from e
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, WHITE + (255,))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    return img.convert("RGB")


class ImageTransform:
    """PIL image -> float32 array (3, S, S): shorter side to S (bicubic), centre crop, CLIP normalise.

    Same pixels as torchvision Resize(S, BICUBIC) + CenterCrop(S) up to sub-pixel rounding of the crop.
    `pixels` stops before normalising: uint8, a quarter of the bytes, for ingest to ship to training."""

    def __init__(self, image_size: int):
        self.image_size = image_size

    def pixels(self, img: Image.Image) -> np.ndarray:
        s = self.image_size
        w, h = img.size
        side = min(w, h)  # the centre square, in source pixels, that becomes the S x S crop
        left, top = (w - side) / 2, (h - side) / 2
        # resizing only the cropped box never builds a huge intermediate for extreme aspect ratios
        img = img.convert("RGB").resize((s, s), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
        return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)

    def __call__(self, img: Image.Image) -> np.ndarray:
        return normalize(self.pixels(img)[None])[0]


def normalize(pixels: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """uint8 (N, 3, S, S) -> float32 CLIP-normalised, as numpy or (on its device) torch."""
    if isinstance(pixels, torch.Tensor):
        mean, std = _constants(pixels.device)
        return (pixels.float() / 255.0 - mean) / std
    mean = np.asarray(CLIP_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(CLIP_STD, dtype=np.float32).reshape(1, 3, 1, 1)
    return (pixels.astype(np.float32) / 255.0 - mean) / std


@functools.lru_cache(maxsize=8)
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP's mean and std, copied to `device` once rather than at every batch."""
    return tuple(torch.tensor(c, device=device).view(1, 3, 1, 1) for c in (CLIP_MEAN, CLIP_STD))


def preprocess_batch(images: list[bytes], image_size: int, normalized: bool = True) -> tuple[np.ndarray, list[bool]]:
    """Decode and transform a batch (float32 normalised, or uint8 pixels with normalized=False); a
    bad image gives zeros and ok=False instead of an exception, so that one broken record never
    stops a training run (the caller drops and counts it)."""
    transform = ImageTransform(image_size)
    out = np.zeros((len(images), 3, image_size, image_size), dtype=np.uint8)
    ok = []
    for i, data in enumerate(images):
        try:
            out[i] = transform.pixels(decode_image(data))
            ok.append(True)
        except ValueError:
            ok.append(False)
    if not normalized:
        return out, ok
    batch = normalize(out)
    batch[~np.asarray(ok, dtype=bool)] = 0.0  # a bad image stays all zeros
    return batch, ok
