import math

import pytest
import torch

from mdc.config import load_config
from mdc.data.tokenizer import CaptionTokenizer
from mdc.models.captioner import Captioner
from mdc.registry import build_model
from mdc.sampling import (
    Decoding,
    _choose,
    _commit_count,
    generate_autoregressive,
    initial_tokens,
    placeholder_tokens,
    sample_continuous,
    sample_masked,
)

MASK, PAD, EOS = 49408, 49409, 49407


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Captioner("tiny", max_length=12).eval()


def images(b=2, seed=0):
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def record_decode(model, monkeypatch):
    """Wrap model.decode; returns the list of (tokens in, logits out) of every call."""
    calls, decode = [], model.decode

    def recording(tokens, *args, **kwargs):
        logits = decode(tokens, *args, **kwargs)
        calls.append((tokens.clone(), logits))
        return logits

    monkeypatch.setattr(model, "decode", recording)
    return calls


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_ancestral_uses_every_step_and_leaves_no_mask(model, monkeypatch, steps):
    """The last step goes to s = 0, so it commits whatever is still masked: one call per step,
    none after (with 20 positions an early finish is all but impossible at these seeds). The
    clean-up call for positions a short loop left masked would also commit the rest, but is told
    t = 0 for every caption; the last step is told the share still masked."""
    calls = record_decode(model, monkeypatch)
    shares = record_t(model, monkeypatch)
    out = sample_masked(
        model,
        images(),
        length=10,
        strategy="ancestral",
        steps=steps,
        temperature=1.0,
        generator=torch.Generator().manual_seed(1),
    )
    assert out.shape == (2, 10)
    assert not ((out == MASK) | (out == PAD)).any()
    assert len(calls) == steps
    assert (calls[-1][0] == MASK).any() and (shares[-1][1] > 0).any()  # the final step, not a clean-up call


def test_ancestral_unmasks_a_share_of_t_minus_s_over_t(model, monkeypatch):
    """Four steps, t = 1, 3/4, 1/2, 1/4: of the positions still masked, (t − s)/t = 1/4, 1/3, 1/2
    are committed. 1,024 positions; each share within 4 binomial standard errors (≤ 0.09), where
    a share of t − s (1/4 each step) would be 5 and 11 of them off at the second and third."""
    calls = record_decode(model, monkeypatch)
    sample_masked(
        model, images(128), length=8, strategy="ancestral", steps=4, generator=torch.Generator().manual_seed(2)
    )
    still_masked = [int((tokens == MASK).sum()) for tokens, _ in calls]
    assert len(still_masked) == 4 and still_masked[0] == 1024
    for step, (before, after) in enumerate(zip(still_masked, still_masked[1:])):
        kept = 1 - 1 / (4 - step)
        standard_error = math.sqrt(kept * (1 - kept) / before)
        assert abs(after / before - kept) < 4 * standard_error, (step, still_masked)


@pytest.mark.parametrize("k", [1, 3])
def test_confidence_commits_the_k_most_confident_per_step(model, monkeypatch, k):
    calls = record_decode(model, monkeypatch)
    out = sample_masked(model, images(), length=10, strategy="confidence", tokens_per_step=k)
    assert not (out == MASK).any()
    expected_masked = list(range(10, 0, -k))
    assert [int((tokens == MASK).sum(1).unique()) for tokens, _ in calls] == expected_masked
    for (tokens, logits), (after, _) in zip(calls, [*calls[1:], (out, None)]):
        committed = (tokens == MASK) & (after != MASK)
        assert (committed.sum(1) == min(k, int((tokens == MASK).sum(1)[0]))).all()
        assert logits.shape == (int((tokens == MASK).sum()), 49408)  # masked positions alone projected
        conf, best = torch.full(tokens.shape, -1.0), tokens.clone()
        conf[tokens == MASK], best[tokens == MASK] = logits.softmax(-1).max(-1)
        top = conf.topk(int(committed.sum(1)[0]), dim=1).indices
        assert torch.equal(committed, torch.zeros_like(committed).scatter(1, top, True))
        assert torch.equal(after[committed], best[committed])
        assert torch.equal(after[~committed], tokens[~committed])


@pytest.mark.parametrize(
    "steps, seen", [(2, [12, 6]), (4, [12, 10, 8, 6]), (6, [12, 10, 8, 6, 4, 2]), (9, [12, 10, 8, 6, 4, 2])]
)
def test_fixed_schedule_makes_exactly_steps_passes(model, monkeypatch, steps, seen):
    """N' = 6 (2 rows) in min(steps, 6) passes of ⌊6/steps⌋ (at least 1), the last committing the
    rest: no extra pass after it."""
    calls = record_decode(model, monkeypatch)
    out = sample_masked(model, images(), length=6, steps=steps)
    assert not (out == MASK).any()
    assert [int((tokens == MASK).sum()) for tokens, _ in calls] == seen


@pytest.mark.parametrize("strategy", ["ancestral", "confidence"])
def test_infilling_keeps_given_tokens(model, strategy):
    given = torch.randint(0, 49406, (3, 12), generator=torch.Generator().manual_seed(3))
    holes = torch.rand(3, 12, generator=torch.Generator().manual_seed(4)) < 0.5
    tokens = torch.where(holes, MASK, given)
    tokens[2, 9:] = PAD
    out = sample_masked(
        model, images(3), tokens=tokens, strategy=strategy, temperature=1.0, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(out[tokens != MASK], tokens[tokens != MASK])
    assert not (out == MASK).any()
    assert not (out[tokens == MASK] == PAD).any()


def test_sampler_arguments_are_checked(model):
    with pytest.raises(ValueError, match="caption length"):
        sample_masked(model, images())
    with pytest.raises(ValueError, match="unknown sampler strategy"):
        sample_masked(model, images(), length=4, strategy="beam")


def force_eos(model, monkeypatch, row: int, position: int):
    """Make `row` choose EOS as the token at `position` (0-based, after BOS): the decoder's states
    say which position is read next, the output layer's logits are biased there."""
    hidden_states, project, last = model.hidden_states, model.project, [None]

    def reading(tokens, *args, offset=0, **kwargs):
        last[0] = offset + tokens.shape[1] - 1
        return hidden_states(tokens, *args, offset=offset, **kwargs)

    def biased(states):
        logits = project(states)
        if last[0] == position:
            logits[row, EOS] = 1e4
        return logits

    monkeypatch.setattr(model, "hidden_states", reading)
    monkeypatch.setattr(model, "project", biased)


def test_kv_cache_decoding_matches_full_decoding(model, monkeypatch):
    force_eos(model, monkeypatch, row=0, position=3)
    x = images(3)
    cached = generate_autoregressive(model, x, max_tokens=10, use_cache=True)
    full = generate_autoregressive(model, x, max_tokens=10, use_cache=False)
    assert torch.equal(cached, full)
    assert cached.shape == (3, 10)
    assert (cached[0, 3:] == PAD).all() and not (cached[0, :3] == PAD).any()
    assert not ((cached[1:] == PAD) | (cached[1:] == EOS)).any()


@torch.no_grad()
def test_kv_cache_logits_match_causal_logits(model):
    x = images()
    tokens = torch.randint(0, 49406, (2, 7), generator=torch.Generator().manual_seed(6))
    image_kv = model.image_keys_values(model.encode(x))
    full = model.decode(tokens, image_kv, causal=True)
    cache = [{} for _ in model.blocks]
    steps = [model.decode(tokens[:, i : i + 1], image_kv, cache=cache, offset=i) for i in range(7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ mutation testing (docs/testing.md)


@torch.no_grad()
def test_samplers_compute_on_the_images_device_whatever_torchs_default_device(model):
    """Every tensor the samplers make is made on the images' device: with torch's default device set
    to "meta" they write the same tokens (a tensor made on the default device could not mix with the
    others, or would come back on "meta" with no values)."""
    torch.manual_seed(0)
    ddcap = Captioner("tiny", max_length=12, predict_length=True, null_image=True).eval()
    timed = Captioner("tiny", max_length=12, time_conditioning=True).eval()  # reads t: t's device too
    cdlm = build_model(load_config(None, ["data.max_length=12", "objective.name=cdlm"]), CaptionTokenizer).eval()
    x, seeded = images(), lambda: torch.Generator().manual_seed(7)
    cases = [
        lambda: sample_masked(model, x, length=6, steps=3),
        lambda: sample_masked(model, x, length=6, strategy="ancestral", steps=3, temperature=1.0, generator=seeded()),
        lambda: sample_masked(model, x, length=6, steps=2, schedule="cosine"),
        lambda: sample_masked(ddcap, x, guidance_scale=2.0, threshold=0.5),
        lambda: sample_masked(timed, x, length=6, steps=3),  # and a last pass at t = 0 for the rest
        lambda: generate_autoregressive(model, x, max_tokens=4),
        lambda: generate_autoregressive(model, x, max_tokens=4, use_cache=False),
        lambda: sample_continuous(cdlm, x, length=5, steps=2, generator=seeded()),
        lambda: initial_tokens(model, 2, 3, x.device),
        lambda: placeholder_tokens(2, 3, x.device),
    ]
    for case in cases:
        expected = case()
        with torch.device("meta"):
            value = case()
        assert value.device == expected.device and value.dtype == expected.dtype == torch.long
        assert torch.equal(value, expected)


def test_choose_is_the_argmax_at_temperature_zero_and_a_tempered_draw_otherwise():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.5, 1.0]])
    token, prob = _choose(logits, 0.0, None)
    assert token.tolist() == [0, 1]
    by_hand = [
        math.exp(2) / (math.exp(2) + 1 + math.exp(-1)),
        math.exp(1.5) / (math.exp(0.5) + math.exp(1.5) + math.exp(1)),
    ]
    assert prob.tolist() == pytest.approx(by_hand, rel=1e-6)
    # temperature 0.5: a draw from softmax(logits / 0.5) by the generator, with that token's probability
    rows = logits.repeat(100, 1)
    token, prob = _choose(rows, 0.5, torch.Generator().manual_seed(8))
    tempered = torch.tensor([[math.exp(2 * v) for v in row] for row in logits.tolist()]).repeat(100, 1)
    tempered /= tempered.sum(-1, keepdim=True)
    assert torch.equal(token, torch.multinomial(tempered, 1, generator=torch.Generator().manual_seed(8))[:, 0])
    torch.testing.assert_close(prob, tempered.gather(-1, token[:, None])[:, 0])
    assert len(token.unique()) == 3  # 200 draws: every token comes up


def test_commit_counts_of_each_schedule_by_hand():
    """Per pass s of S = 4, N' = 10: cosine commits all but ⌊10·cos(π/2·(s+1)/4)⌋ = 9, 7, 3, 0 (so
    1, 2, 4, 3), and at least one; linear ⌈left / passes left⌉ = 3, 3, 2, 2; fixed its k."""
    total = torch.tensor([10, 2])
    left, cosine = total.clone(), []
    for step in range(4):
        count = _commit_count(left, total, step, 4, "cosine", 1)
        assert count.shape == (2, 1)
        cosine.append(count[:, 0].tolist())
        left = (left - count[:, 0]).clamp(min=0)
    # the 2-token row: ⌊2·cos⌋ = 1, 1, 0, 0 stay, so 1, then at least 1 when none is due
    assert cosine == [[1, 1], [2, 1], [4, 1], [3, 1]]
    left, linear = total.clone(), []
    for step in range(4):
        count = _commit_count(left, total, step, 4, "linear", 1)[:, 0]
        linear.append(count.tolist())
        left = (left - count).clamp(min=0)
    assert linear == [[3, 1], [3, 1], [2, 0], [2, 0]]
    assert _commit_count(total, total, 0, 4, "fixed", 3).tolist() == [[3], [3]]
    with pytest.raises(ValueError, match=r"unknown schedule 'square' \(fixed \| linear \| cosine\)"):
        _commit_count(total, total, 0, 4, "square", 1)


def test_decoding_labels():
    assert Decoding().label() == "confidence"
    assert Decoding(steps=3).label() == "confidence×3"
    assert Decoding(sampler="ancestral", steps=4).label() == "ancestral×4"
    assert Decoding(schedule="cosine", steps=3).label() == "cosine×3"
    assert Decoding(schedule="linear").label() == "linear"
    assert Decoding(threshold=0.9, steps=3).label() == "threshold 0.9"
    assert Decoding(guidance_scale=1.5).label() == "confidence s=1.5"
    assert Decoding(steps=2, guidance_scale=3.0).label() == "confidence×2 s=3"


def record_autoregressive(model, monkeypatch):
    """Wrap hidden_states and project; returns ([(tokens fed, offset)], [logits of each pass])."""
    fed, logits, hidden_states, project = [], [], model.hidden_states, model.project

    def reading(tokens, *args, offset=0, **kwargs):
        fed.append((tokens.shape[1], offset))
        return hidden_states(tokens, *args, offset=offset, **kwargs)

    def projecting(states):
        logits.append(project(states))
        return logits[-1]

    monkeypatch.setattr(model, "hidden_states", reading)
    monkeypatch.setattr(model, "project", projecting)
    return fed, logits


def test_greedy_decoding_by_default_feeds_one_token_a_pass_up_to_the_longest_caption(model, monkeypatch):
    """Defaults: the KV cache (each pass feeds the newest token alone, at its offset) and as many
    tokens as the model has caption positions (12: the position table holds BOS and 12 more)."""
    fed, _ = record_autoregressive(model, monkeypatch)
    out = generate_autoregressive(model, images())
    assert out.shape == (2, 12) and not ((out == PAD) | (out == EOS)).any()
    assert fed == [(1, i) for i in range(12)]


def test_uncached_decoding_reads_the_prefix_causally(model, monkeypatch):
    """Re-reading the whole prefix gives each pass the logits the cache gives (causal attention:
    a bidirectional re-read would change them by ~0.16)."""
    _, logits = record_autoregressive(model, monkeypatch)
    cached = generate_autoregressive(model, images(), max_tokens=5)
    cached_logits = list(logits)
    logits.clear()
    assert torch.equal(generate_autoregressive(model, images(), max_tokens=5, use_cache=False), cached)
    assert len(logits) == len(cached_logits) == 5
    for full, step in zip(logits, cached_logits):
        torch.testing.assert_close(full, step, rtol=1e-4, atol=1e-4)


def test_decoding_stops_once_every_caption_has_ended_and_pads_the_rest(model, monkeypatch):
    force_eos(model, monkeypatch, row=slice(None), position=2)  # both rows end at their third token
    passes, hidden_states = [], model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda *a, **k: passes.append(1) or hidden_states(*a, **k))
    out = generate_autoregressive(model, images(), max_tokens=8)
    assert len(passes) == 3  # no pass after both have ended
    assert out.shape == (2, 8) and (out[:, 2:] == PAD).all() and not (out[:, :2] == PAD).any()


class Bare:
    """A masked model with neither of DDCap's attributes (no `length_head`, no `null_image`)."""

    mask_id, pad_id = MASK, PAD

    def encode(self, images):
        return images

    def image_keys_values(self, features):
        return features


def test_sampler_errors_say_what_is_missing(model):
    no_length = r"^give a caption length N' or tokens to infill \(or train a length head\)$"
    no_null = r"^guidance needs a model trained image-free \(objective\.image_free_prob > 0\)$"
    for m in (model, Bare()):
        with pytest.raises(ValueError, match=no_length):
            sample_masked(m, images())
        with pytest.raises(ValueError, match=no_null):
            sample_masked(m, images(), length=4, guidance_scale=2.0)


@torch.no_grad()
def test_the_length_head_reads_the_pooled_image_features():
    torch.manual_seed(0)
    ddcap, pooled = Captioner("tiny", max_length=12, predict_length=True).eval(), []

    class Recording(torch.nn.Module):
        def forward(self, features):
            pooled.append(features)
            return torch.nn.functional.one_hot(torch.tensor([2, 4]), 12).float()  # N' = 3 and 5

    ddcap.length_head = Recording()
    x = images()
    out = sample_masked(ddcap, x)
    assert (out != PAD).sum(1).tolist() == [3, 5]
    torch.testing.assert_close(pooled[0], ddcap.encode(x).mean(1))


def record_t(model, monkeypatch):
    """Wrap model.decode; returns the list of (features, t, where) of every call."""
    calls, decode = [], model.decode

    def recording(tokens, features, *args, t=None, where=None, **kwargs):
        calls.append((features, t, where))
        return decode(tokens, features, *args, t=t, where=where, **kwargs)

    monkeypatch.setattr(model, "decode", recording)
    return calls


@torch.no_grad()
def test_the_decoder_is_told_the_share_still_masked(monkeypatch):
    """t = masked / N' per caption (4 holes and 1 here), guidance's null-image pass included, and
    with `steps` given, the last pass (which commits the rest) is told the share still masked too."""
    torch.manual_seed(0)
    guided = Captioner("tiny", max_length=12, null_image=True).eval()
    calls = record_t(guided, monkeypatch)
    tokens = torch.randint(0, 49406, (2, 12), generator=torch.Generator().manual_seed(9))
    tokens[0, [1, 4, 6, 9]], tokens[1, 3] = MASK, MASK
    sample_masked(guided, images(), tokens=tokens, guidance_scale=2.0)
    shares = [[1.0, 1.0], [0.75, 0.0], [0.5, 0.0], [0.25, 0.0]]
    assert len(calls) == 2 * 4
    for (cond, t, where), (null, t_null, where_null), share in zip(calls[::2], calls[1::2], shares):
        assert null is not cond  # the null image's keys and values
        torch.testing.assert_close(t, torch.tensor(share))
        torch.testing.assert_close(t_null, torch.tensor(share))
        assert torch.equal(where, where_null) and where.sum(1).tolist() == [round(4 * share[0]), int(share[1] > 0)]
    calls.clear()
    sample_masked(guided, images(), tokens=tokens, steps=2)  # 4 and 1 holes in 2 passes: 2 and 1, then the rest
    assert [t.tolist() for _, t, _ in calls] == [[1.0, 1.0], [0.5, 0.0]]


@torch.no_grad()
def test_ancestral_sampling_takes_ceil_n_over_k_passes_by_default(model, monkeypatch):
    calls = record_t(model, monkeypatch)
    generator = torch.Generator().manual_seed(10)
    sample_masked(model, images(16), length=6, strategy="ancestral", tokens_per_step=2, generator=generator)
    assert len(calls) == 3  # ⌈6/2⌉, the last pass committing everything left
    calls.clear()
    sample_masked(model, images(16), length=1, strategy="ancestral", generator=generator)
    assert len(calls) == 1  # one pass from t = 1 to 0 commits all 16


@torch.no_grad()
def test_ancestral_commits_a_position_when_its_uniform_is_below_t_minus_s_over_t(model, monkeypatch):
    """Two passes: the first commits exactly the positions with u < (1 − 1/2)/1, strictly. The seed
    is one whose uniforms hold exactly 0.5 (at row 7, position 1): that position stays masked."""
    seed = 354891
    u = torch.rand(8, 12, generator=torch.Generator().manual_seed(seed))  # the sampler's first draw
    assert u[7, 1] == 0.5
    calls = record_decode(model, monkeypatch)
    sample_masked(
        model, images(8), length=12, strategy="ancestral", steps=2, generator=torch.Generator().manual_seed(seed)
    )
    assert torch.equal(calls[1][0] == MASK, u >= 0.5)


@torch.no_grad()
def test_seeded_sampling_at_temperature_one_is_reproducible(model):
    def run(seed):
        return sample_masked(model, images(), length=8, temperature=1.0, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(11), run(11)) and not torch.equal(run(11), run(12))


@torch.no_grad()
def test_threshold_commits_a_position_exactly_as_probable_as_the_threshold(model, monkeypatch):
    """The threshold set to the first pass's second-highest probability of a row: that position is
    committed with the most probable one (conf ≥ threshold)."""
    import mdc.sampling as sampling

    probs, choose = [], sampling._choose
    monkeypatch.setattr(sampling, "_choose", lambda *a: probs.append(choose(*a)[1]) or choose(*a))
    sample_masked(model, images(1), length=8, steps=1)
    second = probs[0].sort(descending=True).values[1].item()
    assert probs[0].sort(descending=True).values[2].item() < second
    calls = record_decode(model, monkeypatch)
    sample_masked(model, images(1), length=8, threshold=second)
    assert int((calls[1][0] == MASK).sum()) == 8 - 2


@torch.no_grad()
def test_committing_the_rest_at_once_keeps_pads_and_given_tokens(model):
    given = torch.randint(0, 49406, (3, 12), generator=torch.Generator().manual_seed(13))
    tokens = given.clone()
    tokens[:, 2:6] = MASK
    tokens[1, 8:], tokens[2, 6:] = PAD, PAD
    out = sample_masked(model, images(3), tokens=tokens, steps=1)  # one pass, then the other 3 at once
    assert torch.equal(out[tokens != MASK], tokens[tokens != MASK])
    assert not ((out[:, 2:6] == MASK) | (out[:, 2:6] == PAD)).any()
