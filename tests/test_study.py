"""`mdc study`: the interval arithmetic on hand-made values and plan validation before any run, a
claim's figure named by its eval key (the smoke plan end to end through Ray, interrupted, resumed and
run again: tests/test_interrupt.py; a failed run ends the parent FAILED: tests/test_eval_section.py)."""

import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.commands.study import UNTESTABLE, StudyError, gated, load_plan, paired_interval, run_configs, verdict

SMOKE = Path(__file__).resolve().parent.parent / "studies" / "smoke.yaml"
# Student t quantiles t(0.975, df) from tables: df = 1, 2, 4.
T975 = {1: 12.706204736174707, 2: 4.302652729749462, 4: 2.7764451051977987}


@pytest.mark.parametrize(
    "a, b, mean, sd",
    [
        ([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], 2.0, 1.0),
        ([0.5, 0.7], [0.4, 0.4], 0.2, math.sqrt(0.02)),
        ([3.0, 1.0, 2.0, 2.5, 1.5], [1.0, 1.0, 1.0, 1.0, 1.0], 1.0, math.sqrt(0.625)),
    ],
)
def test_paired_interval_is_mean_plus_minus_t_times_standard_error(a, b, mean, sd):
    n = len(a)
    got_mean, low, high = paired_interval(a, b)
    half = T975[n - 1] * sd / math.sqrt(n)
    assert got_mean == pytest.approx(mean)
    assert (low, high) == (pytest.approx(mean - half), pytest.approx(mean + half))


def test_a_gate_that_does_not_hold_makes_every_other_verdict_untestable():
    """MDC against random init gates the rest: inconclusive there, a 'holds' elsewhere says nothing."""
    claims = [
        {"name": "gate", "verdict": "inconclusive", "gate": True, "mean_diff": 0.01},
        {"name": "a>b", "verdict": "holds", "gate": False, "mean_diff": 0.05},
        {"name": "c>d", "verdict": "reversed", "mean_diff": -0.05},
    ]
    judged = gated(claims)
    assert [c["verdict"] for c in judged] == ["inconclusive", UNTESTABLE, UNTESTABLE]
    assert [c["mean_diff"] for c in judged] == [0.01, 0.05, -0.05]  # the figures stay
    passed = [{**claims[0], "verdict": "holds"}, *claims[1:]]
    assert [c["verdict"] for c in gated(passed)] == ["holds", "holds", "reversed"]
    assert gated(claims[1:]) == claims[1:]  # no gate: verdicts as measured
    assert load_plan(Path("studies/emoji_claims.yaml")).claims[0].gate


def test_verdicts_for_a_claim_that_holds_one_reversed_and_one_inconclusive():
    holds = paired_interval([0.80, 0.82, 0.79], [0.70, 0.71, 0.70])  # d = .10, .11, .09: [0.075, 0.125]
    reversed_ = paired_interval([0.60, 0.61, 0.60], [0.70, 0.71, 0.69])  # d = -.10, -.10, -.09
    inconclusive = paired_interval([0.70, 0.75, 0.65], [0.70, 0.70, 0.70])  # d = 0, .05, -.05
    assert holds[1] == pytest.approx(0.10 - T975[2] * 0.01 / math.sqrt(3))
    assert verdict(*holds[1:], "greater") == "holds" and verdict(*holds[1:], "less") == "reversed"
    assert verdict(*reversed_[1:], "greater") == "reversed" and verdict(*reversed_[1:], "less") == "holds"
    assert verdict(*inconclusive[1:], "greater") == "inconclusive" == verdict(*inconclusive[1:], "less")
    # a ≥ b − margin: a small deficit whose interval stays above −margin holds
    assert verdict(-0.02, 0.01, "at_least", margin=0.05) == "holds"
    assert verdict(-0.09, -0.06, "at_least", margin=0.05) == "reversed"
    assert verdict(-0.07, 0.01, "at_least", margin=0.05) == "inconclusive"


def write_plan(tmp_path, **changes) -> Path:
    plan = yaml.safe_load(SMOKE.read_text())
    for key, value in changes.items():
        plan[key] = value
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"seeds": [0]}, r"seeds: List should have at least 2 items"),
        ({"seeds": [1, 1]}, r"seeds must be distinct"),
        (
            {"claims": [{"name": "x", "metric": "eval/probe/shapes/accuracy", "arm_a": "mdc", "arm_b": "gpt"}]},
            r"claims.0.arm_b: 'gpt' is not one of the arms",
        ),
        (
            {"claims": [{"name": "x", "metric": "probe_accuracy", "arm_a": "mdc", "arm_b": "cmlm"}]},
            r"claims.0.metric: 'probe_accuracy' is not a figure the eval section measures; its figures: \['loss'",
        ),
        (
            {"claims": [{"name": "x", "metric": "eval/captions/shapes/N20/cider", "arm_a": "mdc", "arm_b": "cmlm"}]},
            r"claims.0.metric: 'eval/captions/shapes/N20/cider' is not a figure .*eval/captions/shapes/N8/cider",
        ),
        ({"arms": {"mdc": {"data": "coco"}, "cmlm": {}}}, r"arms.mdc.data: 'coco' is not one of the datasets"),
        ({"arms": {"mdc": {}}}, r"claims.0.arm_b: 'cmlm' is not one of the arms \['mdc'\]"),  # one arm: claims vs 0
        ({"budget": {"train.stepz": 3}}, r"unknown field"),
        ({"evaluations": {"probe": False}}, r"evaluations is now the runs' eval section: put eval.\* keys in budget"),
        (
            {
                "datasets": {"shapes": {"kind": "shapes", "num": 40, "max_objects": 1}},
                "claims": [
                    {"name": "x", "metric": "eval/compositionality/shapes/macro", "arm_a": "mdc", "arm_b": "cmlm"}
                ],
            },
            r"claims.0.metric: 'eval/compositionality/shapes/macro' is not a figure",  # one shape: no pairs
        ),
    ],
)
def test_plan_errors_name_the_field(tmp_path, changes, message):
    path = write_plan(tmp_path, **changes)
    with pytest.raises(StudyError, match=message):
        run_configs(load_plan(path), path, tmp_path / "out")


def test_an_arm_config_error_names_the_arm_and_the_field(tmp_path):
    path = write_plan(
        tmp_path,
        arms={"mdc": {"objective.name": "mdc"}, "cmlm": {"objective.name": "ar", "model.time_conditioning": True}},
    )
    plan = load_plan(path)
    with pytest.raises(StudyError, match=r"(?s)arms.cmlm \(seed 0\): .*model.time_conditioning=true needs a noise"):
        run_configs(plan, path, tmp_path / "out")


def test_a_bad_plan_stops_the_command_before_any_run(tmp_path, ray_forbidden):
    path = write_plan(
        tmp_path, claims=[{"name": "x", "metric": "eval/probe/shapes/accuracy", "arm_a": "mdc", "arm_b": "bert"}]
    )
    result = CliRunner().invoke(app, ["study", "--plan", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "claims.0.arm_b: 'bert' is not one of the arms" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_a_set_an_arm_names_that_cannot_be_reached_stops_the_command_before_any_run(tmp_path, ray_forbidden):
    plan = yaml.safe_load(SMOKE.read_text())
    plan["budget"]["eval.probes"] = [{"dataset": "cifar10", "root": str(tmp_path / "no-cifar")}]
    plan["claims"] = [{"name": "x", "metric": "eval/probe/cifar10/accuracy", "arm_a": "mdc", "arm_b": "cmlm"}]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    result = CliRunner().invoke(app, ["study", "--plan", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert f"eval.probes.0.root: {tmp_path / 'no-cifar'} does not exist" in " ".join(result.output.split())


def test_a_plan_of_one_arm_judges_its_claims_against_0(tmp_path):
    plan = load_plan(Path("studies/emoji_gate.yaml"))
    assert list(plan.arms) == ["mdc"] and all(c.arm_b is None for c in plan.claims) and plan.claims[0].gate
    run_configs(plan, Path("studies/emoji_gate.yaml"), tmp_path)  # its claims' figures (balanced_gain) exist
