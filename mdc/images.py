"""Image decoding and the encoder's input transform (CLIP-style resize, centre crop, normalise)."""

from __future__ import annotations

import io

import numpy as np
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

    Same pixels as torchvision Resize(S, BICUBIC) + CenterCrop(S) up to sub-pixel rounding of the crop."""

    def __init__(self, image_size: int):
        self.image_size = image_size
        self.mean = np.asarray(CLIP_MEAN, dtype=np.float32)
        self.std = np.asarray(CLIP_STD, dtype=np.float32)

    def __call__(self, img: Image.Image) -> np.ndarray:
        s = self.image_size
        w, h = img.size
        side = min(w, h)  # the centre square, in source pixels, that becomes the S x S crop
        left, top = (w - side) / 2, (h - side) / 2
        # resizing only the cropped box never builds a huge intermediate for extreme aspect ratios
        img = img.convert("RGB").resize((s, s), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
        x = np.asarray(img, dtype=np.float32) / 255.0
        x = (x - self.mean) / self.std
        return np.ascontiguousarray(x.transpose(2, 0, 1))


def preprocess_batch(images: list[bytes], image_size: int) -> tuple[np.ndarray, list[bool]]:
    """Decode and transform a batch; a bad image gives zeros and ok=False instead of an exception,
    so that one broken record never stops a training run (the caller drops and counts it)."""
    transform = ImageTransform(image_size)
    out = np.zeros((len(images), 3, image_size, image_size), dtype=np.float32)
    ok = []
    for i, data in enumerate(images):
        try:
            out[i] = transform(decode_image(data))
            ok.append(True)
        except ValueError:
            ok.append(False)
    return out, ok
