"""The baselines beside MDC: DDCap's switches, CLIP, CLIP-Diffusion-LM, caption infilling, and every
objective trained through the Ray pipeline, then sampled and scored."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import ConstantNLL, same_under_meta_default_device
from torch import nn

from mdc import ddcap
from mdc.config import ConfigError, OptimConfig, load_config
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation import compositionality as comp
from mdc.evaluation.captioning import CaptionImage
from mdc.evaluation.infilling import evaluate_infilling, mask_span
from mdc.models.cdlm import alpha_bar
from mdc.objectives.cdlm import continuous_diffusion_loss
from mdc.objectives.clip import clip_loss
from mdc.objectives.masked import MdcObjective, masked_diffusion_loss
from mdc.registry import build_model, compute_loss, write_captions
from mdc.sampling import sample_continuous, sample_masked
from mdc.training.checkpoint import load_pretrained
from mdc.training.step import build_optimizer, build_scheduler, train_step

MASK, PAD, BOS, EOS = 49408, 49409, 49406, 49407


def images(b=2, seed=0):
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def captions(n=8, seed=1):
    """Three captions of 8, 5 and 2 tokens (padded to n)."""
    tokens = torch.randint(0, BOS, (3, n), generator=torch.Generator().manual_seed(seed))
    tokens[1, 5:] = PAD
    tokens[2, 2:] = PAD
    return tokens


def model_for(*overrides, max_length=8):
    torch.manual_seed(0)
    cfg = load_config(None, [f"data.max_length={max_length}", *overrides])
    return build_model(cfg, CaptionTokenizer), cfg


# ------------------------------------------------------------------------------------ DDCap


def test_length_head_target_is_the_number_of_non_pad_tokens():
    assert ddcap.length_targets(captions(), PAD).tolist() == [7, 4, 1]  # classes N − 1 for N = 8, 5, 2
    assert ddcap.predicted_lengths(F.one_hot(torch.tensor([7, 4, 1]), 8).float()).tolist() == [8, 5, 2]


def test_length_loss_is_added_to_the_diffusion_loss():
    model, cfg = model_for("model.predict_length=true")
    tokens, pixels = captions(), images(3)
    loss, metrics = compute_loss(model, pixels, tokens, cfg.objective, torch.Generator().manual_seed(0))
    expected_ce = F.cross_entropy(model.length_head(model.encode(pixels).mean(1)), torch.tensor([7, 4, 1]))
    assert metrics["length_ce"].item() == pytest.approx(expected_ce.item(), rel=1e-5)
    head, model.length_head = model.length_head, None
    plain, _ = compute_loss(model, pixels, tokens, cfg.objective, torch.Generator().manual_seed(0))
    model.length_head = head
    assert loss.item() == pytest.approx(plain.item() + expected_ce.item(), rel=1e-5)


class FixedLengths(nn.Module):
    """A length head whose answer per row is given."""

    def __init__(self, lengths, max_length):
        super().__init__()
        self.logits = F.one_hot(torch.tensor(lengths) - 1, max_length).float()

    def forward(self, pooled):
        return self.logits[: len(pooled)]


@torch.no_grad()
def test_sampler_writes_the_predicted_length_when_none_is_given():
    model, _ = model_for("model.predict_length=true")
    model.eval().length_head = FixedLengths([3, 6], 8)
    out = sample_masked(model, images(2))
    assert out.shape == (2, 6)
    assert (out != PAD).sum(1).tolist() == [3, 6] and not (out == MASK).any()
    assert sample_masked(model, images(2), length=4).shape == (2, 4)  # a given N' wins


def test_predict_length_and_image_free_are_for_masked_objectives_only():
    with pytest.raises(ConfigError, match="predict_length applies to"):
        load_config(None, ["objective.name=ar", "model.predict_length=true"])
    with pytest.raises(ConfigError, match="image_free_prob applies to"):
        load_config(None, ["objective.name=cappa", "objective.image_free_prob=0.1"])


@pytest.mark.parametrize("objective", ["ar", "cappa"])
def test_time_conditioning_is_refused_for_autoregressive_objectives(objective):
    with pytest.raises(ConfigError, match=rf"model.time_conditioning=true needs a noise level t, which '{objective}'"):
        load_config(None, [f"objective.name={objective}", "model.time_conditioning=true"])


@pytest.mark.parametrize("concentrated", [True, False])
def test_concentrated_attention_mask_pattern(concentrated):
    model, _ = model_for(f"model.concentrated_attention={concentrated}")
    tokens = torch.tensor([[5, MASK, 7, MASK, PAD, PAD], [MASK, MASK, 3, 4, 9, PAD]])
    allowed = model.self_attention_mask(tokens, causal=False)[:, 0]
    hidden = (tokens == PAD) | ((tokens == MASK) if concentrated else torch.zeros_like(tokens, dtype=torch.bool))
    expected = ~hidden[:, None, :] | torch.eye(6, dtype=torch.bool)  # query i, key j: visible or itself
    assert torch.equal(allowed, expected)


def test_guidance_mixes_conditional_and_unconditional_logits():
    cond = torch.tensor([[2.0, -1.0, 0.5]])
    uncond = torch.tensor([[1.0, 0.0, 0.5]])
    out = ddcap.guide(cond, uncond, 1.5)
    torch.testing.assert_close(out, torch.tensor([[2.5, -1.5, 0.5]]))  # l_u + s·(l_c − l_u)
    torch.testing.assert_close(ddcap.guide(cond, uncond, 1.0), cond)
    torch.testing.assert_close(ddcap.guide(cond, uncond, 0.0), uncond)


@torch.no_grad()
def test_image_free_rows_see_the_learned_null_image():
    model, _ = model_for("objective.image_free_prob=0.5")
    model.eval()
    tokens, pixels = captions()[:2], images(2)
    out = model(pixels, tokens, image_free=torch.tensor([True, False]))
    torch.testing.assert_close(out[0], model.decode(tokens, model.null_features(2))[0])
    torch.testing.assert_close(out[1], model(pixels, tokens)[1])


def test_image_free_training_drops_the_chosen_share_and_trains_the_null_image():
    """The share over 48,000 captions (uniform stand-in model): its binomial standard error is
    sqrt(0.3·0.7/48000) ≈ 0.0021 and the tolerance four of them, so a share 10% off (0.33) is 14 SE
    away (4,800 captions let it pass); then a real model's null image trains."""
    uniform = ConstantNLL(16, mask_id=MASK, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    tokens = torch.zeros(48000, 4, dtype=torch.long)
    _, metrics = masked_diffusion_loss(
        uniform,
        None,
        tokens,
        MdcObjective(omega_l=0.0, omega_u=1.0, image_free_prob=0.3),
        generator=torch.Generator().manual_seed(0),
    )
    assert metrics["image_free_fraction"].item() == pytest.approx(0.3, abs=4 * math.sqrt(0.3 * 0.7 / len(tokens)))
    model, cfg = model_for("objective.image_free_prob=0.3")
    loss, _ = compute_loss(
        model, images(120), captions().repeat(40, 1), cfg.objective, torch.Generator().manual_seed(0)
    )
    loss.backward()
    assert model.null_image.grad.abs().sum() > 0


@torch.no_grad()
def test_guidance_needs_an_image_free_trained_model():
    model, _ = model_for()
    with pytest.raises(ValueError, match="guidance needs a model trained image-free"):
        sample_masked(model.eval(), images(2), length=4, guidance_scale=1.06)


@torch.no_grad()
def test_guidance_scale_zero_ignores_the_image_and_one_is_plain_sampling():
    model, _ = model_for("objective.image_free_prob=0.2")
    model.eval()
    a, b = images(2, seed=1), images(2, seed=2)
    assert torch.equal(
        sample_masked(model, a, length=6, guidance_scale=0.0), sample_masked(model, b, length=6, guidance_scale=0.0)
    )
    assert torch.equal(sample_masked(model, a, length=6, guidance_scale=1.0), sample_masked(model, a, length=6))
    assert not torch.equal(sample_masked(model, a, length=6), sample_masked(model, b, length=6))


# ------------------------------------------------------------------------------------- CLIP


def test_clip_uses_the_captioners_encoder_and_offers_blocks_to_fsdp():
    clip, _ = model_for("objective.name=clip")
    captioner, _ = model_for()
    assert {k: v.shape for k, v in clip.encoder.state_dict().items()} == {
        k: v.shape for k, v in captioner.encoder.state_dict().items()
    }
    assert len(clip.blocks) == len(captioner.blocks) and clip.blocks is clip.text.transformer.resblocks
    pixels = images(2)
    clip.encoder.load_state_dict(captioner.encoder.state_dict())
    torch.testing.assert_close(clip.encode_image(pixels), captioner.encode_image(pixels))


def test_clip_text_is_bos_caption_eos_then_zeros():
    clip, _ = model_for("objective.name=clip")
    tokens = torch.tensor([[10, 11, 12], [20, PAD, PAD]])
    assert clip.text_inputs(tokens).tolist() == [[BOS, 10, 11, 12, EOS], [BOS, 20, EOS, 0, 0]]


def test_clip_scorer_is_cosine_similarity():
    clip, _ = model_for("objective.name=clip")
    clip.eval()
    texts = [["a red circle", "a blue square"], ["a green circle", "a red circle"]]
    name, score = comp.get_scorer("auto", "clip")
    scores = score(clip, images(2), texts)
    image = F.normalize(clip.image_proj(clip.encode_image(images(2))), dim=-1)
    text = F.normalize(clip.text(clip.text_inputs(comp.caption_tokens(clip, texts[1]))), dim=-1)
    assert name == "clip" and scores.shape == (2, 2)
    torch.testing.assert_close(scores[:, 1], (image * text).sum(-1))


def test_clip_loss_falls_and_matches_images_to_their_captions():
    clip, cfg = model_for("objective.name=clip", max_length=16)
    tokens = torch.from_numpy(
        CaptionTokenizer(16).encode(["a red circle", "a blue square", "a green triangle", "a yellow star"])
    )
    pixels = images(4, seed=3)
    optimizer = build_optimizer(clip, OptimConfig(lr=1e-3, weight_decay=0.0))
    scheduler = build_scheduler(optimizer, warmup=1, total=60)
    history = [train_step(clip, optimizer, scheduler, pixels, tokens, cfg.objective, 1.0) for _ in range(60)]
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["contrastive_accuracy"] == 1.0


def test_clip_logit_scale_is_clamped_as_a_parameter_and_keeps_its_gradient():
    """A step pushes the parameter past log(100); the next loss clamps the parameter itself, so the
    scale is 100 and its gradient is not 0 (clamping exp() instead gave exactly 0 above 100)."""
    clip, cfg = model_for("objective.name=clip")
    optimizer = torch.optim.SGD([clip.logit_scale], lr=1.0)
    clip.logit_scale.data.fill_(math.log(100.0) - 0.01)
    clip.logit_scale.grad = torch.tensor([-1.0])
    optimizer.step()
    assert clip.logit_scale.item() > math.log(100.0)
    loss, metrics = compute_loss(clip, images(3), captions(), cfg.objective)
    loss.backward()
    assert clip.logit_scale.item() == pytest.approx(math.log(100.0))
    assert metrics["logit_scale"].item() == pytest.approx(100.0)
    assert clip.logit_scale.grad.abs().item() > 0


# -------------------------------------------------------------------------- CLIP-Diffusion-LM


def test_cdlm_reads_t_unless_told_otherwise_and_then_refuses():
    model, cfg = model_for("objective.name=cdlm")
    assert cfg.model.time_conditioning is None  # what the user wrote stays as written
    assert cfg.time_conditioned and model.time_mlp is not None
    with pytest.raises(ConfigError, match=r"model.time_conditioning=false: 'cdlm' .* set model.time_conditioning=true"):
        load_config(None, ["objective.name=cdlm", "model.time_conditioning=false"])


def test_cosine_schedule_runs_from_signal_to_noise():
    t = torch.linspace(0, 1, 11)
    ab = alpha_bar(t)
    assert ab[0] == pytest.approx(1.0) and ab[-1] == pytest.approx(0.0, abs=1e-6)
    assert (ab[1:] < ab[:-1]).all()


@torch.no_grad()
def test_inputs_embeds_path_equals_the_token_path():
    model, _ = model_for()
    model.eval()
    tokens, features = captions(), model.encode(images(3))
    torch.testing.assert_close(
        model.decode(tokens, features, inputs_embeds=model.token_embed(tokens)), model.decode(tokens, features)
    )


def test_cdlm_loss_is_mse_on_x0_plus_rounding_cross_entropy():
    model, cfg = model_for("objective.name=cdlm")
    tokens, pixels = captions(), images(3)
    loss, metrics = continuous_diffusion_loss(model, pixels, tokens, torch.Generator().manual_seed(0))

    draws = torch.Generator().manual_seed(0)
    t = torch.rand(3, generator=draws)
    noise = torch.randn(3, 8, model.dim, generator=draws)
    x0 = F.normalize(model.token_embed(tokens), dim=-1) * math.sqrt(model.dim)
    ab = alpha_bar(t)[:, None, None]
    x0_hat = model.hidden_states(
        tokens, model.encode(pixels), t=t, inputs_embeds=ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    )
    real = tokens != PAD
    mse = (x0_hat[real] - x0[real]).pow(2).mean()
    ce = F.cross_entropy(model.project(x0_hat[real]), tokens[real])
    assert metrics["mse"].item() == pytest.approx(mse.item(), rel=1e-5)
    assert metrics["rounding_ce"].item() == pytest.approx(ce.item(), rel=1e-5)
    assert loss.item() == pytest.approx((mse + ce).item(), rel=1e-5)
    assert compute_loss(model, pixels, tokens, cfg.objective, torch.Generator().manual_seed(0))[
        0
    ].item() == pytest.approx(loss.item())


@torch.no_grad()
def test_cdlm_sampler_refines_five_times_then_rounds(monkeypatch):
    model, _ = model_for("objective.name=cdlm")
    model.eval()
    calls, predict = [], model.predict_x0
    monkeypatch.setattr(model, "predict_x0", lambda *a: calls.append(float(a[2][0])) or predict(*a))
    out = sample_continuous(model, images(2), length=7, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 7) and (out < MASK).all()  # rounded to real tokens: never [MASK] or pad
    assert calls == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])


@torch.no_grad()
def test_cdlm_sampler_renoises_each_prediction_with_the_generators_noise(monkeypatch):
    """By hand: x ~ N(0, I) from the generator, then per pass x̂0 = f(x, t_i) and x ← √ᾱ·x̂0 + √(1 − ᾱ)·ε
    at t_{i+1} with the generator's next ε; the tokens round the last x̂0 (the input tokens are
    placeholders, 0, never pad)."""
    model, _ = model_for("objective.name=cdlm")
    model.eval()
    seen, predict = [], model.predict_x0
    monkeypatch.setattr(model, "predict_x0", lambda *a: seen.append(a) or predict(*a))
    pixels = images(2)
    out = sample_continuous(model, pixels, length=4, steps=3, generator=torch.Generator().manual_seed(1))
    draws, image_kv = torch.Generator().manual_seed(1), model.image_keys_values(model.encode(pixels))
    x, levels = torch.randn(2, 4, model.dim, generator=draws), [1.0, 2 / 3, 1 / 3, 0.0]
    assert len(seen) == 3
    for i, (tokens, _, t, fed) in enumerate(seen):
        assert torch.equal(tokens, torch.zeros(2, 4, dtype=torch.long))
        torch.testing.assert_close(t, torch.full((2,), levels[i]))
        torch.testing.assert_close(fed, x)
        x0_hat = predict(tokens, image_kv, t, x)
        ab = alpha_bar(torch.tensor(levels[i + 1]))
        x = ab.sqrt() * x0_hat + (1 - ab).sqrt() * torch.randn(x.shape, generator=draws)
    assert torch.equal(out, model.project(x0_hat).argmax(-1))


def test_clip_and_cdlm_losses_compute_on_the_tokens_device_whatever_torchs_default_device():
    """Every tensor the two losses make is made on the batch's device: with torch's default device
    set to "meta" they give the same values (a tensor made on the default device could not mix with
    the others, or would come back on "meta" with no values)."""
    (clip, _), (cdlm, _) = model_for("objective.name=clip"), model_for("objective.name=cdlm")
    tokens, pixels = captions(), images(3)
    cases = [
        lambda: clip_loss(clip, pixels, tokens),
        lambda: continuous_diffusion_loss(cdlm, pixels, tokens, torch.Generator().manual_seed(0)),
    ]
    same_under_meta_default_device(cases)


def test_cdlm_loss_falls_when_overfitting():
    model, cfg = model_for("objective.name=cdlm", max_length=16)
    tokens = torch.from_numpy(CaptionTokenizer(16).encode(["a red circle", "a blue square"]))
    pixels = images(2, seed=4)
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3, weight_decay=0.0))
    scheduler = build_scheduler(optimizer, warmup=1, total=40)
    generator = torch.Generator().manual_seed(0)
    losses = [
        train_step(model, optimizer, scheduler, pixels, tokens, cfg.objective, 1.0, generator=generator)["loss"]
        for _ in range(40)
    ]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


# ------------------------------------------------------------------------------------ infilling


def test_mask_span_masks_one_contiguous_span_of_real_tokens():
    tokens = captions(10)
    out = mask_span(tokens, 0.3, MASK, PAD, torch.Generator().manual_seed(0))
    for row, original, expected in zip(out, tokens, [3, 2, 1]):  # round(0.3·N), at least 1
        where = torch.nonzero(row == MASK)[:, 0]
        assert len(where) == expected and (where.diff() == 1).all()
        assert (original[where] != PAD).all() and torch.equal(row[row != MASK], original[row != MASK])


def test_infilling_keeps_the_given_words_and_scores_the_result():
    model, _ = model_for("objective.name=cmlm", max_length=12)
    model.eval()
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(png, format="PNG")
    data = [
        CaptionImage(f"k{i}", png.getvalue(), [f"a small red circle to the left of a {w} square", "a red circle"])
        for i, w in enumerate(["large", "blue"])
    ]
    result = evaluate_infilling(model, "cmlm", data, ratio=0.2)
    assert 0.0 <= result["bleu4"] <= 1.0 and result["cider"] >= 0.0
    for entry in result["captions"]:
        before, after = entry["masked"].split("___")
        assert entry["filled"].startswith(before.strip()) and entry["filled"].endswith(after.strip())
    with pytest.raises(ValueError, match="infilling needs a masked diffusion model"):
        evaluate_infilling(model, "ar", data)


def test_eval_infill_command_writes_json(shapes_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from mdc.config import dump_config
    from mdc.training.checkpoint import export_weights
    from pipelines.cli import app

    model, cfg = model_for("objective.name=mdc", max_length=16)
    export_weights(tmp_path / "ckpt", model.state_dict(), dump_config(cfg))
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "infill",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--data",
            str(shapes_dir / "val"),
            "--limit",
            "4",
            "--mlflow-uri",
            "",
            "--out",
            str(tmp_path / "infill.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "infill.json").read_text())
    assert written["num_images"] == 4 and {"bleu4", "cider"} <= set(written)
    assert all("___" in entry["masked"] for entry in written["captions"])


# ------------------------------------------------------------------------ through the pipeline


def samples_and_scores(model, objective):
    pixels = images(2)
    tokens = write_captions(model, pixels, objective, length=6)
    assert tokens.shape == (2, 6) and not (tokens == MASK).any()
    _, score = comp.get_scorer("auto", objective)
    scores = score(
        model,
        pixels,
        [["a small red circle"] * 2, ["a large blue square"] * 2],
        samples=2,
        generator=torch.Generator().manual_seed(0),
    )
    assert scores.shape == (2, 2) and torch.isfinite(scores).all()


@pytest.mark.ray
@pytest.mark.timeout(240)
@pytest.mark.parametrize("objective", ["cappa", "bert"])  # the causal and the fixed-ratio masked family
def test_objective_trains_through_ray_then_samples_and_scores(objective, ray_cluster, shapes_dir, tmp_path):
    from pipelines.run.driver import run_training

    overrides = [
        f"name=baseline-{objective}",
        f"storage_uri={tmp_path / 'ckpt'}",
        f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"data.train_uri={shapes_dir / 'train'}",
        "data.val_uri=null",
        "data.max_length=16",
        "train.batch_size=8",
        "workers.count=1",
        "train.steps=4",
        "train.log_every=2",
        "optim.warmup_steps=1",
        f"objective.name={objective}",
    ]
    if objective == "bert":
        overrides.append("objective.mask_ratio=0.5")
    summary = run_training(load_config(None, overrides))
    assert summary.metrics["step"] == 4 and math.isfinite(summary.metrics["loss"])

    model, cfg = load_pretrained(summary.checkpoint_uri)
    assert cfg.objective.name == objective
    samples_and_scores(model, objective)
