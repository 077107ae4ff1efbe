import math

import pytest
import torch
from helpers import ConstantNLL, same_under_meta_default_device

from mdc.config import load_config
from mdc.data.tokenizer import CaptionTokenizer
from mdc.models.captioner import Captioner
from mdc.objectives.masked import T_MIN
from mdc.registry import build_model
from mdc.scoring import (
    autoregressive_score,
    cosine_scores,
    denoising_scores,
    monte_carlo_elbo,
    pseudo_log_likelihood,
)

MASK, PAD, BOS, EOS = 49408, 49409, 49406, 49407


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Captioner("tiny", max_length=8).eval()


def images(b=2, seed=0):
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def captions(seed=1):
    tokens = torch.randint(0, 49406, (3, 8), generator=torch.Generator().manual_seed(seed))
    tokens[1, 5:] = PAD
    tokens[2, 2:] = PAD
    return tokens


def log_prob(logits: torch.Tensor, token: int) -> float:
    return logits.log_softmax(-1)[token].item()


@torch.no_grad()
def test_autoregressive_score_is_the_sum_of_next_token_log_probs(model):
    """By hand: feed each prefix alone and read the next token off its end."""
    x, tokens = images(3), captions()
    score = autoregressive_score(model, x, tokens)
    for b in range(3):
        caption = [int(c) for c in tokens[b] if c != PAD]
        expected = 0.0
        for j, target in enumerate([*caption, EOS]):
            prefix = torch.tensor([[BOS, *caption[:j]]])
            expected += log_prob(model(x[b : b + 1], prefix, causal=True)[0, -1], target)
        assert score[b].item() == pytest.approx(expected, rel=1e-4)


@torch.no_grad()
def test_pseudo_log_likelihood_matches_a_hand_loop(model):
    x, tokens = images(3), captions()
    pll = pseudo_log_likelihood(model, x, tokens)
    for b in range(3):
        caption = [int(c) for c in tokens[b] if c != PAD]
        expected = 0.0
        for i, target in enumerate(caption):
            noisy = torch.tensor([caption[:i] + [MASK] + caption[i + 1 :]])
            expected += log_prob(model(x[b : b + 1], noisy)[0, i], target)
        assert pll[b].item() == pytest.approx(expected, rel=1e-4)


@torch.no_grad()
def test_monte_carlo_elbo_matches_a_hand_estimate(model):
    x, tokens = images(3), captions()
    k, lo, hi = 5, 0.2, 0.9
    (estimate,) = monte_carlo_elbo(
        model, x, [tokens], num_samples=k, omega_l=lo, omega_u=hi, generator=torch.Generator().manual_seed(2)
    )
    # the same draws: one t per stratum of [lo, hi] for each of the k samples, then the uniforms
    g = torch.Generator().manual_seed(2)
    t = lo + (hi - lo) * (torch.arange(k)[:, None] + torch.rand(k, 3, generator=g)) / k
    u = torch.rand(k, 3, 8, generator=g)
    for b in range(3):
        total = 0.0
        for s in range(k):
            masked = [i for i in range(8) if tokens[b, i] != PAD and u[s, b, i] < t[s, b]]
            noisy = tokens[b : b + 1].clone()
            noisy[0, masked] = MASK
            logits = model(x[b : b + 1], noisy)[0]
            total += sum(log_prob(logits[i], int(tokens[b, i])) for i in masked) / t[s, b].item()
        assert estimate[b].item() == pytest.approx(total / k, rel=1e-4, abs=1e-4)


@torch.no_grad()
def test_monte_carlo_elbo_shares_draws_across_lengths(model):
    """A candidate given with extra pad columns sees the same t and mask: the same estimate."""
    x, tokens = images(3), captions()
    short = tokens[:, :6].clone()
    short[0, 5] = PAD
    padded = torch.cat([short, torch.full((3, 2), PAD)], dim=1)
    a, b = monte_carlo_elbo(model, x, [short, padded], num_samples=4, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_common_random_numbers_lower_the_variance_of_differences(model):
    x, tokens = images(3), captions()
    rival = tokens.clone()
    rival[:, 0], rival[:, 1] = tokens[:, 1], tokens[:, 0]  # a swapped twin of the same length

    def differences(crn: bool) -> torch.Tensor:
        diffs = []
        for seed in range(30):
            a, b = monte_carlo_elbo(
                model,
                x,
                [tokens, rival],
                num_samples=2,
                common_random_numbers=crn,
                generator=torch.Generator().manual_seed(seed),
            )
            diffs.append(a - b)
        return torch.stack(diffs)

    var_crn, var_indep = differences(True).var(0), differences(False).var(0)
    assert (var_crn < var_indep / 10).all(), (var_crn, var_indep)


@pytest.mark.parametrize("length", [1, 3, 8])
@pytest.mark.parametrize("omega_l", [0.0, 0.5])
def test_monte_carlo_elbo_is_unbiased_for_every_caption_length(length, omega_l):
    """150,000 captions' estimates (8 draws each) over the true log-likelihood: their mean is within
    4 of its measured standard errors of 1. Enough captions that a 2% bias (a weight of 1.02/t or
    0.98/t) is more than 6 SE away: one estimate's variance is E[(1 − t)/t]/(8ℓ) ≈ (ln(1/T_MIN) − 1)/8
    ≈ 0.74 for ℓ = 1 (stratified t), measured up to 1.0 (1/t's heavy tail), an SE up to 0.0026.
    ω_l = 0 is clamped to T_MIN."""
    model, rows = ConstantNLL(16, mask_id=MASK, pad_id=PAD, bos_id=BOS, eos_id=EOS), 150_000
    tokens = torch.where(torch.arange(8) < length, 0, PAD).repeat(rows, 1)
    truth = -length * math.log(model.vocab)
    generator = torch.Generator().manual_seed(length)
    estimates = monte_carlo_elbo(
        model, torch.zeros(rows, 1), [tokens], num_samples=8, omega_l=omega_l, generator=generator
    )
    ratios = (estimates[0] / truth).double()
    standard_error = (ratios.std() / math.sqrt(rows)).item()
    assert 6 * standard_error < 0.02, standard_error  # a 2% bias cannot hide
    assert abs(ratios.mean().item() - 1.0) < 4 * standard_error, (ratios.mean().item(), standard_error)


# ------------------------------------------------------------------ mutation testing (docs/testing.md)


def built(*overrides):
    torch.manual_seed(0)
    return build_model(load_config(None, ["data.max_length=8", *overrides]), CaptionTokenizer).eval()


@torch.no_grad()
def test_scorers_compute_on_the_inputs_device_whatever_torchs_default_device(model):
    """Every tensor the scorers make is made on the device of the images or captions: with torch's
    default device set to "meta" they give the same scores (a tensor made on the default device
    could not mix with the others, or would come back on "meta" with no values)."""
    cdlm, clip = built("objective.name=cdlm"), built("objective.name=clip")
    x, tokens = images(3), captions()
    cases = [
        lambda: autoregressive_score(model, x, tokens),
        lambda: pseudo_log_likelihood(model, x, tokens),
        lambda: monte_carlo_elbo(model, x, [tokens, tokens[:, :5]], 2, generator=torch.Generator().manual_seed(4)),
        lambda: monte_carlo_elbo(
            model, x, [tokens], 2, common_random_numbers=False, generator=torch.Generator().manual_seed(4)
        ),
        lambda: denoising_scores(cdlm, x, [tokens, tokens[:, :5]], 2, generator=torch.Generator().manual_seed(4)),
        lambda: cosine_scores(clip, x, [tokens, tokens.flip(0)]),
    ]
    same_under_meta_default_device(cases)


def record_decode(model, monkeypatch):
    """Wrap model.decode; returns the list of (t, where) of every call."""
    calls, decode = [], model.decode

    def recording(tokens, features, t=None, where=None, **kwargs):
        calls.append((t, where))
        return decode(tokens, features, t=t, where=where, **kwargs)

    monkeypatch.setattr(model, "decode", recording)
    return calls


@torch.no_grad()
def test_pseudo_log_likelihood_tells_the_decoder_t_is_one_over_n_and_stops_at_the_last_token(model, monkeypatch):
    """One pass per position up to the longest caption (6 of 8 columns here), each at the noise level
    of one masked token in N, t = 1/N (N = 6, 5, 1), and the sum of the hand loop's log-probs."""
    calls = record_decode(model, monkeypatch)
    x, tokens = images(3), captions()
    tokens[:, 6:], tokens[1, 5:], tokens[2, 1:] = PAD, PAD, PAD
    pll = pseudo_log_likelihood(model, x, tokens)
    assert len(calls) == 6
    for i, (t, where) in enumerate(calls):
        torch.testing.assert_close(t, torch.tensor([1 / 6, 1 / 5, 1.0]))
        assert where.sum(1).tolist() == [1, int(i < 5), int(i < 1)] and where[:, i].sum() == where.sum()
    for b, n in enumerate([6, 5, 1]):
        caption = tokens[b, :n].tolist()
        expected = sum(
            log_prob(model(x[b : b + 1], torch.tensor([caption[:i] + [MASK] + caption[i + 1 :]]))[0, i], caption[i])
            for i in range(n)
        )
        assert pll[b].item() == pytest.approx(expected, rel=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("crn", [True, False])
def test_monte_carlo_elbo_tells_the_decoder_each_draws_t_and_mask(model, monkeypatch, crn):
    """16 draws by default. With common random numbers both candidates see the generator's first
    draw of (t, u); without, each candidate its own draw, in turn. Each pass is told its t and
    masks exactly the real positions with u < t."""
    calls = record_decode(model, monkeypatch)
    x, tokens = images(3), captions()
    rival = tokens.flip(1)
    monte_carlo_elbo(model, x, [tokens, rival], common_random_numbers=crn, generator=torch.Generator().manual_seed(5))
    assert len(calls) == 2 * 16
    replay = torch.Generator().manual_seed(5)
    for c, candidate in enumerate([tokens, rival]):
        if c == 0 or not crn:
            t_all = T_MIN + (1 - T_MIN) * (torch.arange(16)[:, None] + torch.rand(16, 3, generator=replay)) / 16
            u_all = torch.rand(16, 3, 8, generator=replay)
        for k, (t, where) in enumerate(calls[16 * c : 16 * (c + 1)]):
            torch.testing.assert_close(t, t_all[k])
            assert torch.equal(where, (u_all[k] < t_all[k][:, None]) & (candidate != PAD))


@torch.no_grad()
def test_monte_carlo_elbo_masks_a_position_only_when_its_uniform_is_below_t(model, monkeypatch):
    """t pinned (ω_l = ω_u = v) to one of the uniforms the mask is drawn with: that position stays
    unmasked (u < t, strictly: P(masked) = t)."""
    calls = record_decode(model, monkeypatch)
    x, tokens = images(3), captions()
    replay = torch.Generator().manual_seed(6)
    torch.rand(1, 3, generator=replay)
    u = torch.rand(1, 3, 8, generator=replay)[0]
    v = u[0, 3].item()
    monte_carlo_elbo(model, x, [tokens], 1, omega_l=v, omega_u=v, generator=torch.Generator().manual_seed(6))
    (t, where) = calls[0]
    assert (t == v).all() and not where[0, 3]
    assert torch.equal(where, (u < v) & (tokens != PAD))


@torch.no_grad()
def test_denoising_scores_average_sixteen_stratified_draws_by_default(monkeypatch):
    cdlm, seen = built("objective.name=cdlm"), []
    predict = cdlm.predict_x0
    monkeypatch.setattr(
        cdlm, "predict_x0", lambda tokens, image, t, x_t: seen.append(t) or predict(tokens, image, t, x_t)
    )
    denoising_scores(cdlm, images(3), [captions()], generator=torch.Generator().manual_seed(7))
    assert len(seen) == 16
    for k, t in enumerate(seen):  # draw k in its stratum [k/16, (k+1)/16) for every caption
        assert (torch.floor(t * 16) == k).all()
