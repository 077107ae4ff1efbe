"""The trimmed output layer, samplers and scorers against the untrimmed computation they replace.

The reference here is the output layer as it was — every position projected onto all V ids, a
−∞ bias on [MASK] and pad, a softmax for the confidence, a log-softmax for the scores — written out
naively. The trimmed code (only masked or scored positions projected, the special ids cut from the
weight, confidence as exp(max − logsumexp)) must write the same tokens on fixed seeds and give the
same scores to float32 rounding.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from mdc import scoring
from mdc.config import load_config
from mdc.data.tokenizer import CaptionTokenizer
from mdc.models.captioner import Captioner
from mdc.models.cdlm import noised
from mdc.objectives.autoregressive import autoregressive_io
from mdc.objectives.masked import T_MIN
from mdc.registry import build_model
from mdc.sampling import generate_autoregressive, sample_masked

LENGTH = 10


def sharp_model(*overrides):
    """A tiny untrained model whose logits spread over ±20, so argmax and confidence ranks are
    decided by margins far above float32 rounding, and whose cross-attention is sharp (queries and
    keys ×10): each position reads the patches that match it, so each image gets its own caption
    (an untrained model's soft attention averages every image to about the same one)."""
    torch.manual_seed(0)
    model = build_model(load_config(None, [f"data.max_length={LENGTH}", *overrides]), CaptionTokenizer).eval()
    with torch.no_grad():
        model.token_embed.weight.mul_(30.0)
        for block in model.blocks:
            block.cross_attn.q.weight.mul_(10.0)
            block.cross_attn.kv.weight.mul_(10.0)
    return model


def distinct_rows(tokens: torch.Tensor) -> int:
    return len(set(map(tuple, tokens.tolist())))


def images(b=4, seed=0):
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def captions(seed=1):
    tokens = torch.randint(0, CaptionTokenizer.bos_id, (4, LENGTH), generator=torch.Generator().manual_seed(seed))
    tokens[1, 6:] = CaptionTokenizer.pad_id
    tokens[2, 2:] = CaptionTokenizer.pad_id
    return tokens


def full_logits(model, states):
    """The untrimmed output layer: all V ids, [MASK] and pad at −∞."""
    logits = F.linear(states, model.token_embed.weight).float()
    logits[..., [model.mask_id, model.pad_id]] = -math.inf
    return logits


def full_log_probs(model, states, targets):
    return full_logits(model, states).log_softmax(-1).gather(-1, targets[..., None])[..., 0]


@torch.no_grad()
def reference_sample_masked(model, pixels, steps=None, strategy="confidence", guidance_scale=1.0, seed=0):
    """MDC decoding as written before trimming: every position, full softmax, max probability."""
    generator = torch.Generator().manual_seed(seed)
    image_kv = model.image_keys_values(model.encode(pixels))
    null_kv = model.image_keys_values(model.null_features(len(pixels))) if guidance_scale != 1.0 else None
    tokens = torch.full((len(pixels), LENGTH), model.mask_id)

    def propose(t):
        logits = full_logits(model, model.hidden_states(tokens, image_kv, t=t))
        if null_kv is not None:
            uncond = full_logits(model, model.hidden_states(tokens, null_kv, t=t))
            logits = torch.where(logits.isfinite(), uncond + guidance_scale * (logits - uncond), logits)
        conf, token = logits.softmax(-1).max(-1)
        return token, conf

    masked, steps = tokens == model.mask_id, steps or LENGTH
    per_pass = max(1, LENGTH // steps)  # the fixed schedule: ⌊N'/steps⌋ a pass, the last pass the rest
    for step in range(steps):
        proposal, conf = propose(masked.sum(1) / LENGTH)
        if strategy == "ancestral":
            t_now, t_next = 1.0 - step / steps, 1.0 - (step + 1) / steps
            commit = masked & (torch.rand(tokens.shape, generator=generator) < (t_now - t_next) / t_now)
        else:
            rank = torch.where(masked, conf, -1.0).argsort(dim=1, descending=True).argsort(dim=1)
            commit = masked & (rank < per_pass) if step < steps - 1 else masked
        tokens, masked = torch.where(commit, proposal, tokens), masked & ~commit
    return tokens


@pytest.mark.parametrize(
    "overrides, options",
    [
        ((), {}),
        ((), {"steps": 4}),  # fewer passes than positions: ⌊N'/4⌋ a pass, the last the rest
        (("model.time_conditioning=true",), {}),
        (("objective.image_free_prob=0.5",), {"guidance_scale": 2.0}),
        ((), {"strategy": "ancestral", "steps": 5}),
    ],
    ids=["confidence", "four-steps", "time-conditioned", "guided", "ancestral"],
)
def test_trimmed_masked_sampler_writes_the_untrimmed_tokens(overrides, options):
    model, pixels = sharp_model(*overrides), images()
    for seed in range(3):
        trimmed = sample_masked(model, pixels, LENGTH, generator=torch.Generator().manual_seed(seed), **options)
        assert torch.equal(trimmed, reference_sample_masked(model, pixels, seed=seed, **options))
        assert distinct_rows(trimmed) == len(pixels)  # the captions follow the images: a row mix-up shows


@pytest.mark.parametrize("use_cache", [True, False])
def test_trimmed_autoregressive_decoding_writes_the_untrimmed_tokens(use_cache):
    model, pixels = sharp_model("objective.name=ar"), images()
    image_kv = model.image_keys_values(model.encode(pixels))
    seq = torch.full((len(pixels), 1), model.bos_id)
    with torch.no_grad():
        for _ in range(LENGTH):  # greedy, the whole prefix re-read, every position projected
            seq = torch.cat(
                [seq, full_logits(model, model.hidden_states(seq, image_kv, causal=True))[:, -1:].argmax(-1)], 1
            )
    expected = seq[:, 1:]
    ended = (expected == model.eos_id).int().cumsum(1) > 0
    expected = torch.where(ended, model.pad_id, expected)
    assert torch.equal(generate_autoregressive(model, pixels, LENGTH, use_cache=use_cache), expected)


@torch.no_grad()
def test_trimmed_autoregressive_score_is_the_untrimmed_sum():
    model, pixels, tokens = sharp_model("objective.name=ar"), images(), captions()
    inputs, targets = autoregressive_io(tokens, model.bos_id, model.eos_id, model.pad_id)
    states = model.hidden_states(inputs, model.encode(pixels), causal=True)
    expected = torch.where(targets != model.pad_id, full_log_probs(model, states, targets), 0.0).sum(1)
    torch.testing.assert_close(scoring.autoregressive_score(model, pixels, tokens), expected, rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_trimmed_pseudo_log_likelihood_is_the_untrimmed_sum():
    model, pixels, tokens = sharp_model("model.time_conditioning=true"), images(), captions()
    image_kv, real = model.image_keys_values(model.encode(pixels)), tokens != model.pad_id
    expected = torch.zeros(len(tokens))
    for i in range(LENGTH):
        noisy = tokens.clone()
        noisy[:, i] = torch.where(real[:, i], model.mask_id, tokens[:, i])
        states = model.hidden_states(noisy, image_kv, t=1.0 / real.sum(1))
        expected += torch.where(real[:, i], full_log_probs(model, states, tokens)[:, i], 0.0)
    torch.testing.assert_close(scoring.pseudo_log_likelihood(model, pixels, tokens), expected, rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_trimmed_monte_carlo_elbo_is_the_untrimmed_estimate():
    model, pixels, tokens, k = sharp_model(), images(), captions(), 6
    trimmed = scoring.monte_carlo_elbo(model, pixels, [tokens], k, generator=torch.Generator().manual_seed(3))[0]
    generator = torch.Generator().manual_seed(3)  # the same draws of t and u, in the same order
    t_all = T_MIN + (1 - T_MIN) * (torch.arange(k)[:, None] + torch.rand(k, 4, generator=generator)) / k
    u_all = torch.rand(k, 4, LENGTH, generator=generator)
    image_kv, expected = model.image_keys_values(model.encode(pixels)), torch.zeros(4)
    for t, u in zip(t_all, u_all):
        masked = (u < t[:, None]) & (tokens != model.pad_id)
        logp = full_log_probs(model, model.hidden_states(torch.where(masked, model.mask_id, tokens), image_kv), tokens)
        expected += torch.where(masked, logp, 0.0).sum(1) / t
    torch.testing.assert_close(trimmed, expected / k, rtol=1e-5, atol=1e-3)


@torch.no_grad()
def test_trimmed_denoising_score_is_the_untrimmed_proxy():
    model, pixels, tokens = sharp_model("objective.name=cdlm"), images(), captions()
    trimmed = scoring.denoising_scores(model, pixels, [tokens], 3, generator=torch.Generator().manual_seed(5))[0]
    generator, real = torch.Generator().manual_seed(5), tokens != model.pad_id
    t_all = (torch.arange(3)[:, None] + torch.rand(3, 4, generator=generator)) / 3
    noise_all = torch.randn(3, 4, LENGTH, model.dim, generator=generator)
    image_kv, x0, expected = model.image_keys_values(model.encode(pixels)), model.embed(tokens), torch.zeros(4)
    for t, noise in zip(t_all, noise_all):
        x0_hat = model.predict_x0(tokens, image_kv, t, noised(x0, t, noise))
        mse = (x0_hat - x0).pow(2).mean(-1)
        expected -= torch.where(real, mse - full_log_probs(model, x0_hat, tokens), 0.0).sum(1)
    torch.testing.assert_close(trimmed, expected / 3, rtol=1e-5, atol=1e-3)


def test_the_output_layer_predicts_every_id_but_mask_and_pad():
    model, states = sharp_model(), torch.randn(3, 128)
    logits, full = model.project(states), full_logits(model, states)
    assert logits.shape == (3, CaptionTokenizer.vocab_size - 2) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, full[:, :-2])  # index = id; the two cut ids are the last two
    assert (full[:, [CaptionTokenizer.mask_id, CaptionTokenizer.pad_id]] == -math.inf).all()
    with pytest.raises(ValueError, match=r"\[MASK\] \(3\) and pad \(49409\) must be the last two"):
        Captioner(mask_id=3)


# ------------------------------------------------------------------------- fewer passes


def passes(model, monkeypatch):
    """Masked positions seen by each decoding pass, recorded from the decoder's `where`."""
    seen, decode = [], model.decode

    def counting(tokens, features, *args, where=None, **kwargs):
        seen.append(int(where.sum()))
        return decode(tokens, features, *args, where=where, **kwargs)

    monkeypatch.setattr(model, "decode", counting)
    return seen


def test_cosine_schedule_commits_all_but_n_cos_by_each_pass(monkeypatch):
    model, pixels = sharp_model(), images(2)
    seen = passes(model, monkeypatch)
    out = sample_masked(model, pixels, LENGTH, steps=3, schedule="cosine")
    # left masked before each pass: 10, then ⌊10·cos(π/6)⌋ = 8, then ⌊10·cos(π/3)⌋ = 5 per row
    assert seen == [2 * 10, 2 * 8, 2 * 5] and not (out == model.mask_id).any()


def test_linear_schedule_spreads_the_commits_evenly(monkeypatch):
    model, pixels = sharp_model(), images(2)
    seen = passes(model, monkeypatch)
    sample_masked(model, pixels, LENGTH, steps=4, schedule="linear")
    assert seen == [2 * 10, 2 * 7, 2 * 4, 2 * 2]  # commits of ⌈10/4⌉ = 3, ⌈7/3⌉ = 3, ⌈4/2⌉ = 2, 2


def test_threshold_commits_every_confident_position_and_at_least_one(monkeypatch):
    model, pixels = sharp_model(), images(2)
    seen = passes(model, monkeypatch)
    one_pass = sample_masked(model, pixels, LENGTH, threshold=0.0)  # every position clears 0
    assert seen == [2 * LENGTH]
    seen.clear()
    never = sample_masked(model, pixels, LENGTH, threshold=1.1)  # none clears it: one a pass
    assert seen == [2 * n for n in range(LENGTH, 0, -1)]
    assert torch.equal(never, sample_masked(model, pixels, LENGTH))
    image_kv = model.image_keys_values(model.encode(pixels))
    first = model.project(model.hidden_states(torch.full((2, LENGTH), model.mask_id), image_kv))
    assert torch.equal(one_pass, first.argmax(-1))  # the first pass's choice everywhere


@torch.no_grad()
def naive_schedule_sample(model, pixels, steps=None, schedule="fixed", threshold=None):
    """Confidence decoding with a schedule, row by row in plain Python over the untrimmed output
    layer: pass s of S commits the `count` most probable masked positions (linear: ⌈left/(S − s)⌉;
    cosine: all but ⌊N'·cos(π/2·(s + 1)/S)⌋, at least one; a threshold: every position at least
    that probable, and the most probable one), the last pass every position left."""
    image_kv = model.image_keys_values(model.encode(pixels))
    tokens, steps = torch.full((len(pixels), LENGTH), model.mask_id), steps or LENGTH
    for step in range(steps):
        masked = tokens == model.mask_id
        if not masked.any():
            break
        t = masked.sum(1) / LENGTH
        conf, proposal = full_logits(model, model.hidden_states(tokens, image_kv, t=t)).softmax(-1).max(-1)
        for row in range(len(tokens)):
            left = [i for i in range(LENGTH) if masked[row, i]]
            ranked = sorted(left, key=lambda i: -float(conf[row, i]))
            if step == steps - 1:
                chosen = ranked
            elif threshold is not None:
                chosen = [i for i in ranked if float(conf[row, i]) >= threshold] or ranked[:1]
            elif schedule == "linear":
                chosen = ranked[: math.ceil(len(left) / (steps - step))]
            else:  # cosine
                stays = math.floor(LENGTH * math.cos(math.pi / 2 * (step + 1) / steps))
                chosen = ranked[: max(1, len(left) - stays)]
            for i in chosen:
                tokens[row, i] = proposal[row, i]
    return tokens


@pytest.mark.parametrize(
    "options",
    [
        {"steps": 3, "schedule": "cosine"},
        {"steps": 4, "schedule": "linear"},
        {"steps": 6, "schedule": "cosine"},
        {"threshold": 0.5},
        {"threshold": 0.9, "steps": 3},
    ],
    ids=["cosine-3", "linear-4", "cosine-6", "threshold", "threshold-3-steps"],
)
def test_schedules_write_the_naive_loops_tokens(options):
    """Token by token, each image its own caption (a schedule's count or order wrong, or rows mixed
    up, changes tokens; positions per pass summed over the batch could not tell)."""
    model, pixels = sharp_model(), images()
    trimmed = sample_masked(model, pixels, LENGTH, **options)
    assert torch.equal(trimmed, naive_schedule_sample(model, pixels, **options))
    assert distinct_rows(trimmed) == len(pixels)


def test_schedules_are_for_the_confidence_strategy():
    model = sharp_model()
    with pytest.raises(ValueError, match="not 'ancestral'"):
        sample_masked(model, images(1), LENGTH, strategy="ancestral", threshold=0.9)
    with pytest.raises(ValueError, match="unknown schedule 'square'"):
        sample_masked(model, images(1), LENGTH, schedule="square")
