"""`mdc study --plan PLAN.yaml [--out DIR]`: claims measured over seeds, with paired differences.

A plan (YAML, `Plan` below) names the datasets, the arms (each a set of config overrides on a shared
budget, `eval.*` keys included), the seeds and the claims. Every arm × seed is one training run through
the same Ray Train pipeline as `mdc train`, an MLflow child of the study's parent run, then judged on
its eval section as every command judges an encoder (mdc/evaluation/suite.py; a generated dataset
gives the default section: a probe of its labels, its pairs, captions of its val split). A run's
figures go to OUT/runs/RUN/result.json, written last: launching the study again skips every finished
run, and an interrupted one resumes from its last checkpoint (same run name); a failed run is tried
again, and the claims are judged once every run has finished (pipelines/commands/experiment.py).

Each claim compares arm a with arm b on one figure, named by its key (eval/probe/shapes/accuracy,
eval/compositionality/shapes/vg_relation, eval/captions/shapes/N10/cider, loss, ...). Seed s of both arms shares the seed (weights,
data order, noise), so the differences d_s = a_s − b_s are paired; the report gives their mean and
the 95% Student-t interval mean ± t(0.975, n − 1) · sd(d) / √n over the n seeds. The verdict is
`holds` when the interval lies on the expected side (`greater`: above 0; `less`: below 0;
`at_least`: above −margin), `reversed` when it lies wholly on the other side, else `inconclusive`.
A claim marked `gate: true` (MDC against random init, say) must hold for the others to mean anything:
when a gate does not hold, every other claim reads `not testable at this budget`, its interval kept.
Written to OUT as study.json, results.md and claims.png, and logged to the parent MLflow run.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from rich.console import Console
from scipy import stats

from mdc.config import DEFAULT_CONFIG, ConfigError, RunConfig, derive, load_config
from mdc.data import emoji, shards, tuxpaint
from mdc.data.emoji import write_emoji_dataset
from mdc.data.shapes import write_shapes_dataset
from mdc.data.storage import join
from mdc.data.tuxpaint import write_tuxpaint_dataset
from mdc.evaluation import suite
from pipelines.commands import experiment
from pipelines.infra import tracking
from pipelines.run import model_registry, reports

console = Console(soft_wrap=True)

RESULT = "result.json"
CONFIDENCE = 0.95
VERDICTS = ("holds", "reversed", "inconclusive")
UNTESTABLE = "not testable at this budget"
CLAIM_FIELDS = (
    "name",
    "metric",
    "arm_a",
    "arm_b",
    "seeds",
    "values_a",
    "values_b",
    "mean_diff",
    "ci_low",
    "ci_high",
    "verdict",
)


class StudyError(ValueError):
    """A plan that cannot run, or results a claim cannot use; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetPlan(_Strict):
    """Where an arm's data comes from: generated shapes, Debian's Tux Paint stamps or Noto emoji, or existing
    shards (a training folder; the arms' eval section then names what judges them)."""

    kind: Literal["shapes", "tuxpaint", "emoji", "shards"] = "shapes"
    num: int = Field(2000, ge=10, description="shapes: images to generate")
    max_objects: Literal[1, 2] = Field(
        2, description="shapes: 1 gives one shape per image and captions of 4 tokens (no compositionality pairs)"
    )
    uri: str | None = Field(
        None, description="shards: a training folder (img2dataset's, say), or a dataset `mdc data` wrote (its train/)"
    )

    @property
    def has_pairs(self) -> bool:
        """Whether it has compositionality pairs: Tux Paint has no captions to swap, one-object
        shapes have no second object to swap with."""
        return self.kind != "tuxpaint" and self.max_objects == 2

    @model_validator(mode="after")
    def _uri(self) -> DatasetPlan:
        if (self.kind == "shards") != (self.uri is not None):
            raise ValueError("uri is required for kind 'shards' and only for it")
        return self


class Claim(_Strict):
    name: str
    metric: str
    arm_a: str
    arm_b: str | None = Field(None, description="none: arm a's metric against 0 (e.g. probe_gain)")
    expect: Literal["greater", "less", "at_least"] = "greater"
    margin: float = Field(0.0, ge=0.0, description="at_least: how far a may trail b and still hold")
    gate: bool = Field(
        False, description="the others are judged only if this holds (else: not testable at this budget)"
    )


class Plan(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    config: str | None = Field(None, description="base run config, relative to the plan file")
    seeds: list[int] = Field(min_length=2)
    budget: dict[str, Any] = Field(default_factory=dict, description="overrides shared by every run")
    datasets: dict[str, DatasetPlan] = Field(default_factory=lambda: {"shapes": DatasetPlan()}, min_length=1)
    arms: dict[str, dict[str, Any]] = Field(
        min_length=1, description="overrides per arm; `data` names a dataset (one arm: its claims against 0)"
    )
    claims: list[Claim] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "evaluations" in raw:
            raise ValueError(
                "evaluations is now the runs' eval section: put eval.* keys in budget (eval.samples, eval.limit, "
                "eval.random_init, eval.captions: [{lengths: [10]}], ...) and name figures by their keys "
                "(eval/probe/shapes/accuracy; docs/studies.md)"
            )
        return raw

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct, got {seeds}")
        return seeds

    @model_validator(mode="after")
    def _references(self) -> Plan:
        for arm, overrides in self.arms.items():
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", arm):
                raise ValueError(f"arms.{arm}: arm names are letters, digits, '_', '.', '-'")
            data = overrides.get("data", next(iter(self.datasets)))
            if data not in self.datasets:
                raise ValueError(f"arms.{arm}.data: {data!r} is not one of the datasets {sorted(self.datasets)}")
        for i, claim in enumerate(self.claims):
            for side in ("arm_a", "arm_b") if claim.arm_b is not None else ("arm_a",):
                if getattr(claim, side) not in self.arms:
                    raise ValueError(
                        f"claims.{i}.{side}: {getattr(claim, side)!r} is not one of the arms {sorted(self.arms)}"
                    )
            if claim.arm_a == claim.arm_b:
                raise ValueError(f"claims.{i}: arm_a and arm_b are both {claim.arm_a!r}")
        return self


def _explain(err: ValidationError, source: str) -> StudyError:
    lines = []
    for e in err.errors():
        message = "unknown field" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        field = ".".join(str(p) for p in e["loc"])
        lines.append(f"  {field}: {message}" if field else f"  {message}")  # cross-field checks name theirs
    return StudyError(f"invalid plan {source}:\n" + "\n".join(lines))


def load_plan(path: Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"plan file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise StudyError(f"{path}: top level must be a mapping")
    try:
        return Plan.model_validate(raw)
    except ValidationError as err:
        raise _explain(err, str(path)) from None


# ------------------------------------------------------------------------------ runs of a plan


def arm_dataset(plan: Plan, arm: str) -> str:
    """The dataset an arm trains and is evaluated on: its `data`, else the plan's first."""
    return plan.arms[arm].get("data", next(iter(plan.datasets)))


def dataset_root(plan: Plan, arm: str, out: Path) -> str:
    name = arm_dataset(plan, arm)
    spec = plan.datasets[name]
    return spec.uri if spec.kind == "shards" else str(out / "data" / name)


def expected_manifest(spec: DatasetPlan) -> dict | None:
    """What the manifest of a dataset the study generates will say (it is written when the study
    starts): enough for the default eval section. None for existing shards: their own is read."""
    if spec.kind == "shards":
        return None
    pairs = {"num_pairs": 1} if spec.has_pairs else {}
    manifest = {
        "dataset": spec.kind,
        "class_names": ["..."],
        "splits": {"train": {}, "val": {}},
        "compositionality": pairs,
    }
    if spec.kind == "emoji":  # mdc/data/emoji.py: a test split and a second probe level
        manifest |= {"subgroup_names": ["..."], "splits": {"train": {}, "val": {}, "test": {}}}
    return manifest


def run_name(plan: Plan, arm: str, seed: int) -> str:
    return f"{plan.name}-{arm}-s{seed}"


def arm_data(plan: Plan, arm: str, out: Path) -> dict[str, str | None]:
    """The arm's training and validation splits: train/ and val/ of a dataset `mdc data` wrote (or
    the study generates), else the shards folder itself and no validation split."""
    root, spec = dataset_root(plan, arm, out), plan.datasets[arm_dataset(plan, arm)]
    train = join(root, "train") if spec.kind != "shards" else suite.training_split(root)
    return {"data.train_uri": train, "data.val_uri": join(root, "val") if train != root else None}


def run_configs(plan: Plan, plan_path: Path, out: Path) -> dict[tuple[str, int], RunConfig]:
    """Every (arm, seed)'s validated config, its eval section concrete: base config ← study paths
    ← budget ← arm ← seed. A config error names the arm and the field, a claim's figure that an
    arm does not measure names the claim, before anything runs."""
    base = Path(plan_path).parent / plan.config if plan.config else DEFAULT_CONFIG
    configs, base = {}, load_config(base)
    for arm, overrides in plan.arms.items():
        overrides = {k: v for k, v in overrides.items() if k != "data"}
        study = {"storage_uri": str(out / "checkpoints"), "mlflow_uri": f"sqlite:///{out / 'mlflow.db'}"}
        manifest = expected_manifest(plan.datasets[arm_dataset(plan, arm)])
        for seed in plan.seeds:
            items = {**study, **arm_data(plan, arm, out), **plan.budget, **overrides}
            items |= {"train.seed": seed, "name": run_name(plan, arm, seed)}
            try:
                configs[arm, seed] = suite.resolve_section(derive(base, items), manifest)
            except ConfigError as err:
                raise StudyError(f"arms.{arm} (seed {seed}): {err}") from None
    for i, claim in enumerate(plan.claims):
        for arm in filter(None, (claim.arm_a, claim.arm_b)):
            try:
                suite.check_figure(claim.metric, configs[arm, plan.seeds[0]].eval, f"claims.{i}.metric")
            except ConfigError as err:
                raise StudyError(f"{err} (arm {arm!r})") from None
    return configs


def prepare_data(plan: Plan, out: Path) -> None:
    """Generate the plan's shapes / Tux Paint / emoji datasets under OUT/data, once."""
    for name, spec in plan.datasets.items():
        root = out / "data" / name
        if spec.kind == "shards" or (root / shards.MANIFEST).is_file():
            continue
        console.print(f"writing dataset {name} ({spec.kind}) to {root}")
        if spec.kind == "shapes":
            write_shapes_dataset(str(root), num=spec.num, seed=0, max_objects=spec.max_objects)
        elif spec.kind == "emoji":
            write_emoji_dataset(str(root))
        else:
            write_tuxpaint_dataset(str(root))


def check_data(plan: Plan) -> None:
    """Fail before anything runs if a Tux Paint dataset has no stamps to read."""
    for name, spec in plan.datasets.items():
        if spec.kind == "emoji":
            try:
                emoji.check_packages()
            except emoji.MissingPackages as err:
                raise StudyError(f"datasets.{name}.kind: {err}") from None
        if spec.kind == "tuxpaint" and not Path(tuxpaint.DEFAULT_ROOT).is_dir():
            raise StudyError(
                f"datasets.{name}.kind: tuxpaint needs Debian's tuxpaint-stamps-default "
                f"({tuxpaint.DEFAULT_ROOT} not found)"
            )


def check_sets(configs: dict[tuple[str, int], RunConfig], out: Path) -> None:
    """Fail before anything runs when a set the arms' eval sections name cannot be reached; the
    datasets the study generates (under OUT/data) are written when it starts."""
    generated = str(out / "data")
    for (arm, seed), cfg in configs.items():
        ev = cfg.eval.model_copy(
            update={
                field: [
                    s
                    for s in getattr(cfg.eval, field)
                    if not str(getattr(s, "root", None) or s.uri).startswith(generated)
                ]
                for field in ("probes", "compositionality", "captions")
            }
        )
        try:
            suite.check_section(ev, cfg.data.endpoint_url)
        except ConfigError as err:
            raise StudyError(f"arms.{arm} (seed {seed}): {err}") from None


def result_path(out: Path, cfg: RunConfig) -> Path:
    return out / "runs" / cfg.name / RESULT


# ------------------------------------------------------------------------------------ statistics


def paired_interval(values_a: list[float], values_b: list[float], confidence: float = CONFIDENCE):
    """(mean, low, high) of the paired differences a − b: mean ± t(1 − α/2, n − 1) · sd / √n."""
    if len(values_a) != len(values_b) or len(values_a) < 2:
        raise StudyError(
            f"paired interval needs two equally long lists of >= 2 values, got {len(values_a)} and {len(values_b)}"
        )
    diffs = [a - b for a, b in zip(values_a, values_b)]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def verdict(low: float, high: float, expect: str, margin: float = 0.0) -> str:
    """`holds` when the interval lies on the expected side, `reversed` when wholly on the other."""
    if expect == "less":
        low, high = -high, -low
    threshold = -margin if expect == "at_least" else 0.0
    if low > threshold:
        return "holds"
    if high < threshold:
        return "reversed"
    return "inconclusive"


def claim_result(plan: Plan, claim: Claim, results: dict[tuple[str, int], dict]) -> dict:
    def values(arm: str) -> list[float]:
        out = []
        for seed in plan.seeds:
            value = results[arm, seed]["metrics"].get(claim.metric)
            if value is None:
                raise StudyError(
                    f"claim {claim.name!r}: run {run_name(plan, arm, seed)} has no figure "
                    f"{claim.metric!r} (its figures: {sorted(results[arm, seed]['metrics'])})"
                )
            out.append(float(value))
        return out

    values_a = values(claim.arm_a)
    values_b = values(claim.arm_b) if claim.arm_b else [0.0] * len(values_a)
    mean, low, high = paired_interval(values_a, values_b)
    return {
        "name": claim.name,
        "metric": claim.metric,
        "arm_a": claim.arm_a,
        "arm_b": claim.arm_b,
        "seeds": list(plan.seeds),
        "values_a": values_a,
        "values_b": values_b,
        "mean_diff": mean,
        "ci_low": low,
        "ci_high": high,
        "verdict": verdict(low, high, claim.expect, claim.margin),
        "expect": claim.expect,
        "margin": claim.margin,
        "gate": claim.gate,
    }


def gated(claims: list[dict]) -> list[dict]:
    """The claims with the gate applied: if a `gate` claim does not hold, the encoder did not learn
    enough at this budget for a comparison between arms to say anything about the method, so every
    other claim's verdict becomes UNTESTABLE (its figures stay, for the record)."""
    if all(c["verdict"] == "holds" for c in claims if c.get("gate")):
        return claims
    return [c if c.get("gate") else {**c, "verdict": UNTESTABLE} for c in claims]


# ------------------------------------------------------------------------------------ the report

EXPECT_TEXT = {"greater": "a > b", "less": "a < b", "at_least": "a ≥ b − {margin}"}


def results_markdown(plan: Plan, claims: list[dict], wall_s: float) -> str:
    lines = [
        f"# Study {plan.name}",
        "",
        f"{len(plan.seeds)} seeds per arm ({', '.join(map(str, plan.seeds))}); differences a − b paired by seed; "
        f"{int(CONFIDENCE * 100)}% Student-t interval over the paired differences. This launch took "
        f"{wall_s:.0f} s (runs finished before are not rerun).",
        "",
    ]
    columns = ("claim", "metric", "a", "b", "expected", "values a", "values b", "mean a − b", "95% CI", "verdict")
    rows = [
        [
            c["name"],
            c["metric"],
            c["arm_a"],
            c["arm_b"] or "0",
            EXPECT_TEXT[c["expect"]].format(margin=c["margin"]).replace("b", "b" if c["arm_b"] else "0"),
            ", ".join(f"{v:.3f}" for v in c["values_a"]),
            ", ".join(f"{v:.3f}" for v in c["values_b"]),
            f"{c['mean_diff']:+.4f}",
            f"[{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]",
            c["verdict"],
        ]
        for c in claims
    ]
    return "\n".join(lines) + "\n" + reports.markdown_table(columns, rows)


def write_report(plan: Plan, claims: list[dict], out: Path, wall_s: float) -> list[Path]:
    """study.json, results.md and claims.png in OUT."""
    summary = {
        "plan": plan.name,
        "confidence": CONFIDENCE,
        "interval": "Student t over seed-paired differences",
        "wall_s": wall_s,
        "claims": claims,
    }
    (out / "study.json").write_text(json.dumps(summary, indent=2))
    (out / "results.md").write_text(results_markdown(plan, claims, wall_s))
    reports.claims_png(claims, out / "claims.png", CONFIDENCE)
    return [out / "study.json", out / "results.md", out / "claims.png"]


def run_study(
    plan: Plan, plan_path: Path, out: Path, max_concurrent: int | None = None
) -> tuple[list[dict], list[experiment.Failure]]:
    """Every run that has no result yet (`max_concurrent` at once, default what fits the cluster),
    then the claims, one dict each, once every run has finished; and the runs that failed."""
    tic = time.perf_counter()
    out = Path(out).resolve()
    configs = run_configs(plan, plan_path, out)
    check_data(plan)
    first = next(iter(configs.values()))
    out.mkdir(parents=True, exist_ok=True)
    prepare_data(plan, out)
    with experiment.parent_run(first, f"study-{plan.name}", plan.model_dump()) as parent:
        results = experiment.run_runs(parent, configs, lambda cfg: str(result_path(out, cfg)), max_concurrent)
        if first.eval.probes:
            key = suite.probe_key(first.eval.probes[0].key)
            model_registry.alias_best(
                parent.mlflow_uri, {r["run_name"]: r["metrics"].get(key) for r in results.values()}
            )
        if parent.failures:
            return [], parent.failures
        claims = gated([claim_result(plan, claim, results) for claim in plan.claims])
        files = write_report(plan, claims, out, time.perf_counter() - tic)
        metrics = {f"claims/{i}/{k}": c[k] for i, c in enumerate(claims) for k in ("mean_diff", "ci_low", "ci_high")}
        tracking.log_evaluation(parent.mlflow_uri, metrics, files, run_id=parent.run_id)
    return claims, parent.failures
