"""The objective registry is the one place that says what an objective is: the config accepts exactly
its names, and every entry's model, loss, validation objective, scorer and caption writer work
together on a tiny batch."""

import math
from typing import get_args

import pytest
import torch

from mdc.config import ConfigError, RunConfig, load_config
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation import compositionality as comp
from mdc.objectives.autoregressive import ArObjective, CappaObjective
from mdc.objectives.clip import ClipObjective
from mdc.objectives.masked import T_MIN, BertObjective, CmlmObjective, MdcObjective
from mdc.registry import MASKED_OBJECTIVES, OBJECTIVES, build_model, compute_loss, write_captions
from pipelines.worker.validator import validation_objective

MASK = 49408


def batch():
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(3, 3, 32, 32, generator=g)
    tokens = torch.randint(0, 49406, (3, 8), generator=g)
    tokens[1, 5:] = CaptionTokenizer.pad_id
    tokens[2, 2:] = CaptionTokenizer.pad_id
    return pixels, tokens


def test_config_accepts_exactly_the_registry_names():
    members = [get_args(member)[0] for member in get_args(RunConfig.model_fields["objective"].annotation)]
    assert members == [entry.config for entry in OBJECTIVES.values()]
    assert [entry.config.model_fields["name"].default for entry in OBJECTIVES.values()] == list(OBJECTIVES)
    assert MASKED_OBJECTIVES == ("mdc", "cmlm", "bert")
    with pytest.raises(ConfigError, match="objective.name"):
        load_config(None, ["objective.name=dalle"])


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_entry_trains_validates_scores_and_writes(name):
    entry = OBJECTIVES[name]
    torch.manual_seed(0)
    cfg = load_config(None, [f"objective.name={name}", "data.max_length=8"])
    model = build_model(cfg, CaptionTokenizer)
    pixels, tokens = batch()
    loss, _ = compute_loss(model, pixels, tokens, cfg.objective, torch.Generator().manual_seed(1))
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

    model.eval()
    validation = validation_objective(cfg.objective)
    assert validation == (cfg.objective if entry.validation is None else entry.validation)
    with torch.no_grad():
        assert math.isfinite(
            compute_loss(model, pixels, tokens, validation, torch.Generator().manual_seed(2))[0].item()
        )

    scorer, score = comp.get_scorer("auto", name)
    assert scorer == entry.scorer and scorer in comp.SCORERS
    scores = score(
        model,
        pixels[:2],
        [["a small red circle"] * 2, ["a large blue square"] * 2],
        samples=2,
        generator=torch.Generator().manual_seed(0),
    )
    assert scores.shape == (2, 2) and torch.isfinite(scores).all()

    if entry.write is None:
        with pytest.raises(ValueError, match="does not write captions"):
            write_captions(model, pixels, name, length=6)
    else:
        written = write_captions(model, pixels, name, length=6)
        assert written.shape == (3, 6) and not (written == MASK).any()


def test_masking_objectives_are_validated_on_one_elbo_whatever_their_schedule():
    elbo = MdcObjective(omega_l=T_MIN, omega_u=1.0, antithetic=True)
    for objective in (MdcObjective(omega_l=0.5), CmlmObjective(omega_l=0.2), BertObjective(mask_ratio=0.75)):
        assert validation_objective(objective) == elbo
    assert validation_objective(CappaObjective()) == ArObjective()
    assert validation_objective(ClipObjective()) == ClipObjective()
