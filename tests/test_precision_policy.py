"""The GPU's precision policy, run on CPU: `apply_fsdp(model, bf16=True)` (bf16 parameters and
compute, float32 gradient reduction) under a one-rank gloo group, for every objective of the
registry and MDC's switches. CPU CI otherwise only runs float32, so a dtype mismatch would first
show on a GPU, at step 1 (docs/design.md §11). No Ray."""

import pytest
import torch

from mdc import registry
from mdc.config import load_config
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation.compositionality import get_scorer
from mdc.models.captioner import sinusoidal_embedding
from mdc.sampling import Decoding
from mdc.training import checkpoint as ckpt
from mdc.training.fsdp import apply_fsdp
from mdc.training.step import EMA, build_optimizer, build_scheduler, train_step
from pipelines.worker.validator import Validator

pytestmark = pytest.mark.usefixtures("gloo_process_group")

LENGTH = 8
CASES = {name: [f"objective.name={name}"] for name in registry.OBJECTIVES} | {
    "mdc+time_conditioning": ["objective.name=mdc", "model.time_conditioning=true"],
    "mdc+predict_length": ["objective.name=mdc", "model.predict_length=true"],
    "mdc+image_free_prob": ["objective.name=mdc", "objective.image_free_prob=0.5"],
}


def bf16_run(overrides: list[str]):
    cfg = load_config(
        None,
        ["model.preset=tiny", "model.decoder_layers=1", f"data.max_length={LENGTH}", "optim.ema_decay=0.9", *overrides],
    )
    torch.manual_seed(0)
    model = registry.build_model(cfg, CaptionTokenizer)
    apply_fsdp(model, bf16=True)
    optimizer = build_optimizer(model, cfg.optim)
    return cfg, model, optimizer, build_scheduler(optimizer, 1, 10), EMA(model, cfg.optim.ema_decay)


def batch(n: int = 4):
    gen = torch.Generator().manual_seed(1)
    images = torch.rand(n, 3, 32, 32, generator=gen)
    tokens = torch.randint(0, 100, (n, LENGTH), generator=gen)
    tokens[0, 5:] = CaptionTokenizer.pad_id  # one short caption: pad handling under bf16 too
    return images, tokens


def local_dtypes(tensors) -> set[torch.dtype]:
    return {(t.to_local() if hasattr(t, "to_local") else t).dtype for t in tensors}


@pytest.mark.parametrize("case", CASES)
def test_bf16_policy_trains_validates_scores_writes_and_checkpoints(case, tmp_path):
    cfg, model, optimizer, scheduler, ema = bf16_run(CASES[case])
    images, tokens = batch()
    metrics = train_step(
        model,
        optimizer,
        scheduler,
        images,
        tokens,
        cfg.objective,
        cfg.optim.grad_clip,
        generator=torch.Generator().manual_seed(2),
        ema=ema,
    )
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all(), metrics
    # what the GPU keeps in float32: sharded parameters, the optimiser's moments, the EMA
    assert local_dtypes(model.parameters()) == {torch.float32}
    assert local_dtypes(v for s in optimizer.state.values() for k, v in s.items() if k != "step") == {torch.float32}
    assert local_dtypes(ema.state_dict().values()) == {torch.float32}

    val_batches = [{"image": (images * 255).to(torch.uint8), "tokens": tokens}]
    val = Validator(cfg.validation, val_batches, cfg.objective, steps=1, seed=0, device="cpu").loss(model)
    assert torch.isfinite(torch.tensor(val))

    # DCP save and restore into a fresh model with the same policy
    uri = ckpt.checkpoint_dir(str(tmp_path / "run"), 1)
    local = tmp_path / "stage"
    local.mkdir()
    ckpt.stage_training_state(local, model, optimizer, ema, {"scheduler": scheduler}, rank=0)
    ckpt.commit(uri, 1, ckpt.upload_shard(local, uri), 0)
    _, fresh, fresh_optimizer, fresh_scheduler, fresh_ema = bf16_run(CASES[case] + ["train.seed=5"])
    ckpt.load_training_state(uri, fresh, fresh_optimizer, fresh_ema, {"scheduler": fresh_scheduler})
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a.to_local(), b.to_local())
    weights = ckpt.full_weights(fresh, fresh_ema)
    assert {w.dtype for w in weights.values()} == {torch.float32}

    # scorer and caption writer on the exported weights, cast as FSDP2 casts them (bf16 compute);
    # they run outside `forward`, where FSDP would not unshard the root
    plain = registry.build_model(cfg, CaptionTokenizer)
    plain.load_state_dict(weights)
    plain = plain.to(torch.bfloat16).eval()
    entry = registry.objective(cfg.objective.name)
    _, score = get_scorer("auto", cfg.objective.name)
    scores = score(
        plain,
        images,
        [["a red circle"] * len(images), ["a blue square"] * len(images)],
        2,
        torch.Generator().manual_seed(3),
    )
    assert scores.shape == (len(images), 2) and torch.isfinite(scores).all()
    if entry.write is not None:
        captions = registry.write_captions(plain, images, cfg.objective.name, LENGTH, Decoding(steps=2))
        assert captions.shape == (len(images), LENGTH)
        assert not (captions == CaptionTokenizer.mask_id).any()


@pytest.mark.parametrize("case", ["mdc+time_conditioning", "cdlm"])
def test_noise_levels_a_bf16_value_apart_stay_apart(case):
    """0.5 and 0.5004 are one bf16 value: t must reach the time embedding in float32 through
    FSDP2's input casts (`forward`, and cdlm's registered `denoise`)."""
    _, model, *_ = bf16_run(CASES[case])
    torch.manual_seed(4)
    for block in model.blocks:  # zero-initialised: t would not change the output at all
        torch.nn.init.normal_(block.modulation.weight.to_local(), std=0.05)
    images, tokens = batch()
    noise = torch.randn(*tokens.shape, model.dim)

    def output(level: float) -> torch.Tensor:
        t = torch.full((len(tokens),), level)
        with torch.no_grad():
            if case == "cdlm":
                return model.denoise(images, tokens, t, noise)[0]
            return model(images, tokens, t=t)

    assert torch.equal(output(0.5), output(0.5))
    assert not torch.equal(output(0.5), output(0.5004))
    assert sinusoidal_embedding(torch.tensor([0.5004]), 128).dtype == torch.float32
