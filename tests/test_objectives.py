import math

import pytest
import torch
from helpers import ConstantNLL, same_under_meta_default_device
from torch import nn

import mdc.objectives.masked as objectives
import mdc.objectives.noise as noise  # where the masked configs draw t (mdc/objectives/sections.py)
import mdc.objectives.positions as positions
from mdc.config import RunConfig, derive
from mdc.objectives.autoregressive import ArObjective, CappaObjective, autoregressive_io, autoregressive_loss
from mdc.objectives.masked import (
    T_MIN,
    BertObjective,
    CmlmObjective,
    MdcObjective,
    mask_tokens,
    masked_diffusion_loss,
    sample_t,
)
from mdc.registry import OBJECTIVES, compute_loss

# A toy vocabulary: words 0..3, then the special ids.
BOS, EOS, MASK, PAD = 4, 5, 6, 7
VOCAB = 8


class StubModel(nn.Module):
    """Returns fixed logits (a (B, L, V) table, or an (L, V) one shared by every row) and records
    what the objective fed it."""

    mask_id, pad_id, bos_id, eos_id = MASK, PAD, BOS, EOS

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.calls = []

    def forward(self, images, tokens, t=None, causal=False, where=None):
        self.calls.append({"tokens": tokens.clone(), "t": t, "causal": causal, "where": where})
        b, n = tokens.shape
        table = self.table if self.table.ndim == 3 else self.table.expand(b, *self.table.shape)
        return table[:, :n] if where is None else table[:, :n][where]


def nll(logits: torch.Tensor, target: int) -> float:
    """−log softmax(logits)[target], in plain Python."""
    values = logits.tolist()
    return -(values[target] - math.log(sum(math.exp(v) for v in values)))


def random_table(*shape, seed=0):
    return torch.randn(*shape, VOCAB, generator=torch.Generator().manual_seed(seed))


TOKENS = torch.tensor([[0, 1, 2, 3, 1], [2, 2, 0, PAD, PAD], [3, 1, PAD, PAD, PAD]])
T = torch.tensor([0.5, 0.8, 0.25])
MASKED = torch.tensor(
    [[True, False, True, True, False], [False, True, False, False, False], [True, True, False, False, False]]
)


@pytest.fixture
def fixed_draws(monkeypatch):
    """t and the mask as chosen above, whatever the objective would have drawn."""
    monkeypatch.setattr(noise, "sample_t", lambda n, *args, **kwargs: T.clone())
    monkeypatch.setattr(
        objectives,
        "mask_tokens",
        lambda tokens, t, mask_id, pad_id, generator=None, force_one=False: (
            torch.where(MASKED, mask_id, tokens),
            MASKED.clone(),
        ),
    )


@pytest.mark.parametrize("every_position", [False, True], ids=["cpu", "accelerator"])
def test_mdc_loss_is_inverse_t_weighted_and_normalised_by_real_tokens(fixed_draws, monkeypatch, every_position):
    """On a CPU only the masked positions are projected; on an accelerator every position (fixed
    shapes: no host sync), the unmasked ones weighted 0. The same loss either way."""
    monkeypatch.setattr(positions, "projects_every_position", lambda device: every_position)
    table = random_table(3, 5)
    model = StubModel(table)
    loss, metrics = masked_diffusion_loss(model, None, TOKENS, MdcObjective())
    expected = (
        sum(nll(table[b, i], int(TOKENS[b, i])) / float(T[b]) for b in range(3) for i in range(5) if MASKED[b, i]) / 10
    )  # 10 non-pad tokens
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["masked_fraction"].item() == pytest.approx(6 / 10)
    call = model.calls[0]
    assert torch.equal(call["tokens"], torch.where(MASKED, MASK, TOKENS))
    assert torch.equal(call["t"], T) and call["causal"] is False
    assert call["where"] is None if every_position else torch.equal(call["where"], MASKED)


def test_mdc_loss_of_a_caption_with_nothing_masked_is_zero(monkeypatch):
    """MDLM: the row masks nothing, adds nothing to the sum, and its tokens still count in the
    normaliser (E[(1/t)·#masked] = N is what makes the estimate unbiased)."""
    masked = MASKED.clone()
    masked[1] = False
    monkeypatch.setattr(noise, "sample_t", lambda n, *args, **kwargs: T.clone())
    monkeypatch.setattr(
        objectives,
        "mask_tokens",
        lambda tokens, t, mask_id, pad_id, generator=None, force_one=False: (
            torch.where(masked, mask_id, tokens),
            masked.clone(),
        ),
    )
    table = random_table(3, 5)
    loss, _ = masked_diffusion_loss(StubModel(table), None, TOKENS, MdcObjective())
    expected = (
        sum(nll(table[b, i], int(TOKENS[b, i])) / float(T[b]) for b in range(3) for i in range(5) if masked[b, i]) / 10
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_mdc_loss_of_a_batch_with_nothing_masked_is_zero_and_differentiable():
    table = random_table(3, 5).requires_grad_()
    loss, metrics = masked_diffusion_loss(
        StubModel(table),
        None,
        TOKENS,
        MdcObjective(omega_l=0.0, omega_u=1e-9),
        generator=torch.Generator().manual_seed(0),
    )
    assert loss.item() == 0.0 and metrics["masked_fraction"].item() == 0.0 and metrics["nll_masked"].item() == 0.0
    loss.backward()
    assert torch.equal(table.grad, torch.zeros_like(table))


@pytest.mark.parametrize("length", [1, 3, 8])
@pytest.mark.parametrize("omega_l, omega_u", [(0.001, 1.0), (0.5, 1.0), (0.0, 1.0)])
def test_mdc_loss_is_an_unbiased_estimate_of_the_elbo(length, omega_l, omega_u):
    """E[loss]/ℓ = 1 whatever the caption length: the mean of 100 seeded batches of 8,192 captions
    is within 4 of its measured standard errors of 1. Enough draws that a 2% bias (a weight of
    1.02/t or 0.98/t) is more than 6 SE away: a caption's (1/t)·#masked/ℓ has variance
    E[(1 − t)/t]/ℓ ≤ ln(1/T_MIN) − 1 ≈ 5.9 (stratified t removes the rest), so over 819,200
    captions the SE is below 0.0027. The forced mask this replaced gave 1.52, 2.68 and 6.87 on
    [0.001, 1]. Batches far larger than training's keep the estimator (unbiased for any batch
    size) and make the draws one call each."""
    batches, rows, ell = 100, 8192, math.log(VOCAB)
    tokens = torch.where(torch.arange(8) < length, 0, PAD).repeat(rows, 1)
    generator = torch.Generator().manual_seed(length)
    uniform = ConstantNLL(VOCAB, mask_id=MASK, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    ratios = torch.stack(
        [
            masked_diffusion_loss(
                uniform, None, tokens, MdcObjective(omega_l=omega_l, omega_u=omega_u), generator=generator
            )[0]
            / ell
            for _ in range(batches)
        ]
    ).double()
    standard_error = (ratios.std() / math.sqrt(batches)).item()
    assert 6 * standard_error < 0.02, standard_error  # a 2% bias cannot hide
    assert abs(ratios.mean().item() - 1.0) < 4 * standard_error, (ratios.mean().item(), standard_error)


def test_sampled_t_never_falls_below_t_min():
    model = StubModel(random_table(3))
    tokens = torch.tensor([[0, 1, 2]] * 64)
    for name in ("mdc", "cmlm"):
        compute_loss(
            model,
            None,
            tokens,
            OBJECTIVES[name].config(omega_l=0.0, omega_u=0.01),
            generator=torch.Generator().manual_seed(11),
        )
        assert (model.calls[-1]["t"] >= T_MIN).all()


@pytest.mark.parametrize("kind", ["cmlm", "bert"])
def test_cmlm_and_bert_are_mean_cross_entropy_over_masked(fixed_draws, kind):
    table = random_table(3, 5)
    objective = {"cmlm": CmlmObjective(), "bert": BertObjective(mask_ratio=0.25)}[kind]
    loss, _ = masked_diffusion_loss(StubModel(table), None, TOKENS, objective)
    terms = [nll(table[b, i], int(TOKENS[b, i])) for b in range(3) for i in range(5) if MASKED[b, i]]
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_bert_uses_the_fixed_ratio(monkeypatch):
    def no_sampling(*args, **kwargs):
        raise AssertionError("bert must not sample t")

    monkeypatch.setattr(noise, "sample_t", no_sampling)
    tokens = torch.randint(0, 4, (500, 40), generator=torch.Generator().manual_seed(1))
    model = StubModel(random_table(40))
    _, metrics = masked_diffusion_loss(
        model, None, tokens, BertObjective(mask_ratio=0.25), generator=torch.Generator().manual_seed(2)
    )
    assert torch.equal(model.calls[0]["t"], torch.full((500,), 0.25))
    assert abs(metrics["masked_fraction"].item() - 0.25) < 0.01


def test_pads_are_never_masked_nor_counted():
    tokens = TOKENS.repeat(50, 1)
    real = tokens != PAD
    noisy, masked = mask_tokens(tokens, torch.ones(len(tokens)), MASK, PAD)
    assert torch.equal(masked, real)
    assert torch.equal(noisy, torch.where(real, MASK, PAD))

    table = random_table(150, 5)
    loud = table.clone()
    loud[~real] = 100.0 * torch.randn(int((~real).sum()), VOCAB)  # wild logits at pad positions
    for kind in ("mdc", "cmlm"):
        losses = [
            masked_diffusion_loss(
                StubModel(tab), None, tokens, OBJECTIVES[kind].config(), generator=torch.Generator().manual_seed(3)
            )[0]
            for tab in (table, loud)
        ]
        assert losses[0].item() == losses[1].item()


def test_mdc_loss_end_to_end_with_drawn_t_and_mask():
    """No patching: the loss must agree with what the model was actually fed."""
    tokens = TOKENS.repeat(4, 1)
    table = random_table(12, 5)
    model = StubModel(table)
    loss, _ = masked_diffusion_loss(
        model, None, tokens, MdcObjective(omega_l=0.3, omega_u=0.9), generator=torch.Generator().manual_seed(4)
    )
    fed, t = model.calls[0]["tokens"], model.calls[0]["t"]
    masked = fed == MASK
    assert ((t >= 0.3) & (t < 0.9)).all()
    assert not (masked & (tokens == PAD)).any()
    expected = sum(
        nll(table[b, i], int(tokens[b, i])) / float(t[b]) for b in range(12) for i in range(5) if masked[b, i]
    ) / int((tokens != PAD).sum())
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_masking_rate_matches_t():
    tokens = torch.zeros(2000, 20, dtype=torch.long)
    t = torch.tensor([0.2, 0.7]).repeat(1000)
    _, masked = mask_tokens(tokens, t, MASK, PAD, generator=torch.Generator().manual_seed(5))
    for value in (0.2, 0.7):
        rate = masked[t == value].float().mean().item()  # 20k tokens each
        assert abs(rate - value) < 0.01


def test_nothing_is_forced_unless_asked():
    tokens = torch.where(torch.arange(5) < torch.tensor([1, 3, 5])[:, None], 2, PAD)
    noisy, masked = mask_tokens(tokens, torch.zeros(3), MASK, PAD, generator=torch.Generator().manual_seed(6))
    assert not masked.any() and torch.equal(noisy, tokens)


def test_cmlm_and_bert_get_a_forced_mask_and_mdc_does_not(monkeypatch):
    forced = []
    real_mask_tokens = objectives.mask_tokens
    monkeypatch.setattr(
        objectives,
        "mask_tokens",
        lambda *args, force_one=False, **kwargs: (
            forced.append(force_one) or real_mask_tokens(*args, force_one=force_one, **kwargs)
        ),
    )
    for kind in ("mdc", "cmlm", "bert"):
        masked_diffusion_loss(
            StubModel(random_table(3)), None, torch.tensor([[0, 1, 2]] * 4), OBJECTIVES[kind].config()
        )
    assert forced == [False, True, True]


def test_a_row_with_nothing_masked_gets_one_forced_mask():
    lengths = torch.tensor([1, 3, 5, 0]).repeat(1000)
    tokens = torch.where(torch.arange(5) < lengths[:, None], 2, PAD)
    noisy, masked = mask_tokens(
        tokens, torch.zeros(len(tokens)), MASK, PAD, generator=torch.Generator().manual_seed(6), force_one=True
    )
    assert torch.equal(masked.sum(1), (lengths > 0).long())
    assert not (masked & (tokens == PAD)).any()
    assert torch.equal(noisy == MASK, masked)
    # the forced position is uniform over the real tokens
    counts = masked[lengths == 5].sum(0)
    assert ((counts - 200).abs() < 60).all(), counts


@pytest.mark.parametrize("n, lo, hi", [(8, 0.5, 1.0), (5, 0.0, 1.0), (3, 0.2, 0.4)])
def test_antithetic_t_falls_one_per_stratum(n, lo, hi):
    for seed in range(20):
        t = sample_t(n, lo, hi, antithetic=True, generator=torch.Generator().manual_seed(seed))
        stratum = torch.floor((t - lo) / (hi - lo) * n).long()
        assert torch.equal(stratum, torch.arange(n))


def test_plain_t_is_uniform_in_the_interval():
    t = sample_t(20000, 0.5, 1.0, antithetic=False, generator=torch.Generator().manual_seed(7))
    assert ((t >= 0.5) & (t < 1.0)).all()
    assert abs(t.mean().item() - 0.75) < 0.01
    assert abs(t.var().item() - 0.25**2 / 3) < 0.002


def test_autoregressive_io_shifts_right_and_appends_eos():
    tokens = torch.tensor([[0, 1, 2, PAD, PAD], [3, PAD, PAD, PAD, PAD], [0, 1, 2, 3, 0]])
    inputs, targets = autoregressive_io(tokens, BOS, EOS, PAD)
    assert inputs.tolist() == [[BOS, 0, 1, 2, PAD, PAD], [BOS, 3, PAD, PAD, PAD, PAD], [BOS, 0, 1, 2, 3, 0]]
    assert targets.tolist() == [[0, 1, 2, EOS, PAD, PAD], [3, EOS, PAD, PAD, PAD, PAD], [0, 1, 2, 3, 0, EOS]]


@pytest.mark.parametrize("every_position", [False, True], ids=["cpu", "accelerator"])
def test_cap_loss_is_mean_cross_entropy_over_targets(monkeypatch, every_position):
    monkeypatch.setattr(positions, "projects_every_position", lambda device: every_position)
    tokens = torch.tensor([[0, 1, 2, PAD], [3, 3, PAD, PAD]])
    table = random_table(2, 5)
    model = StubModel(table)
    loss, metrics = autoregressive_loss(model, None, tokens, ArObjective())
    _, targets = autoregressive_io(tokens, BOS, EOS, PAD)
    terms = [nll(table[b, i], int(targets[b, i])) for b in range(2) for i in range(5) if targets[b, i] != PAD]
    assert len(terms) == 4 + 3
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert metrics["parallel_fraction"].item() == 0.0
    call = model.calls[0]
    assert call["causal"].tolist() == [True, True]
    assert call["tokens"].tolist() == [[BOS, 0, 1, 2, PAD], [BOS, 3, 3, PAD, PAD]]
    assert call["where"] is None if every_position else torch.equal(call["where"], targets != PAD)


def test_cappa_parallel_rows_are_all_mask_pads_included_and_bidirectional():
    lengths = torch.randint(1, 7, (4000,), generator=torch.Generator().manual_seed(8))
    tokens = torch.where(torch.arange(6) < lengths[:, None], 1, PAD)
    model = StubModel(random_table(7))
    _, metrics = autoregressive_loss(
        model, None, tokens, CappaObjective(parallel_prob=0.75), generator=torch.Generator().manual_seed(9)
    )
    fed, causal = model.calls[0]["tokens"], model.calls[0]["causal"]
    parallel = ~causal
    assert abs(parallel.float().mean().item() - 0.75) < 0.02
    assert metrics["parallel_fraction"].item() == pytest.approx(parallel.float().mean().item())
    inputs, _ = autoregressive_io(tokens, BOS, EOS, PAD)
    assert torch.equal(fed[causal], inputs[causal])
    assert (fed[parallel] == MASK).all()  # the input does not reveal the caption's length


@pytest.mark.parametrize("name, parallel_share", [("ar", 0.0), ("cappa", 1.0)])
def test_compute_loss_dispatches_autoregressive(name, parallel_share):
    model = StubModel(random_table(4))
    tokens = torch.tensor([[0, 1, PAD]] * 10)
    compute_loss(model, None, tokens, {"ar": ArObjective(), "cappa": CappaObjective(parallel_prob=1.0)}[name])
    assert (~model.calls[0]["causal"]).float().mean().item() == parallel_share


@pytest.mark.parametrize("name", ["mdc", "cmlm", "bert"])
def test_compute_loss_dispatches_masked_diffusion(name):
    model = StubModel(random_table(3))
    tokens = torch.tensor([[0, 1, 2]] * 16)
    objective = BertObjective(mask_ratio=0.4) if name == "bert" else OBJECTIVES[name].config(omega_l=0.6, omega_u=0.8)
    compute_loss(model, None, tokens, objective, generator=torch.Generator().manual_seed(10))
    t, causal = model.calls[0]["t"], model.calls[0]["causal"]
    assert causal is False
    if name == "bert":
        assert (t == 0.4).all()
    else:
        assert ((t >= 0.6) & (t < 0.8)).all()
        strata = torch.floor((t - 0.6) / 0.2 * 16).long()
        assert torch.equal(strata, torch.arange(16))  # antithetic is on by default


@torch.no_grad()
def test_cappa_parallel_prediction_does_not_see_the_caption_length():
    """big_vision's CapPa: a 3- and a 7-token caption of the same image get the same position-0
    logits in parallel mode (the pad-hiding input this replaced differed by 0.22)."""
    from mdc.models.captioner import Captioner

    torch.manual_seed(0)
    model = Captioner("tiny", max_length=8).eval()
    tokens = torch.randint(0, 49406, (2, 8), generator=torch.Generator().manual_seed(1))
    tokens[0, 3:], tokens[1, 7:] = model.pad_id, model.pad_id
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)).expand(2, -1, -1, -1)
    seen = {}

    class Recorder(nn.Module):
        mask_id, pad_id, bos_id, eos_id = model.mask_id, model.pad_id, model.bos_id, model.eos_id

        def forward(self, images, inputs, t=None, causal=False, where=None):
            seen["logits"] = model(images, inputs, causal=causal)
            return seen["logits"][where]

    autoregressive_loss(Recorder(), image, tokens, CappaObjective(parallel_prob=1.0))
    words = seen["logits"][:, 0, : model.mask_id]  # [MASK] and pad are −∞ in both
    assert torch.equal(words[0], words[1])


# ------------------------------------------------------------------ mutation testing (docs/testing.md)


class DDCapStub(StubModel):
    """StubModel with DDCap's switches: it takes `image_free` and, asked for it, returns the fixed
    (B, max_length) `length_table` beside the token logits; it records the images it was given."""

    def __init__(self, table: torch.Tensor, length_table: torch.Tensor | None = None):
        super().__init__(table)
        self.length_head = None if length_table is None else nn.Identity()  # only its presence is read
        self.length_table = length_table

    def forward(self, images, tokens, t=None, causal=False, where=None, image_free=None, return_length=False):
        logits = super().forward(images, tokens, t=t, causal=causal, where=where)
        self.calls[-1].update(images=images, image_free=image_free, return_length=return_length)
        return (logits, self.length_table) if return_length else logits


@pytest.mark.parametrize("kind", ["mdc", "cmlm", "bert"])
def test_masked_loss_defaults_are_the_objective_configs(kind):
    """A config class's defaults are the objective a run config switched to it trains with: t
    stratified over [0.5, 1) for MDC and CMLM, the fixed 15% for BERT."""
    tokens = torch.tensor([[0, 1, 2, 3]] * 16)
    plain, configured = StubModel(random_table(4)), StubModel(random_table(4))
    loss, _ = masked_diffusion_loss(
        plain, None, tokens, OBJECTIVES[kind].config(), generator=torch.Generator().manual_seed(12)
    )
    expected, _ = compute_loss(
        configured,
        None,
        tokens,
        derive(RunConfig(), {"objective.name": kind}).objective,
        generator=torch.Generator().manual_seed(12),
    )
    assert loss.item() == expected.item()
    t = plain.calls[0]["t"]
    assert torch.equal(t, configured.calls[0]["t"])
    if kind == "bert":
        assert (t == 0.15).all()
    else:
        assert torch.equal(torch.floor((t - 0.5) / 0.5 * 16).long(), torch.arange(16))


def test_sample_t_is_antithetic_by_default():
    t = sample_t(8, 0.0, 1.0, generator=torch.Generator().manual_seed(13))
    assert torch.equal(torch.floor(t * 8).long(), torch.arange(8))
    assert torch.equal(t, sample_t(8, 0.0, 1.0, True, generator=torch.Generator().manual_seed(13)))


def test_a_position_is_masked_exactly_when_its_uniform_is_below_t():
    """Masked iff u_i < t, strictly: P(masked) = t on float32's grid of uniforms, so t = 0 masks
    nothing. Each row's t is set to one of its own uniforms, which must stay unmasked."""
    tokens = torch.tensor([[0, 1, 2, 3, 1, 2]] * 4)
    u = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(14))  # the draw mask_tokens makes
    t = u[torch.arange(4), torch.arange(4)]
    _, masked = mask_tokens(tokens, t, MASK, PAD, generator=torch.Generator().manual_seed(14))
    assert torch.equal(masked, u < t[:, None])
    assert not masked[torch.arange(4), torch.arange(4)].any()


def test_only_the_rows_with_nothing_masked_get_a_forced_mask():
    tokens = torch.tensor([[0, 1, 2, 3, PAD]] * 4)
    noisy, masked = mask_tokens(
        tokens,
        torch.tensor([1.0, 0.0, 1.0, 0.0]),
        MASK,
        PAD,
        generator=torch.Generator().manual_seed(15),
        force_one=True,
    )
    assert masked.sum(1).tolist() == [4, 1, 4, 1]
    assert not masked[:, 4].any() and torch.equal(noisy == MASK, masked)


def test_nll_masked_is_the_mean_nll_over_masked_tokens(monkeypatch):
    table = random_table(3, 5)
    for mask in (MASKED, torch.zeros_like(MASKED).index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(True))):
        monkeypatch.setattr(noise, "sample_t", lambda n, *args, **kwargs: T.clone())
        monkeypatch.setattr(
            objectives,
            "mask_tokens",
            lambda tokens, t, mask_id, pad_id, generator=None, force_one=False, mask=mask: (
                torch.where(mask, mask_id, tokens),
                mask.clone(),
            ),
        )
        _, metrics = masked_diffusion_loss(StubModel(table), None, TOKENS, MdcObjective())
        terms = [nll(table[b, i], int(TOKENS[b, i])) for b in range(3) for i in range(5) if mask[b, i]]
        assert len(terms) == int(mask.sum())  # 6, then 1
        assert metrics["nll_masked"].item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_image_free_captions_are_the_generators_draws_below_the_share():
    """Image-free rows: u < p for the generator's next b uniforms after t and the mask (a seeded step
    is reproducible), strictly (p = 0.0 would drop none). p is set to one of those very uniforms."""
    tokens = torch.tensor([[0, 1, 2, 3]] * 64)
    replay = torch.Generator().manual_seed(16)
    sample_t(64, 0.5, 1.0, True, replay)
    torch.rand(tokens.shape, generator=replay)
    u = torch.rand(64, generator=replay)
    share = u[u < 0.5].max().item()  # the largest uniform under 1/2: its row is not image-free
    model = DDCapStub(random_table(4))
    images = torch.zeros(64, 1)
    _, metrics = masked_diffusion_loss(
        model,
        images,
        tokens,
        MdcObjective(omega_l=0.5, omega_u=1.0, image_free_prob=share),
        generator=torch.Generator().manual_seed(16),
    )
    call = model.calls[0]
    assert call["images"] is images and call["return_length"] is False
    assert torch.equal(call["image_free"], u < share)
    assert metrics["image_free_fraction"].item() == (u < share).float().mean().item()
    assert 0 < metrics["image_free_fraction"].item() < 1


def test_the_length_cross_entropy_is_added_and_reported(fixed_draws):
    """With a length head the loss is the ELBO plus CE(length logits, N − 1) over the captions (N =
    5, 3 and 2 non-pad tokens, by hand)."""
    table, lengths = random_table(3, 5), random_table(3, 6, seed=1)[..., 0]
    model = DDCapStub(table, length_table=lengths)
    images = torch.zeros(3, 1)
    loss, metrics = masked_diffusion_loss(model, images, TOKENS, MdcObjective())
    elbo = (
        sum(nll(table[b, i], int(TOKENS[b, i])) / float(T[b]) for b in range(3) for i in range(5) if MASKED[b, i]) / 10
    )
    length_ce = sum(nll(lengths[b], n - 1) for b, n in enumerate([5, 3, 2])) / 3
    assert metrics["length_ce"].item() == pytest.approx(length_ce, rel=1e-5)
    assert loss.item() == pytest.approx(elbo + length_ce, rel=1e-5)
    call = model.calls[0]
    assert call["return_length"] is True and call["image_free"] is None and call["images"] is images
    assert "image_free_fraction" not in metrics


def test_objectives_compute_on_the_tokens_device_whatever_torchs_default_device():
    """Every tensor the objectives make is made on the tokens' device: with torch's default device
    set to "meta" they give the same values (a tensor made on the default device could not mix with
    the others, or would come back on "meta" with no values)."""
    tokens = torch.tensor([[0, 1, 2, PAD], [3, 3, 1, 2]] * 8)
    table, ar_table, lengths, t = random_table(4), random_table(5), random_table(16, 4)[..., 0], torch.full((16,), 0.5)
    cases = [
        lambda: masked_diffusion_loss(
            DDCapStub(table, lengths),
            None,
            tokens,
            MdcObjective(image_free_prob=0.5),
            generator=torch.Generator().manual_seed(17),
        ),
        lambda: masked_diffusion_loss(
            StubModel(table), None, tokens, BertObjective(), generator=torch.Generator().manual_seed(17)
        ),
        lambda: autoregressive_loss(
            StubModel(ar_table), None, tokens, CappaObjective(parallel_prob=0.5), torch.Generator().manual_seed(17)
        ),
        lambda: autoregressive_io(tokens, BOS, EOS, PAD),
        lambda: sample_t(4, 0.2, 0.6, True, torch.Generator().manual_seed(17), tokens.device),
        lambda: sample_t(4, 0.2, 0.6, False, torch.Generator().manual_seed(17), tokens.device),
        lambda: mask_tokens(tokens, t, MASK, PAD, torch.Generator().manual_seed(17)),
    ]
    same_under_meta_default_device(cases)


def test_teacher_forcing_keeps_the_tokens_dtype():
    inputs, targets = autoregressive_io(torch.tensor([[0, 1, PAD]], dtype=torch.int32), BOS, EOS, PAD)
    assert inputs.dtype == targets.dtype == torch.int32
    assert inputs.tolist() == [[BOS, 0, 1, PAD]] and targets.tolist() == [[0, 1, EOS, PAD]]


def test_cappa_parallel_rows_are_the_generators_draws_below_the_share():
    """Parallel rows: u < p for the generator's first b uniforms, strictly; p is one of them."""
    tokens = torch.tensor([[0, 1, PAD]] * 64)
    u = torch.rand(64, generator=torch.Generator().manual_seed(18))
    share = u[u < 0.5].max().item()
    model = StubModel(random_table(4))
    _, metrics = autoregressive_loss(
        model, None, tokens, CappaObjective(parallel_prob=share), torch.Generator().manual_seed(18)
    )
    assert torch.equal(~model.calls[0]["causal"], u < share)
    assert metrics["parallel_fraction"].item() == (u < share).float().mean().item()
