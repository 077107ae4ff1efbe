"""A tiny captioner memorises 8 rendered scenes on CPU; the samplers and scorers are then checked on
a model that knows the answers. Each model is trained once per module."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from mdc.config import OptimConfig
from mdc.data.tokenizer import CaptionTokenizer
from mdc.models.captioner import Captioner
from mdc.registry import OBJECTIVES
from mdc.sampling import generate_autoregressive, sample_masked
from mdc.scoring import autoregressive_score, monte_carlo_elbo, pseudo_log_likelihood
from mdc.training.step import build_optimizer, build_scheduler, train_step

# every test here trains a model to overfit (minutes); the step's unit tests are in test_step.py
pytestmark = pytest.mark.slow

COLOURS = {
    "red": (230, 25, 25),
    "blue": (25, 50, 230),
    "green": (20, 170, 40),
    "yellow": (240, 220, 20),
    "purple": (140, 30, 180),
    "orange": (250, 130, 0),
    "black": (0, 0, 0),
    "white": (255, 255, 255),
}
SCENES = [  # (left object, right object); no scene is another's mirror image
    (("red", "circle"), ("blue", "square")),
    (("green", "triangle"), ("yellow", "circle")),
    (("purple", "square"), ("orange", "circle")),
    (("black", "circle"), ("white", "triangle")),
    (("blue", "triangle"), ("red", "square")),
    (("yellow", "square"), ("purple", "triangle")),
    (("orange", "square"), ("black", "circle")),
    (("white", "circle"), ("green", "square")),
]


def render(scene) -> torch.Tensor:
    img = Image.new("RGB", (32, 32), (128, 128, 128))
    draw = ImageDraw.Draw(img)
    for (colour, shape), cx in zip(scene, (8, 24)):
        box = [cx - 7, 9, cx + 7, 23]
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(cx, 9), (cx - 7, 23), (cx + 7, 23)], fill=fill)
    return torch.tensor(np.asarray(img), dtype=torch.float32).permute(2, 0, 1) / 127.5 - 1


def caption(left, right) -> str:
    return f"a {' '.join(left)} to the left of a {' '.join(right)}"


@pytest.fixture(scope="module")
def data():
    tok = CaptionTokenizer(max_length=16)
    images = torch.stack([render(s) for s in SCENES])
    captions = [caption(left, right) for left, right in SCENES]
    swapped = [caption(right, left) for left, right in SCENES]
    assert not set(captions) & set(swapped)
    return {
        "tok": tok,
        "images": images,
        "captions": captions,
        "tokens": torch.from_numpy(tok.encode(captions)),
        "swapped": torch.from_numpy(tok.encode(swapped)),
    }


def overfit(data, objective: str, steps: int, lr: float):
    torch.manual_seed(0)
    model = Captioner("tiny", max_length=16)
    optimizer = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0))
    scheduler = build_scheduler(optimizer, warmup=20, total=steps)
    generator = torch.Generator().manual_seed(0)
    losses = [
        train_step(
            model,
            optimizer,
            scheduler,
            data["images"],
            data["tokens"],
            OBJECTIVES[objective].config(),
            grad_clip=1.0,
            generator=generator,
        )["loss"]
        for _ in range(steps)
    ]
    return model.eval(), losses


@pytest.fixture(scope="module")
def mdc_run(data):
    return overfit(data, "mdc", steps=300, lr=2e-3)


@pytest.fixture(scope="module")
def ar_run(data):
    return overfit(data, "ar", steps=120, lr=2e-3)


def loss_drop(losses) -> float:
    return 1.0 - np.mean(losses[-10:]) / np.mean(losses[:5])


def test_mdc_loss_falls(mdc_run):
    _, losses = mdc_run
    assert loss_drop(losses) >= 0.9, losses[::25]


def test_confidence_sampler_writes_the_training_captions(mdc_run, data):
    model, _ = mdc_run
    length = int((data["tokens"] != data["tok"].pad_id).sum(1).max())
    assert ((data["tokens"] != data["tok"].pad_id).sum(1) == length).all()  # one N' for all
    out = sample_masked(model, data["images"], length=length, strategy="confidence")
    assert data["tok"].decode(out) == data["captions"]


def test_diffusion_scores_prefer_the_true_relation(mdc_run, data):
    model, _ = mdc_run
    x, true, swapped = data["images"], data["tokens"], data["swapped"]
    pll_true, pll_swapped = pseudo_log_likelihood(model, x, true), pseudo_log_likelihood(model, x, swapped)
    assert (pll_true > pll_swapped).sum() >= 7, (pll_true, pll_swapped)
    elbo_true, elbo_swapped = monte_carlo_elbo(
        model, x, [true, swapped], num_samples=8, generator=torch.Generator().manual_seed(0)
    )
    assert (elbo_true > elbo_swapped).sum() >= 7, (elbo_true, elbo_swapped)


def test_ar_loss_falls_and_score_prefers_the_true_relation(ar_run, data):
    model, losses = ar_run
    assert loss_drop(losses) >= 0.9, losses[::20]
    x = data["images"]
    score_true = autoregressive_score(model, x, data["tokens"])
    score_swapped = autoregressive_score(model, x, data["swapped"])
    assert (score_true > score_swapped).sum() >= 7, (score_true, score_swapped)


def test_ar_greedy_decoding_writes_the_training_captions(ar_run, data):
    model, _ = ar_run
    assert data["tok"].decode(generate_autoregressive(model, data["images"])) == data["captions"]
