"""Search spaces for sweeps (`tune_spaces/*.yaml`), validated before any trial starts.

A space names config fields (`section.key`, as in `mdc train` overrides) and how to vary them:
`grid: [...]` (every value, crossed with the other grid keys), `values: [...]` (random choice),
`uniform: [lo, hi]` or `loguniform: [lo, hi]`. Keys joined by a comma vary together, one list
entry per combination (e.g. `objective.omega_l,objective.omega_u: {grid: [[0.5, 1.0], ...]}`).
Every grid point is checked against the run config's own validation when the file is loaded, and
random draws are redrawn until they pass it, so no trial is ever proposed with `omega_l >= omega_u`.
"""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mdc.config import ConfigError, RunConfig, apply_overrides, build_config

MAX_REDRAWS = 1000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Distribution(_Strict):
    grid: list | None = None
    values: list | None = None
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Distribution:
        given = [k for k in ("grid", "values", "uniform", "loguniform") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of grid, values, uniform, loguniform (got {given or 'none'})")
        kind = given[0]
        if kind in ("grid", "values") and not getattr(self, kind):
            raise ValueError(f"{kind} is empty")
        if kind in ("uniform", "loguniform"):
            lo, hi = getattr(self, kind)
            if not lo < hi:
                raise ValueError(f"{kind} range is empty: [{lo}, {hi}]")
            if kind == "loguniform" and lo <= 0:
                raise ValueError(f"loguniform needs lo > 0, got {lo}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("grid", "values", "uniform", "loguniform") if getattr(self, k) is not None)

    def draw(self, rng: random.Random):
        if self.values is not None:
            return rng.choice(self.values)
        if self.uniform is not None:
            return rng.uniform(*self.uniform)
        lo, hi = self.loguniform
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))


class Scheduler(_Strict):
    type: Literal["asha", "none"] = "asha"
    grace_period: int = Field(2, ge=1, description="reports before a trial can be stopped")
    reduction_factor: int = Field(2, ge=2)


class SearchSpace(_Strict):
    name: str
    search: Literal["grid", "random"]
    num_samples: int = Field(1, ge=1)
    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    rank_by: str | None = Field(
        None,
        description="the figure that ranks the trials, a key of the eval section; default: the first probe's accuracy",
    )
    rank_mode: Literal["max", "min"] = Field("max", description="max: higher is better (accuracies); min: losses")
    params: dict[str, Distribution]
    base: dict[str, Any] = {}
    scheduler: Scheduler = Scheduler()

    @model_validator(mode="after")
    def _kinds(self) -> SearchSpace:
        if not self.params:
            raise ValueError("params is empty")
        for key, dist in self.params.items():
            if self.search == "grid" and dist.kind != "grid":
                raise ValueError(f"params.{key}: a grid search takes `grid:` lists, got {dist.kind}")
            if self.search == "random" and dist.kind == "grid":
                raise ValueError(f"params.{key}: a random search takes values/uniform/loguniform, got grid")
            if "," in key and dist.kind not in ("grid", "values"):
                raise ValueError(f"params.{key}: joint keys take grid/values lists of tuples")
            width = len(key.split(","))
            for entry in (dist.grid or dist.values or []) if width > 1 else []:
                if not isinstance(entry, list) or len(entry) != width:
                    raise ValueError(f"params.{key}: each entry must list {width} values, got {entry!r}")
        return self

    def overrides_for(self, point: dict[str, Any]) -> dict[str, Any]:
        """A {key: value} point (joint keys split) merged over `base`."""
        out = dict(self.base)
        for key, value in point.items():
            keys = key.split(",")
            out.update(zip(keys, value if len(keys) > 1 else [value]))
        return out

    def grid_points(self) -> list[dict[str, Any]]:
        keys = list(self.params)
        combos = itertools.product(*(self.params[k].grid for k in keys))
        return [self.overrides_for(dict(zip(keys, combo))) for combo in combos]

    def draw(self, base_cfg: dict, rng: random.Random) -> dict[str, Any]:
        """One random point that the run config accepts (redrawn until it does)."""
        for _ in range(MAX_REDRAWS):
            point = self.overrides_for({k: d.draw(rng) for k, d in self.params.items()})
            if _is_valid(base_cfg, point):
                return point
        raise ConfigError(f"space {self.name!r}: no valid point in {MAX_REDRAWS} draws; check the ranges")


def to_override_list(point: dict[str, Any]) -> list[str]:
    return [f"{k}={v}" for k, v in point.items()]


def _is_valid(base_cfg: dict, point: dict[str, Any]) -> bool:
    try:
        build_config(apply_overrides(_copy(base_cfg), to_override_list(point)))
        return True
    except ConfigError:
        return False


def _copy(d: dict) -> dict:
    return yaml.safe_load(yaml.safe_dump(d))


def _fields(node) -> dict:
    """The fields under a config annotation: a section's, or any member's of a union (the objective)."""
    members = get_args(node) if get_origin(node) is Union else (node,)
    members = [get_args(m)[0] if get_origin(m) is Annotated else m for m in members]
    return {
        k: v for m in members if isinstance(m, type) and issubclass(m, BaseModel) for k, v in m.model_fields.items()
    }


def _check_field(key: str, source: Path) -> None:
    node = RunConfig
    for part in key.split("."):
        fields = _fields(node)
        if part not in fields:
            raise ConfigError(f"{source}: {key!r} is not a run config field (unknown {part!r})")
        node = fields[part].annotation


def load_space(path: str | Path, base_cfg: RunConfig) -> SearchSpace:
    """Parse and validate a space file against the base run config; errors name the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"search space file not found: {path}")
    try:
        space = SearchSpace.model_validate(yaml.safe_load(path.read_text()) or {})
    except ValidationError as err:
        lines = []
        for e in err.errors():
            field = ".".join(str(p) for p in e["loc"])
            msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
            lines.append(f"  {field}: {msg}")
        raise ConfigError(f"invalid search space {path}:\n" + "\n".join(lines)) from None
    for key in [*(k for joint in space.params for k in joint.split(",")), *space.base]:
        _check_field(key, path)
    base = base_cfg.model_dump()
    points = space.grid_points() if space.search == "grid" else [space.draw(base, random.Random(0))]
    for point in points:
        try:
            build_config(apply_overrides(_copy(base), to_override_list(point)), source=str(path))
        except ConfigError as err:
            raise ConfigError(f"{path}: the point {point} is not a valid run config:\n{err}") from None
    return space


def ranking(space: SearchSpace, base_cfg: RunConfig) -> SearchSpace:
    """The space with the figure that ranks its trials: `rank_by` as given (checked against the
    base config's eval section, made concrete), else the first probe's accuracy; a sweep that
    would rank by a probe and has none fails here, before any trial, naming eval.probes."""
    from mdc.evaluation import suite  # the evaluation stack: seconds to import, only once a space is loaded

    if space.rank_by is None:
        suite.require(base_cfg, "probes", "mdc tune (trials are ranked by the first probe's accuracy)")
        return space.model_copy(update={"rank_by": suite.probe_key(base_cfg.eval.probes[0].key)})
    suite.check_figure(space.rank_by, base_cfg.eval, "rank_by")
    return space
