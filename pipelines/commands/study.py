"""`mdc study --plan PLAN.yaml [--out DIR]`: claims measured over seeds, with paired differences.

A plan (YAML, `Plan` below) names the datasets, the arms (each a set of config overrides on a shared
budget), the seeds, the evaluations and the claims. Every arm × seed is one training run through the
same Ray Train pipeline as `mdc train` (`pipelines.run.driver.run_training`), an MLflow child of the
study's parent run, then evaluated in this process as `mdc compare` evaluates
(`pipelines.commands.compare.evaluate_checkpoint`). A run's metrics go to OUT/runs/RUN/result.json, written
last: launching the study again skips every finished run, and an interrupted one resumes from its
last checkpoint (same run name).

Each claim compares arm a with arm b on one metric. Seed s of both arms shares the seed (weights,
data order, noise), so the differences d_s = a_s − b_s are paired; the report gives their mean and
the 95% Student-t interval mean ± t(0.975, n − 1) · sd(d) / √n over the n seeds. The verdict is
`holds` when the interval lies on the expected side (`greater`: above 0; `less`: below 0;
`at_least`: above −margin), `reversed` when it lies wholly on the other side, else `inconclusive`.
Written to OUT as study.json, results.md and claims.png, and logged to the parent MLflow run.
"""

from __future__ import annotations

import functools
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
from mdc.data import shards, tuxpaint
from mdc.data.shapes import write_shapes_dataset
from mdc.data.storage import join
from mdc.data.tuxpaint import write_tuxpaint_dataset
from mdc.evaluation import probe
from mdc.registry import OBJECTIVES
from pipelines.commands.compare import evaluate_checkpoint
from pipelines.infra import progress, tracking
from pipelines.run import concurrency, model_registry, reports
from pipelines.run.driver import run_training

console = Console(soft_wrap=True)

RESULT = "result.json"
CONFIDENCE = 0.95
VERDICTS = ("holds", "reversed", "inconclusive")
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
# Metrics a run reports (pipelines.commands.compare.evaluate_checkpoint plus the training summary), by pattern.
RUN_METRICS = {
    r"final_loss|val_loss|train_images_per_s": None,
    r"probe_accuracy": "probe",
    r"probe_random_init_accuracy|probe_gain": "probe_baseline",
    r"compositionality_accuracy|compositionality_blind_accuracy": "compositionality",
    r"(compositionality|blind)/(aro|sugarcrepe)/\w+": "compositionality",
    r"captions/N(\d+)/(bleu4|cider|captions_per_s)": "captions",
}


class StudyError(ValueError):
    """A plan that cannot run, or results a claim cannot use; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetPlan(_Strict):
    """Where an arm's data comes from: generated shapes, Debian's Tux Paint stamps, or existing
    shards (a dataset root with train/, val/ and, for compositionality, compositionality/)."""

    kind: Literal["shapes", "tuxpaint", "shards"] = "shapes"
    num: int = Field(2000, ge=10, description="shapes: images to generate")
    max_objects: Literal[1, 2] = Field(
        2, description="shapes: 1 gives one shape per image and captions of 4 tokens (no compositionality pairs)"
    )
    uri: str | None = Field(None, description="shards: the dataset root")

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


class Evaluations(_Strict):
    probe: bool = True
    probe_baseline: bool = Field(
        False, description="also probe the arm's ViT at random init: probe_random_init_accuracy, probe_gain"
    )
    compositionality: bool = True
    normalize: Literal["none", "token"] = "none"
    caption_lengths: list[int] = Field(default_factory=lambda: [10], description="N' of the captions metrics")
    limit: int = Field(200, ge=1, description="images per evaluation (captions, each compositionality subset)")
    samples: int = Field(8, ge=1, description="Monte Carlo draws per caption score")


class Claim(_Strict):
    name: str
    metric: str
    arm_a: str
    arm_b: str | None = Field(None, description="none: arm a's metric against 0 (e.g. probe_gain)")
    expect: Literal["greater", "less", "at_least"] = "greater"
    margin: float = Field(0.0, ge=0.0, description="at_least: how far a may trail b and still hold")


class Plan(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    config: str | None = Field(None, description="base run config, relative to the plan file")
    seeds: list[int] = Field(min_length=2)
    budget: dict[str, Any] = Field(default_factory=dict, description="overrides shared by every run")
    datasets: dict[str, DatasetPlan] = Field(default_factory=lambda: {"shapes": DatasetPlan()}, min_length=1)
    arms: dict[str, dict[str, Any]] = Field(min_length=2, description="overrides per arm; `data` names a dataset")
    evaluations: Evaluations = Evaluations()
    claims: list[Claim] = Field(min_length=1)

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
            self._check_metric(i, claim.metric)
        return self

    def _check_metric(self, i: int, metric: str) -> None:
        for pattern, evaluation in RUN_METRICS.items():
            match = re.fullmatch(pattern, metric)
            if match is None:
                continue
            if evaluation == "captions":
                if int(match.group(1)) not in self.evaluations.caption_lengths:
                    raise ValueError(
                        f"claims.{i}.metric: {metric!r} needs {match.group(1)} in "
                        f"evaluations.caption_lengths {self.evaluations.caption_lengths}"
                    )
            elif evaluation is not None and not getattr(self.evaluations, evaluation):
                raise ValueError(f"claims.{i}.metric: {metric!r} needs evaluations.{evaluation}: true")
            return
        raise ValueError(
            f"claims.{i}.metric: unknown metric {metric!r}; expected one of the patterns {list(RUN_METRICS)}"
        )


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


def run_name(plan: Plan, arm: str, seed: int) -> str:
    return f"{plan.name}-{arm}-s{seed}"


def run_configs(plan: Plan, plan_path: Path, out: Path) -> dict[tuple[str, int], RunConfig]:
    """Every (arm, seed)'s validated config: base config ← study paths ← budget ← arm ← seed.
    A config error names the arm and the field, before anything runs."""
    base = Path(plan_path).parent / plan.config if plan.config else DEFAULT_CONFIG
    configs, base = {}, load_config(base)
    for arm, overrides in plan.arms.items():
        overrides = {k: v for k, v in overrides.items() if k != "data"}
        root = dataset_root(plan, arm, out)
        study = {
            "storage_uri": str(out / "checkpoints"),
            "mlflow_uri": f"sqlite:///{out / 'mlflow.db'}",
            "data.train_uri": join(root, "train"),
            "data.val_uri": join(root, "val"),
        }
        for seed in plan.seeds:
            items = {**study, **plan.budget, **overrides, "train.seed": seed, "name": run_name(plan, arm, seed)}
            try:
                configs[arm, seed] = derive(base, items)
            except ConfigError as err:
                raise StudyError(f"arms.{arm} (seed {seed}): {err}") from None
    for i, claim in enumerate(plan.claims):
        match = re.fullmatch(r"captions/N(\d+)/.*", claim.metric)
        for arm in filter(None, (claim.arm_a, claim.arm_b)):
            cfg = configs[arm, plan.seeds[0]]
            if (
                claim.metric.startswith(("compositionality", "blind/"))
                and not plan.datasets[arm_dataset(plan, arm)].has_pairs
            ):
                raise StudyError(
                    f"claims.{i}.metric: arm {arm!r} trains on data with no compositionality pairs "
                    f"(Tux Paint, or one-object shapes)"
                )
            if match and int(match.group(1)) > cfg.data.max_length:
                raise StudyError(
                    f"claims.{i}.metric: arm {arm!r} cannot write {match.group(1)}-token captions "
                    f"(data.max_length {cfg.data.max_length})"
                )
            if match and OBJECTIVES[cfg.objective.name].write is None:
                raise StudyError(f"claims.{i}.metric: arm {arm!r} is {cfg.objective.name!r}, which writes no captions")
    return configs


def prepare_data(plan: Plan, out: Path) -> None:
    """Generate the plan's shapes / Tux Paint datasets under OUT/data, once."""
    for name, spec in plan.datasets.items():
        root = out / "data" / name
        if spec.kind == "shards" or (root / shards.MANIFEST).is_file():
            continue
        console.print(f"writing dataset {name} ({spec.kind}) to {root}")
        if spec.kind == "shapes":
            write_shapes_dataset(str(root), num=spec.num, seed=0, max_objects=spec.max_objects)
        else:
            write_tuxpaint_dataset(str(root))


def check_data(plan: Plan) -> None:
    """Fail before anything runs if a Tux Paint dataset has no stamps to read."""
    for name, spec in plan.datasets.items():
        if spec.kind == "tuxpaint" and not Path(tuxpaint.DEFAULT_ROOT).is_dir():
            raise StudyError(
                f"datasets.{name}.kind: tuxpaint needs Debian's tuxpaint-stamps-default "
                f"({tuxpaint.DEFAULT_ROOT} not found)"
            )


def result_path(out: Path, cfg: RunConfig) -> Path:
    return out / "runs" / cfg.name / RESULT


def train_and_evaluate(plan: Plan, arm: str, cfg: RunConfig, out: Path, parent: str, channel=None) -> dict:
    """One run's metrics: from its result.json when it finished before, else trained and evaluated.
    `channel`: the progress channel of runs that train at once (pipelines.infra.progress.shared)."""
    path = result_path(out, cfg)
    if path.is_file():
        console.print(f"{cfg.name}: finished before, not rerun")
        return json.loads(path.read_text())
    console.print(f"[bold]{cfg.name}[/bold]: training {cfg.train.steps} steps")
    summary = run_training(cfg, parent_run_id=parent, channel=channel)
    ev = plan.evaluations
    with concurrency.serialized():  # evaluations run here, in the driver, one at a time (torch's global seed)
        metrics = evaluate_checkpoint(
            summary.checkpoint_uri,
            dataset_root(plan, arm, out),
            cfg.data.endpoint_url,
            ev.caption_lengths,
            ev.limit,
            ev.samples,
            cfg.train.seed,
            ev.normalize,
            ev.probe,
            ev.compositionality and plan.datasets[arm_dataset(plan, arm)].has_pairs,
        )
        if ev.probe_baseline:
            metrics["probe_random_init_accuracy"] = random_init_probe(cfg, dataset_root(plan, arm, out))
            metrics["probe_gain"] = metrics["probe_accuracy"] - metrics["probe_random_init_accuracy"]
    metrics.update(
        final_loss=summary.metrics["loss"],
        val_loss=summary.metrics.get("val_loss"),
        train_images_per_s=summary.metrics["images_per_s"],
    )
    numbers = {f"study/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
    tracking.log_evaluation(cfg.mlflow_uri, numbers, [], run_id=summary.mlflow_run_id)
    result = {
        "arm": arm,
        "seed": cfg.train.seed,
        "run_name": cfg.name,
        "checkpoint": summary.checkpoint_uri,
        "mlflow_run_id": summary.mlflow_run_id,
        "metrics": metrics,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))  # last: its presence means the run is done
    return result


def random_init_probe(cfg: RunConfig, data_uri: str) -> float:
    """Probe accuracy of the run's architecture at random init (its seed): what training must beat.
    Runs whose models are built alike (the registry's builder, the model section, the caption
    length, a null image or not) with the same seed on the same data have the same random weights,
    so they share one probe."""
    key = (
        id(OBJECTIVES[cfg.objective.name].build),
        cfg.model.model_dump_json(),
        cfg.data.max_length,
        cfg.objective.null_image,
        cfg.train.seed,
        data_uri,
    )
    if key not in _RANDOM_INIT_PROBES:
        model = probe.random_init(cfg, seed=cfg.train.seed)
        _RANDOM_INIT_PROBES[key] = probe.probe_shapes(model, data_uri, cfg.data.endpoint_url)["accuracy"]
    return _RANDOM_INIT_PROBES[key]


_RANDOM_INIT_PROBES: dict[tuple, float] = {}


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
                    f"claim {claim.name!r}: run {run_name(plan, arm, seed)} has no metric "
                    f"{claim.metric!r} (its metrics: {sorted(results[arm, seed]['metrics'])})"
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
    }


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


def run_runs(plan: Plan, configs: dict, out: Path, parent: str, max_concurrent: int | None) -> dict:
    """Every run's result, by (arm, seed): the finished ones read back, the others trained and
    evaluated, `max_concurrent` at once (default: what the cluster's free resources fit)."""
    pending = {key: cfg for key, cfg in configs.items() if not result_path(out, cfg).is_file()}
    n, planned = concurrency.plan_concurrency(pending, max_concurrent)
    configs = {**configs, **planned}
    with progress.shared(n, console) as channel:
        calls = {
            key: functools.partial(train_and_evaluate, plan, key[0], cfg, out, parent, channel)
            for key, cfg in configs.items()
        }
        return concurrency.run_all(calls, n)


def run_study(plan: Plan, plan_path: Path, out: Path, max_concurrent: int | None = None) -> list[dict]:
    """Every run that has no result yet (`max_concurrent` at once, default what fits the
    cluster), then the claims; returns one dict per claim."""
    tic = time.perf_counter()
    out = Path(out).resolve()
    configs = run_configs(plan, plan_path, out)
    check_data(plan)
    first = next(iter(configs.values()))
    mlflow_uri = tracking.absolute_tracking_uri(first.mlflow_uri)
    out.mkdir(parents=True, exist_ok=True)
    prepare_data(plan, out)
    parent = tracking.get_or_create_run(mlflow_uri, first.experiment, f"study-{plan.name}", plan.model_dump())
    try:
        results = run_runs(plan, configs, out, parent, max_concurrent)
        model_registry.alias_best(
            mlflow_uri, {r["run_name"]: r["metrics"].get("probe_accuracy") for r in results.values()}
        )
        claims = [claim_result(plan, claim, results) for claim in plan.claims]
        wall_s = time.perf_counter() - tic
        (out / "study.json").write_text(
            json.dumps(
                {
                    "plan": plan.name,
                    "confidence": CONFIDENCE,
                    "interval": "Student t over seed-paired differences",
                    "wall_s": wall_s,
                    "claims": claims,
                },
                indent=2,
            )
        )
        (out / "results.md").write_text(results_markdown(plan, claims, wall_s))
        reports.claims_png(claims, out / "claims.png", CONFIDENCE)
        metrics = {f"claims/{i}/{k}": c[k] for i, c in enumerate(claims) for k in ("mean_diff", "ci_low", "ci_high")}
        tracking.log_evaluation(
            mlflow_uri, metrics, [out / "study.json", out / "results.md", out / "claims.png"], run_id=parent
        )
    except BaseException:
        tracking.finish_run(mlflow_uri, parent, "FAILED")
        raise
    tracking.finish_run(mlflow_uri, parent)
    return claims
