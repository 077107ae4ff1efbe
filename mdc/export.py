"""The encoder in timm's own folder layout, and any timm encoder behind the probe's interface.

`export_checkpoint` turns an exported mdc checkpoint into what `timm.create_model("local-dir:DIR",
pretrained=True)` reads without this package: `config.json` (architecture, the preset's model
args, a `pretrained_cfg` with the input size and preprocessing mdc trained with) and
`model.safetensors` in timm's key names, written by timm's own `save_for_hf`. mdc's fixed 2-D
sin-cos positions are a buffer outside its state dict; here they become the values of timm's
`pos_embed` parameter, so the folder needs no code of ours. A `README.md` model card says what
trained it, and `captioner/` holds the whole captioner in mdc's format (for captions and the
scorers, which need the decoder).

`load_encoder` is the other direction: `timm:NAME` (random init) or `local-dir:DIR` as a module
with the interface the probe and the scorers use, so an MDC encoder and a reference timm model
are measured on the same features.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import timm
import torch
from timm.models import save_for_hf
from torch import nn

from mdc.config import RunConfig
from mdc.data.images import CLIP_MEAN, CLIP_STD
from mdc.models.captioner import PRESETS, create_encoder
from mdc.seeding import drawing_from
from mdc.training import checkpoint as ckpt

TIMM_CONFIG = "config.json"
TIMM_WEIGHTS = "model.safetensors"
MODEL_CARD = "README.md"
CAPTIONER = "captioner"  # subfolder: the whole captioner, as `mdc eval` reads a checkpoint
ENCODER_PREFIX = "encoder."


def preprocessing(image_size: int) -> dict:
    """timm's pretrained_cfg fields for mdc's transform (`mdc.data.images.ImageTransform`): shorter
    side to S bicubic, centre crop S (crop_pct 1), CLIP's mean and std."""
    return {
        "input_size": (3, image_size, image_size),
        "fixed_input_size": True,
        "interpolation": "bicubic",
        "crop_pct": 1.0,
        "crop_mode": "center",
        "mean": CLIP_MEAN,
        "std": CLIP_STD,
    }


def timm_encoder(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """The encoder of an mdc model (captioner or CLIP) as a plain timm ViT: the same weights, and its
    position table (a fixed buffer in mdc) in timm's `pos_embed` parameter."""
    image_size = getattr(model, "image_size", None) or cfg.model.image_size or PRESETS[cfg.model.preset].image_size
    encoder = create_encoder(cfg.model.preset, image_size, "learned")
    weights = {k[len(ENCODER_PREFIX) :]: v for k, v in model.state_dict().items() if k.startswith(ENCODER_PREFIX)}
    weights["pos_embed"] = model.encoder.pos_embed.detach()
    encoder.load_state_dict(weights, strict=True)
    # timm's cfg names the ImageNet weights this architecture was published with; these are not those
    encoder.pretrained_cfg = {
        "architecture": PRESETS[cfg.model.preset].timm_name,
        "tag": f"mdc-{cfg.objective.name}",
        "num_classes": 0,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        **preprocessing(image_size),
    }
    return encoder.eval()


def export_encoder(model: nn.Module, cfg: RunConfig, directory: str | Path, facts: dict | None = None) -> Path:
    """Write the timm folder (config.json, model.safetensors, README.md) of `model`'s encoder."""
    directory = Path(directory)
    encoder = timm_encoder(model, cfg)
    save_for_hf(encoder, str(directory), safe_serialization=True)
    (directory / MODEL_CARD).write_text(model_card(cfg, encoder, facts or {}))
    return directory


def export_checkpoint(
    checkpoint: str | Path,
    directory: str | Path,
    facts: dict | None = None,
    with_captioner: bool = True,
    endpoint_url: str | None = None,
) -> Path:
    """Export an mdc checkpoint (model.safetensors + config.yaml, local or s3://) as a timm folder;
    with `with_captioner`, the checkpoint's own two files beside it in `captioner/`."""
    source = ckpt.fetch_checkpoint(checkpoint, endpoint_url)
    model, cfg = ckpt.load_pretrained(source)
    directory = Path(directory)
    export_encoder(model, cfg, directory, facts)
    if with_captioner:
        (directory / CAPTIONER).mkdir(exist_ok=True)
        for name in (ckpt.WEIGHTS, ckpt.CONFIG):
            shutil.copyfile(source / name, directory / CAPTIONER / name)
    return directory


def model_card(cfg: RunConfig, encoder: nn.Module, facts: dict) -> str:
    """What a colleague needs before using the encoder: how to load it, what it expects, how it was
    trained and what it measured. `facts`: figures by name (probe, compositionality, ...) and
    provenance (run id, checkpoint)."""
    pre = encoder.pretrained_cfg
    size = pre["input_size"][-1]
    lines = [
        f"# mdc-{cfg.objective.name}-{cfg.model.preset}",
        "",
        f"A ViT encoder (`{pre['architecture']}` with the model args in `config.json`) pretrained from scratch "
        f"by mdc (masked diffusion captioning) with the `{cfg.objective.name}` objective. No classifier head: "
        "`forward_features` gives the normalised patch tokens (no class token); the pooled feature mdc probes "
        "is their mean (`forward_head(x, pre_logits=True)`).",
        "",
        "```python",
        "import timm",
        'model = timm.create_model("local-dir:THIS_FOLDER", pretrained=True).eval()',
        "cfg = timm.data.resolve_data_config({}, model=model)",
        "transform = timm.data.create_transform(**cfg)",
        "```",
        "",
        f"Input: {size}×{size} RGB, shorter side resized to {size} (bicubic), centre-cropped, normalised with "
        f"CLIP's mean {tuple(pre['mean'])} and std {tuple(pre['std'])}. Positions are a fixed 2-D sin-cos table "
        "(stored in `pos_embed`): fine-tune with it frozen to keep them.",
        "",
        "## Training",
        "",
        f"- objective: `{cfg.objective.name}` (decoder: {cfg.model.decoder_layers or PRESETS[cfg.model.preset].decoder_layers} layers, "
        f"captions of at most {cfg.data.max_length} tokens)",
        f"- data: `{cfg.data.train_uri}`",
        f"- steps: {cfg.train.steps} at a global batch of {cfg.global_batch}",
    ]
    if facts:
        lines += ["", "## Figures and provenance", "", "| what | value |", "| --- | --- |"]
        lines += [
            f"| {name} | {value:.4f} |" if isinstance(value, float) else f"| {name} | {value} |"
            for name, value in facts.items()
        ]
    lines += [
        "",
        f"`{CAPTIONER}/`, when present, is the whole captioner in mdc's format (`mdc eval captions --checkpoint`).",
    ]
    return "\n".join(lines) + "\n"


class TimmEncoder(nn.Module):
    """Any timm model behind the interface the probe and the scorers use (`image_size`, `dim`,
    `forward_features`, `encode_image`). Images arrive as mdc prepares them (CLIP-normalised) and are
    renormalised to the model's own mean and std; features are its patch tokens with prefix tokens
    (a class token) dropped, and the pooled feature is their mean, as for mdc's encoders."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.eval()
        pre = model.pretrained_cfg
        self.image_size = int(pre.get("input_size", (3, 224, 224))[-1])
        self.dim = model.num_features
        mean, std = tuple(pre.get("mean", CLIP_MEAN)), tuple(pre.get("std", CLIP_STD))
        self.renormalise = (mean, std) != (CLIP_MEAN, CLIP_STD)
        clip_mean, clip_std = torch.tensor(CLIP_MEAN), torch.tensor(CLIP_STD)
        self.register_buffer("scale", (clip_std / torch.tensor(std)).view(1, 3, 1, 1), persistent=False)
        self.register_buffer(
            "shift", ((clip_mean - torch.tensor(mean)) / torch.tensor(std)).view(1, 3, 1, 1), persistent=False
        )

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        if self.renormalise:
            images = images * self.scale + self.shift
        tokens = self.model.forward_features(images)
        if tokens.ndim == 4:  # a convolutional network: (B, C, H, W) -> one token per position
            return tokens.flatten(2).transpose(1, 2)
        return tokens[:, getattr(self.model, "num_prefix_tokens", 0) :]

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_features(images).mean(dim=1)


ENCODER_KINDS = ("timm:", "local-dir:")


def load_encoder(spec: str, device: str = "cpu", seed: int = 0) -> TimmEncoder:
    """`timm:NAME` (random init from `seed`, nothing downloaded) or `local-dir:DIR` (a timm folder,
    e.g. one `mdc export` wrote), ready for the probe."""
    if spec.startswith("timm:"):
        with drawing_from(seed):  # its own generator: the same weights in any thread
            model = _create(spec[len("timm:") :], spec, pretrained=False, num_classes=0)
    elif spec.startswith("local-dir:"):
        config = Path(spec[len("local-dir:") :]).expanduser() / TIMM_CONFIG
        if not config.is_file():
            raise FileNotFoundError(
                f"--encoder {spec}: {config} is missing (not a timm folder; `mdc export` writes one)"
            )
        model = _create(f"local-dir:{config.parent}", spec, pretrained=True)
    else:
        raise ValueError(f"--encoder {spec!r}: expected timm:NAME or local-dir:DIR")
    return TimmEncoder(model).to(device)


def random_init_encoder(spec: str, device: str = "cpu", seed: int = 0) -> TimmEncoder:
    """The probe's baseline for `spec`: the same architecture and model args at timm's random init
    (its position table too: a checkpoint's baseline keeps mdc's fixed sin-cos table)."""
    if spec.startswith("timm:"):
        return load_encoder(spec, device, seed)
    trained = load_encoder(spec).model
    with drawing_from(seed):
        model = _create(trained.pretrained_cfg["architecture"], spec, pretrained=False, **trained._model_args)
    model.pretrained_cfg = trained.pretrained_cfg  # the same preprocessing as the trained one
    return TimmEncoder(model).to(device)


def _create(name: str, spec: str, **kwargs) -> nn.Module:
    try:
        return timm.create_model(name, **kwargs)
    except RuntimeError as err:  # timm's "Unknown model (...)"
        raise ValueError(f"--encoder {spec}: {err}") from None


def swap_encoder(model: nn.Module, encoder: TimmEncoder, source: str) -> nn.Module:
    """`model` (a captioner: the text side) scoring with `encoder` as its image side; the widths must
    agree, since the decoder's cross-attention reads the encoder's tokens."""
    if encoder.dim != model.dim:
        raise ValueError(f"--encoder {source}: its width {encoder.dim} differs from the decoder's {model.dim}")
    model.encoder = encoder
    model.image_size = encoder.image_size
    return model
