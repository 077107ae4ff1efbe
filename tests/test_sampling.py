import math

import pytest
import torch

from mdc.models.captioner import Captioner
from mdc.sampling import generate_autoregressive, sample_masked

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
    none after (with 20 positions an early finish is all but impossible at these seeds)."""
    calls = record_decode(model, monkeypatch)
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
    assert (calls[-1][0] == MASK).any()  # the final step, not a clean-up call, committed the rest


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


def test_confidence_with_too_few_steps_commits_the_rest_at_the_end(model, monkeypatch):
    calls = record_decode(model, monkeypatch)
    out = sample_masked(model, images(), length=6, steps=2)
    assert not (out == MASK).any()
    assert [int((tokens == MASK).sum()) for tokens, _ in calls] == [12, 10, 8]


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
