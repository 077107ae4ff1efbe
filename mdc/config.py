"""Typed run configuration: loaded from YAML, overridden by `key=value`, validated before any work.

The defaults are the embedded demo (configs/demo.yaml, every command's default config): `RunConfig()`
equals it, which tests/test_config.py checks."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_serializer,
    model_validator,
)

from mdc.objectives.sections import MASKED_OBJECTIVES, SECTIONS, MdcObjective  # torch-free: a config loads fast

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"  # every command's default
PresetName = Literal["tiny", "vit_b32", "vit_b16", "vit_l14"]


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and the allowed values."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    preset: PresetName = "tiny"
    image_size: int | None = Field(None, ge=8, description="defaults to the preset's")
    decoder_layers: int | None = Field(None, ge=1, description="defaults to the preset's")
    encoder_pos_embed: Literal["sincos2d", "learned"] = Field(
        "sincos2d", description="ViT positions: fixed 2D sin-cos (Big Vision, MAE) or timm's learned table"
    )
    time_conditioning: bool | None = Field(
        None, description="the denoiser reads the noise level t; unset: as the objective needs (cdlm on, others off)"
    )
    concentrated_attention: bool = False
    predict_length: bool = Field(False, description="DDCap: caption-length head; masked objectives only")


def _objective_name(raw) -> str | None:
    """The union member an objective section is: its `name`, mdc where a mapping names none."""
    return raw.get("name", "mdc") if isinstance(raw, dict) else getattr(raw, "name", None)


# One config class per objective, each with its own fields only (the registry's, in its order),
# told apart by `name`. Union[...] of a tuple: `|` cannot join a computed number of members.
ObjectiveConfig = Annotated[
    Union[tuple(Annotated[config, Tag(name)] for name, config in SECTIONS.items())],  # noqa: UP007
    Discriminator(_objective_name),
]


class DataConfig(_Section):
    train_uri: str = "runs/shapes/train"
    val_uri: str | None = "runs/shapes/val"
    endpoint_url: str | None = None
    max_length: int = Field(16, ge=2, le=512)
    shuffle_buffer: int = Field(
        256, ge=0, description="rows of a shard shuffled together (seeded windows); 0: in order"
    )
    format: Literal["auto", "webdataset", "parquet"] = Field(
        "auto", description="auto: the tars and every Parquet file that is not a tar's side file"
    )
    ingest_cpus: float | None = Field(
        None,
        gt=0.0,
        description="logical CPUs for reading and decoding; default: the cluster's CPUs minus the training workers'",
    )
    stall_timeout_s: float = Field(300.0, gt=0.0, description="fail when no batch reaches a worker this long")
    subset_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="keep keys whose hash is below this: nested subsets"
    )
    subset_salt: str = "subset"
    augment: Literal["none", "crop", "crop_flip"] = Field(
        "none",
        description="training images: random resized crop (area 0.5-1), crop_flip also mirrors "
        "half of them (wrong for captions that say left/right, as the shapes data's do)",
    )


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.05, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.98, ge=0.0, lt=1.0)
    warmup_steps: int = Field(30, ge=0)
    grad_clip: float = Field(1.0, gt=0.0)
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0)


class TrainConfig(_Section):
    """The step loop: how long, how big a batch, from which seed, how often it logs."""

    steps: int = Field(600, ge=1)
    batch_size: int = Field(16, ge=1, description="per worker and micro-batch")
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="the optimiser's batch, whatever the number of workers: a multiple of batch_size, split "
        "into micro-batches of batch_size over the workers (gradient accumulation; an uneven split pads the "
        "short shares with weight-0 passes); default batch_size × the most workers",
    )
    seed: int = 0
    log_every: int = Field(20, ge=1)


class CheckpointConfig(_Section):
    """The checkpointer (pipelines/worker/checkpointer.py): when it saves, how many it keeps, how."""

    every: int = Field(200, ge=1, description="steps between checkpoints; the last step is always saved")
    keep: int = Field(3, ge=1, description="complete checkpoints kept in storage, newest first")
    background: bool = Field(
        False, description="copy checkpoints to storage and commit them in a background thread while training goes on"
    )


class ValidationConfig(_Section):
    """The held-out loss (pipelines/worker/validator.py): every N steps on the same seeded batches."""

    every: int = Field(200, ge=1)
    batches: int = Field(4, ge=1, description="held-out batches of train.batch_size per validation")


class WorkersConfig(_Section):
    """Ray Train's worker group: how many, where, with what, and how often it may restart."""

    count: int | tuple[int, int] = Field(
        2,
        description="training workers: N, or [MIN, MAX] for elastic training (Ray Train starts once MIN fit, "
        "shrinks when a node goes, grows when nodes join; the global batch stays the same)",
    )
    resize_check_s: float = Field(
        60.0, ge=0.0, description="elastic training: how often Ray Train looks for room to grow the group"
    )
    use_gpu: bool = Field(False, description="one GPU a worker: NCCL and bf16 (else gloo and float32 on CPU)")
    cpus: float = Field(0.5, gt=0.0, description="logical CPUs a worker")
    resources: dict[str, float] = Field(
        {}, description="custom Ray resources each worker needs beside CPU/GPU, e.g. {spot_gpu_slot: 1}"
    )
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how Ray places the workers on nodes: PACK fills few nodes, SPREAD one worker a node"
    )
    max_failures: int = Field(2, ge=-1, description="worker-group restarts from the last checkpoint")
    notice_every_s: float = Field(
        5.0,
        ge=0.0,
        description="how often (rank 0's wall clock) the group reads a node's reclaim notice, at a step boundary "
        "every rank agrees on, whatever train.log_every is; 0: at logged steps only",
    )
    max_preemption_failures: int = Field(
        -1, ge=-1, description="restarts after a node's reclaim notice (spot), apart from max_failures; -1: no limit"
    )

    @field_serializer("count")
    def _count_as_yaml(self, value: int | tuple[int, int]) -> int | list[int]:
        return value if isinstance(value, int) else list(value)  # YAML and MLflow take lists, not tuples

    @model_validator(mode="after")
    def _a_range(self) -> WorkersConfig:
        if self.min < 1 or self.min > self.max:
            raise ValueError(
                f"workers.count must be N >= 1 or [MIN, MAX] with 1 <= MIN <= MAX, got {self._count_as_yaml(self.count)}"
            )
        return self

    @property
    def elastic(self) -> bool:
        return self.min < self.max  # [8, 8] is a fixed group of 8

    @property
    def min(self) -> int:
        return self.count if isinstance(self.count, int) else self.count[0]

    @property
    def max(self) -> int:
        return self.count if isinstance(self.count, int) else self.count[1]


class ComputeConfig(_Section):
    """How each worker runs the model (mdc/training/fsdp.py prepare_model)."""

    compile: bool = Field(False, description="torch.compile each transformer block")
    activation_checkpointing: bool = Field(False, description="recompute each block's activations in backward")


NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"  # a name inside a metric key: no "/"


class ProbeSet(_Section):
    """A labelled dataset for the linear probe: fit on its train split, scored on its test split."""

    dataset: str = Field(
        description="its layout (mdc/evaluation/readers.py): cifar10, cifar100, csv, fashion-mnist, folder, "
        "food101, imagenet, pets, shapes, tuxpaint"
    )
    root: str | None = Field(
        None,
        description="its folder (shapes, tuxpaint: also s3://); unset: the dataset `mdc data` wrote that holds "
        "data.train_uri (fashion-mnist: Debian's)",
    )
    name: str | None = Field(
        None, pattern=NAME_PATTERN, description="its name in the keys eval/probe/NAME/...; default: dataset"
    )

    @model_validator(mode="after")
    def _known(self) -> ProbeSet:
        from mdc.evaluation.readers import dataset_kinds  # torchvision: only where a probe is named

        if self.dataset not in dataset_kinds():
            raise ValueError(f"dataset {self.dataset!r} is not one of {', '.join(dataset_kinds())}")
        return self

    @property
    def key(self) -> str:
        return self.name or self.dataset


class CompositionalitySet(_Section):
    """A compositionality benchmark in its published JSON layout (mdc/evaluation/compositionality.py)."""

    benchmark: Literal["aro", "sugarcrepe", "shapes"] = Field(
        description="aro | sugarcrepe, or shapes: the ARO/SugarCrepe-format pairs `mdc data shapes` writes"
    )
    root: str | None = Field(
        None,
        description="aro, sugarcrepe: the folder of the JSON files; shapes: the dataset (also s3://), unset: the "
        "dataset `mdc data` wrote that holds data.train_uri",
    )
    image_dir: str | None = Field(None, description="the images (default ROOT/images)")
    subsets: list[str] | None = Field(None, description="default: every subset whose file is present")
    name: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="its name in the keys eval/compositionality/NAME/...; default: benchmark",
    )

    @model_validator(mode="after")
    def _known(self) -> CompositionalitySet:
        from mdc.evaluation.compositionality import benchmark_subsets  # the evaluation stack: only where one is named

        unknown = sorted(set(self.subsets or ()) - set(benchmark_subsets(self.benchmark)))
        if unknown:
            raise ValueError(f"subsets {unknown} are not {self.benchmark} subsets: {benchmark_subsets(self.benchmark)}")
        if self.root is None and self.benchmark != "shapes":
            raise ValueError(f"root is required for {self.benchmark} (the folder holding its JSON files)")
        return self

    @property
    def key(self) -> str:
        return self.name or self.benchmark


class CaptionSet(_Section):
    """Held-out captioned shards the model writes captions for, scored by BLEU-4 and CIDEr-D."""

    uri: str | None = Field(
        None, description="a folder of .tar or .parquet shards (local or s3://); unset: data.val_uri"
    )
    name: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="its name in the keys eval/captions/NAME/...; default: the folder's name (its dataset's for "
        "train/, val/, test/)",
    )
    lengths: list[int | Literal["predicted", "reference"]] = Field(
        [10],
        min_length=1,
        description="N' of the captions (at most data.max_length); also predicted (the length head's) and "
        "reference (each image's median reference length: an upper bound)",
    )
    limit: int | None = Field(100, ge=1, description="captions of the first N distinct images")


class EvalConfig(_Section):
    """What judges the encoder: probes, compositionality benchmarks, captions (docs/evaluation.md).

    Each figure has one key (eval/probe/NAME/accuracy, eval/compositionality/NAME/SUBSET,
    eval/captions/NAME/N10/cider) at the end of tune, compare, scaling, study and the demo, in `mdc
    eval all`, and every N steps while training (a checkpoint each, evaluated in a Ray task of its own
    beside the training workers, logged against the step). Unset lists come from the training data
    when `mdc data` wrote it (its labels, its pairs, its val split)."""

    probes: list[ProbeSet] | None = Field(
        None, description="linear probes, e.g. [{dataset: cifar10, root: /data/cifar-10-batches-py}]"
    )
    compositionality: list[CompositionalitySet] | None = Field(
        None, description="benchmarks, e.g. [{benchmark: aro, root: /data/aro}]"
    )
    captions: list[CaptionSet] | None = Field(None, description="caption sets, e.g. [{uri: s3://b/coco/val}]")
    samples: int = Field(8, ge=1, description="Monte Carlo draws per caption score (compositionality)")
    seed: int | None = Field(None, description="the draws of scores and samplers; unset: train.seed")
    limit: int | None = Field(200, ge=1, description="compositionality items per subset")
    normalize: Literal["none", "token"] = Field(
        "none", description="compositionality: summed or per-token log-likelihood"
    )
    random_init: bool = Field(
        True,
        description="also probe the architecture at random init: eval/probe/NAME/random_init_accuracy, /gain and their balanced-accuracy twins",
    )
    probe_every: int | None = Field(None, ge=1, description="during training: the probes every N steps")
    compositionality_every: int | None = Field(
        None, ge=1, description="during training: compositionality every N steps"
    )
    captions_every: int | None = Field(None, ge=1, description="during training: captions every N steps")
    cpus: float = Field(
        0.5,
        ge=0.0,
        description="CPUs set aside for the run's evaluations during training (a bundle made before its workers are placed)",
    )
    gpus: float = Field(0.0, ge=0.0, description="GPUs set aside the same way; the evaluations then run on that GPU")
    timeout_s: float = Field(1800.0, gt=0.0, description="how long the driver waits for the last evaluations")

    @model_validator(mode="after")
    def _distinct_names(self) -> EvalConfig:
        for field in ("probes", "compositionality", "captions"):
            names = [item.key for item in getattr(self, field) or () if getattr(item, "key", None)]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"eval.{field}: two entries named {twice[0]!r}; give each its own `name`")
        return self

    def evaluations_at(self, step: int) -> tuple[str, ...]:
        """The evaluations of checkpoint `step` during training: "probe", "compositionality", "captions"."""
        every = {
            "probe": self.probe_every,
            "compositionality": self.compositionality_every,
            "captions": self.captions_every,
        }
        return tuple(name for name, n in every.items() if n and step % n == 0)

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates while it trains."""
        return bool(self.probe_every or self.compositionality_every or self.captions_every)


class RunConfig(_Section):
    name: str = "mdc-demo"
    storage_uri: str = "runs/checkpoints"
    mlflow_uri: str = "sqlite:///mlflow.db"
    experiment: str = "mdc"
    registered_model: str | None = None  # its MLflow Model Registry name; None: the run's (a sweep's: the sweep's)
    model: ModelConfig = ModelConfig()
    objective: ObjectiveConfig = MdcObjective()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    validation: ValidationConfig = ValidationConfig()
    workers: WorkersConfig = WorkersConfig()
    compute: ComputeConfig = ComputeConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _global_batch_in_micro_batches(self) -> RunConfig:
        if self.global_batch % self.train.batch_size:
            raise ValueError(
                f"train.global_batch_size {self.global_batch} is not a multiple of train.batch_size "
                f"{self.train.batch_size}: a step is a whole number of micro-batches"
            )
        return self

    @model_validator(mode="after")
    def _objective_needs(self) -> RunConfig:
        if self.model.predict_length and self.objective.name not in MASKED_OBJECTIVES:
            raise ValueError(f"model.predict_length applies to {MASKED_OBJECTIVES}, not {self.objective.name!r}")
        need = SECTIONS[self.objective.name].time
        if self.model.time_conditioning and need == "never":
            raise ValueError(
                f"model.time_conditioning=true needs a noise level t, which {self.objective.name!r} "
                "has not; set it false for autoregressive objectives"
            )
        if self.model.time_conditioning is False and need == "required":
            raise ValueError(
                f"model.time_conditioning=false: {self.objective.name!r} denoises at a noise level t it must "
                "read; set model.time_conditioning=true or leave it unset"
            )
        return self

    @property
    def time_conditioned(self) -> bool:
        """Whether the denoiser reads t: as set, else as the objective needs."""
        if self.model.time_conditioning is not None:
            return self.model.time_conditioning
        return SECTIONS[self.objective.name].time == "required"

    @property
    def global_batch(self) -> int:
        """Pairs per optimiser step, whatever the number of workers."""
        return self.train.global_batch_size or self.train.batch_size * self.workers.max

    @property
    def micro_batches_per_step(self) -> int:
        """The global batch's micro-batches, dealt to however many workers train
        (pipelines/data/deal.py): any group size keeps the global batch, one that does not
        divide this pads the short shares."""
        return self.global_batch // self.train.batch_size


# Field paths that moved when `train` was split into a section per component: a config or an
# override that still names one fails with the new path.
MOVED = {
    "train.checkpoint_every": "checkpoint.every",
    "train.keep_checkpoints": "checkpoint.keep",
    "train.async_checkpoint": "checkpoint.background",
    "train.val_every": "validation.every",
    "train.val_batches": "validation.batches",
    "train.num_workers": "workers.count",
    "train.elastic_resize_monitor_interval_s": "workers.resize_check_s",
    "train.use_gpu": "workers.use_gpu",
    "train.cpus_per_worker": "workers.cpus",
    "train.resources_per_worker": "workers.resources",
    "train.placement_strategy": "workers.placement",
    "train.max_failures": "workers.max_failures",
    "train.max_preemption_failures": "workers.max_preemption_failures",
    "train.compile": "compute.compile",
    "train.activation_checkpointing": "compute.activation_checkpointing",
}


# Fields that are gone, with what says the same now.
REMOVED = {
    "eval.data_uri": "name the held-out data in the eval section: eval.probes: [{dataset: shapes, root: URI}] "
    "and eval.compositionality: [{benchmark: shapes, root: URI}] (docs/evaluation.md)",
}


def _refuse_moved(raw: dict, source: str) -> None:
    for old, new in MOVED.items():
        section, field = old.split(".")
        if isinstance(raw.get(section), dict) and field in raw[section]:
            raise ConfigError(f"invalid config {source}: {old} is now {new}")
    for old, instead in REMOVED.items():
        section, field = old.split(".")
        if isinstance(raw.get(section), dict) and field in raw[section]:
            raise ConfigError(f"invalid config {source}: {old} is gone; {instead}")


def _parse_value(text: str):
    """`key=value` values are YAML scalars: `0.5`, `true`, `null`, `mdc`."""
    return yaml.safe_load(text) if text != "" else ""


def _set(raw: dict, dotted: str, value, item: str) -> None:
    node = raw
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[leaf] = value


def _override(raw: dict, pairs: list[tuple[str, Any, str]]) -> dict:
    """`raw` with each (dotted key, value, as the user wrote it) set. An override of `objective.name`
    switches objective: the objective fields the new one has not and no override set are the old
    one's settings and go; the fields both have stay (mdc's schedule for cmlm)."""
    for dotted, value, item in pairs:
        _set(raw, dotted, value, item)
    keys = {dotted for dotted, _, _ in pairs}
    objective = raw.get("objective")
    if "objective.name" in keys and isinstance(objective, dict) and objective.get("name") in SECTIONS:
        fields = SECTIONS[objective["name"]].model_fields
        raw["objective"] = {k: v for k, v in objective.items() if k in fields or f"objective.{k}" in keys}
    return raw


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        dotted, value = item.split("=", 1)
        pairs.append((dotted, _parse_value(value), item))
    return _override(raw, pairs)


def _objective_error(e: dict, loc: list, msg: str, got) -> tuple[list, str, Any]:
    """An error in the objective union as the user wrote it: `objective.FIELD`, not pydantic's
    `objective.MEMBER.FIELD`; a bad name lists the names, another objective's field says whose."""
    if e["type"] == "union_tag_invalid":
        return ["objective", "name"], f"expected one of {e['ctx']['expected_tags']}", e["ctx"]["tag"]
    if e["type"] == "union_tag_not_found":
        return loc, "expected a mapping with a name, e.g. {name: mdc}", got
    if len(loc) < 2 or loc[1] not in SECTIONS:
        return loc, msg, got
    member, loc = loc[1], loc[:1] + loc[2:]
    if e["type"] == "extra_forbidden":
        owners = [name for name, config in SECTIONS.items() if loc[-1] in config.model_fields]
        close = difflib.get_close_matches(str(loc[-1]), [f for f in SECTIONS[member].model_fields if f != "name"], 1)
        msg = f"unknown field for {member!r}" + (
            f"; {loc[-1]} applies to {', '.join(owners)}"
            if owners
            else f"; did you mean objective.{close[0]}?" * bool(close)
        )
    return loc, msg, got


def _siblings(loc: list) -> list[str]:
    """The field names known where `loc` points (its parent's fields), for a did-you-mean."""
    model: Any = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int) or not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue  # a list entry: the item model was taken at its field already
        if part not in model.model_fields:
            return []
        annotation = model.model_fields[part].annotation
        members = [annotation, *get_args(annotation)]
        members += [inner for m in members if get_origin(m) is list for inner in get_args(m)]
        model = next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _did_you_mean(loc: list) -> str:
    """`; did you mean train.steps?` for `train.stpes` (difflib's closest known field), else ''."""
    close = difflib.get_close_matches(str(loc[-1]), _siblings(loc), n=1, cutoff=0.6)
    return f"; did you mean {'.'.join(str(p) for p in [*loc[:-1], close[0]])}?" if close else ""


def _explain(err: ValidationError, source: str, overrides: Mapping[str, str] = {}) -> ConfigError:
    """One line per error, naming the field (and the override that set it); one error: one line.
    An unknown field names the closest known one."""
    lines, from_overrides = [], []
    for e in err.errors():
        loc, msg, got = list(e["loc"]), e["msg"].removeprefix("Value error, "), e.get("input")
        if e["type"] == "extra_forbidden":
            msg = "unknown field" + _did_you_mean(loc)
        if loc[:1] == ["objective"]:
            loc, msg, got = _objective_error(e, loc, msg, got)
        dotted = ".".join(str(p) for p in loc)
        # the override that set this field, or a section above or below it
        item = next(
            (i for key, i in overrides.items() if f"{key}.".startswith(f"{dotted}.") or dotted.startswith(f"{key}.")),
            None,
        )
        from_overrides.append(item)
        lines.append(f"{dotted or '(root)'}: {msg} (got {got!r})")
    what = f"config {source}"
    if all(from_overrides):  # the file is not to blame
        what = "override " + ", ".join(dict.fromkeys(from_overrides))
    if len(lines) == 1:
        return ConfigError(f"invalid {what}: {lines[0]}")
    return ConfigError(f"invalid {what}:\n" + "\n".join(f"  {line}" for line in lines))


def build_config(raw: dict, source: str = "<dict>", overrides: Mapping[str, str] = {}) -> RunConfig:
    _refuse_moved(raw, source)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise _explain(err, source, overrides) from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    given = {item.split("=", 1)[0]: item for item in overrides if "=" in item}
    return build_config(apply_overrides(raw, list(overrides)), str(path or "<defaults>"), given)


def derive(cfg: RunConfig, overrides: Mapping[str, Any] | Sequence[str] = ()) -> RunConfig:
    """The one way to make a config from another: `cfg` with `overrides` (dotted keys to values,
    taken as given, or `section.key=value` strings, values read as YAML) on a copy of its fields,
    validated once; `objective.name` switches objective (`_override`)."""
    raw = cfg.model_dump()
    if isinstance(overrides, Mapping):
        _override(raw, [(dotted, value, dotted) for dotted, value in overrides.items()])
    else:
        apply_overrides(raw, list(overrides))
    return build_config(raw, source=f"derived from {cfg.name}")


def load_exported_config(path: str | Path) -> RunConfig:
    """The config.yaml exported beside a checkpoint's weights, also one written before the config
    had a section per component and a config per objective: a checkpoint outlives the version
    that wrote it, so its old paths are read at their new places (a user's file is refused instead)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    for old, new in MOVED.items():
        (section, field), (to, key) = old.split("."), new.split(".")
        if isinstance(raw.get(section), dict) and field in raw[section]:
            raw.setdefault(to, {})[key] = raw[section].pop(field)
    old_eval = raw.get("eval") if isinstance(raw.get("eval"), dict) else {}
    data_uri = old_eval.pop("data_uri", None)
    if data_uri:  # held-out shapes-like data, before the eval section named its sets
        old_eval.setdefault("probes", [{"dataset": "shapes", "root": data_uri}])
        old_eval.setdefault("compositionality", [{"benchmark": "shapes", "root": data_uri}])
    objective = raw.get("objective")
    if isinstance(objective, dict) and objective.get("name") in SECTIONS:  # the flat union: every field
        fields = SECTIONS[objective["name"]].model_fields
        raw["objective"] = {k: v for k, v in objective.items() if k in fields}
    return build_config(raw, source=str(path))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
