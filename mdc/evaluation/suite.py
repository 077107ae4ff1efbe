"""One evaluation of an encoder on a run config's `eval` section (docs/evaluation.md): the linear
probes, the compositionality benchmarks and the caption sets it names, as one flat dict of figures
under one naming scheme. Every command that judges an encoder calls `evaluate` — evaluation during
training, `mdc tune`'s ranking, `mdc compare`, `mdc scaling`, `mdc study`, `mdc demo`, `mdc eval` —
so a figure has one MLflow key wherever it is measured:

    eval/probe/NAME/accuracy, eval/probe/NAME/random_init_accuracy, eval/probe/NAME/gain
    eval/probe/NAME/balanced_accuracy, .../random_init_balanced_accuracy, .../balanced_gain
    eval/compositionality/NAME/SUBSET, eval/compositionality/NAME/SUBSET/blind  (SUBSET macro: their mean)
    eval/captions/NAME/N10/bleu4, eval/captions/NAME/N10/cider, eval/captions/NAME/N10/captions_per_s

Plain PyTorch, no Ray: features of large probe datasets from Ray batch inference come in through
`Subject.features` (pipelines/run/feature_extraction.py).
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import nn

from mdc import export, registry
from mdc.config import ConfigError, EvalConfig, RunConfig, derive
from mdc.data import shards, storage
from mdc.data.shapes import COMPOSITIONALITY_DIR
from mdc.evaluation import captioning, compositionality, probe, readers
from mdc.sampling import Decoding
from mdc.training import checkpoint as ckpt

PREFIX = "eval"
MACRO = "macro"  # the subset name of a benchmark's mean over its subsets
KINDS = ("probe", "compositionality", "captions")
CAPTION_FIGURES = ("bleu4", "cider", "captions_per_s")
# What a training run's last report holds, under the names it logs them with: beside the eval keys,
# the figures a study's claim or a comparison's table can name.
RUN_FIGURES = ("loss", "val_loss", "images_per_s")
SET_FIELDS = ("probes", "compositionality", "captions")  # the section's lists, in the order of KINDS
SPLIT_FOLDERS = ("train", "val", "test", "validation")
# A probe's figures: top-1 accuracy, and balanced accuracy (the mean recall over the test classes),
# which a test set of one large class (the emoji groups: People & Body is 65% of test/) needs beside it.
PROBE_FIGURES = ("accuracy", "balanced_accuracy")
GAINS = {"accuracy": "gain", "balanced_accuracy": "balanced_gain"}  # each figure over random init


# ------------------------------------------------------------------------------------------ keys


def probe_key(name: str, figure: str = "accuracy") -> str:
    """eval/probe/NAME/FIGURE: a figure of PROBE_FIGURES, random_init_FIGURE, or its gain (GAINS)."""
    return f"{PREFIX}/probe/{name}/{figure}"


def compositionality_key(name: str, subset: str, blind: bool = False) -> str:
    """eval/compositionality/NAME/SUBSET, and its blind accuracy under .../blind."""
    return f"{PREFIX}/compositionality/{name}/{subset}" + ("/blind" if blind else "")


def captions_key(name: str, length: int | str, figure: str) -> str:
    """eval/captions/NAME/N<length>/FIGURE (bleu4, cider, captions_per_s)."""
    return f"{PREFIX}/captions/{name}/N{length}/{figure}"


# The headline figures, which a model card and a registry version's tags carry: each probe's accuracy
# and gain, each benchmark's macro accuracy, each caption set's CIDEr-D.
HEADLINE = re.compile(
    rf"{PREFIX}/(probe/[^/]+/(accuracy|gain)|compositionality/[^/]+/{MACRO}|captions/[^/]+/N\w+/cider)"
)


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """The headline figures among `metrics`, by key."""
    return {k: v for k, v in sorted(metrics.items()) if HEADLINE.fullmatch(k)}


def figure_patterns(ev: EvalConfig) -> dict[str, str]:
    """Every figure the section measures, as it reads -> its regular expression (a benchmark's
    subsets are known only once its files are read): what `rank_by` and a study's claim are checked
    against."""
    figures = {key: re.escape(key) for key in RUN_FIGURES}
    for spec in ev.probes or ():
        for figure in probe_figures(ev):
            figures[probe_key(spec.key, figure)] = re.escape(probe_key(spec.key, figure))
    for spec in ev.compositionality or ():
        shown = compositionality_key(spec.key, "SUBSET") + "[/blind]"
        figures[shown] = re.escape(compositionality_key(spec.key, "")) + r"\w+(/blind)?"
    for spec in ev.captions or ():
        for key in (captions_key(spec.name, n, f) for n in spec.lengths for f in CAPTION_FIGURES):
            figures[key] = re.escape(key)
    return figures


def probe_figures(ev: EvalConfig) -> tuple[str, ...]:
    """The figures each probe of the section logs: PROBE_FIGURES, and with random_init the same at
    random init and their gains."""
    baseline = (*(f"random_init_{f}" for f in PROBE_FIGURES), *GAINS.values()) if ev.random_init else ()
    return (*PROBE_FIGURES, *baseline)


def check_figure(key: str, ev: EvalConfig, field_name: str) -> None:
    """Raise, naming `field_name`, when `key` is no figure of the section (nor of the run)."""
    figures = figure_patterns(ev)
    if not any(re.fullmatch(pattern, key) for pattern in figures.values()):
        raise ConfigError(
            f"{field_name}: {key!r} is not a figure the eval section measures; its figures: {list(figures)}"
        )


# ----------------------------------------------------------------------------- the section itself


def dataset_root(train_uri: str) -> str:
    """The folder that holds a training split (what `mdc data` writes: ROOT/train, ROOT/val)."""
    return posixpath.dirname(train_uri.rstrip("/")) if storage.is_s3(train_uri) else str(Path(train_uri).parent)


def training_manifest(cfg: RunConfig) -> tuple[str, dict]:
    """(root, manifest) of the dataset `mdc data` wrote that holds data.train_uri; manifest {}
    when there is none (an img2dataset folder, say)."""
    root = dataset_root(cfg.data.train_uri)
    try:
        return root, shards.read_manifest(root, cfg.data.endpoint_url)
    except storage.StorageError:
        return root, {}


def training_split(uri: str, endpoint_url: str | None = None) -> str:
    """The training shards of `uri`: its train/ split when `mdc data` wrote it (a manifest.json in
    it), else the folder itself (an img2dataset folder, say)."""
    try:
        shards.read_manifest(uri, endpoint_url)
    except storage.StorageError:
        return uri
    return storage.join(uri, "train")


def caption_set_name(uri: str) -> str:
    """A caption set's default name: its folder's, or its dataset's for a split folder (shapes/val: shapes)."""
    parts = uri.rstrip("/").split("/")
    return parts[-2] if parts[-1] in SPLIT_FOLDERS and len(parts) > 1 else parts[-1]


def _absolute(uri: str | None) -> str | None:
    """A local path made absolute (evaluations run in Ray tasks in other folders); URIs unchanged."""
    return uri if uri is None or "://" in uri else str(Path(uri).expanduser().resolve())


def held_out_captions(cfg: RunConfig, root: str, manifest: dict) -> str | None:
    """Where captions are written by default: data.val_uri, else the val split of the dataset
    `mdc data` wrote."""
    return cfg.data.val_uri or (storage.join(root, "val") if "val" in manifest.get("splits", {}) else None)


def _defaults(cfg: RunConfig, root: str, manifest: dict) -> dict:
    """The section's unset lists, from the training data when `mdc data` wrote it: a probe of its
    labels, its compositionality pairs, captions of its val split (else data.val_uri's)."""
    ev, kind = cfg.eval, manifest.get("dataset", "shapes")
    has_pairs = manifest.get("compositionality", {}).get("num_pairs", 0) > 0
    val = held_out_captions(cfg, root, manifest)
    labelled = kind if kind in readers.SHARD_DATASETS else "shapes"
    defaults = {
        "probes": ([{"dataset": labelled, "name": kind}] if manifest.get("class_names") else [])
        + ([{"dataset": "emoji-subgroup", "name": "emoji-subgroup"}] if manifest.get("subgroup_names") else []),
        # named after the dataset too: the swap pairs of emoji are not shapes
        "compositionality": [{"benchmark": "shapes", "name": kind}] if has_pairs else [],
        # the paper's N' = 10; named after the dataset `mdc data` wrote, as its probe is
        "captions": [{"uri": val, "name": manifest.get("dataset"), "lengths": [min(10, cfg.data.max_length)]}]
        if val
        else [],
    }
    given = {f: [s.model_dump() for s in getattr(ev, f)] for f in SET_FIELDS if getattr(ev, f) is not None}
    return {**defaults, **given}


def _rooted(sets: dict, root: str, manifest: dict, cfg: RunConfig) -> dict:
    """Every set with its folder: unset roots are the training data's (shapes, tuxpaint), Debian's
    Fashion-MNIST, data.val_uri for captions; all of them absolute."""
    for i, spec in enumerate(sets["probes"]):
        if spec.get("root") is None and spec["dataset"] == "fashion-mnist":
            spec["root"] = readers.FASHION_MNIST_ROOT
        elif spec.get("root") is None:
            if spec["dataset"] not in readers.SHARD_DATASETS or not manifest.get("class_names"):
                raise ConfigError(
                    f"eval.probes.{i}.root: unset, and data.train_uri ({cfg.data.train_uri}) is not a labelled "
                    "dataset `mdc data` wrote: give the folder of the probe's dataset"
                )
            spec["root"] = root
    for i, spec in enumerate(sets["compositionality"]):
        if spec.get("root") is None and not manifest.get("compositionality"):
            raise ConfigError(f"eval.compositionality.{i}.root: unset, and {root} holds no `mdc data shapes` pairs")
        spec["root"] = spec.get("root") or root
    for i, spec in enumerate(sets["captions"]):
        spec["uri"] = spec.get("uri") or held_out_captions(cfg, root, manifest)
        if spec["uri"] is None:
            raise ConfigError(f"eval.captions.{i}.uri: unset, and so is data.val_uri (and no `mdc data` val split)")
        spec["name"] = spec.get("name") or caption_set_name(spec["uri"])
    for spec in (s for field_sets in sets.values() for s in field_sets):
        for key in ("root", "image_dir", "uri"):
            if spec.get(key) is not None:
                spec[key] = _absolute(spec[key])
    return sets


def resolve_section(cfg: RunConfig, manifest: dict | None = None) -> RunConfig:
    """`cfg` with a concrete eval section: unset lists filled from the training data (`_defaults`),
    every set with its absolute folder, the seed set (train.seed unless given). What a run stores
    in its exported config, so `mdc eval all` on its checkpoint measures what it measured.
    `manifest`: what the training data's manifest says, when it is not written yet (a study's)."""
    ev = cfg.eval
    root = dataset_root(cfg.data.train_uri)
    needs_data = (
        any(getattr(ev, f) is None for f in SET_FIELDS)
        or any(s.root is None for s in (*(ev.probes or ()), *(ev.compositionality or ())))
        or any(s.uri is None for s in ev.captions or ())
    )
    if manifest is None:
        manifest = training_manifest(cfg)[1] if needs_data else {}
    sets = _rooted(_defaults(cfg, root, manifest), root, manifest, cfg)
    for every, field_name in zip(("probe_every", "compositionality_every", "captions_every"), SET_FIELDS):
        if getattr(ev, every) and not sets[field_name]:
            raise ConfigError(f"eval.{every} needs eval.{field_name}: {no_sets_reason(cfg, field_name)}")
    for i, spec in enumerate(sets["captions"]):
        too_long = [n for n in spec["lengths"] if isinstance(n, int) and n > cfg.data.max_length]
        if too_long:
            raise ConfigError(
                f"eval.captions.{i}.lengths: N' {too_long} above data.max_length {cfg.data.max_length} "
                "(the model has no position for them)"
            )
    seed = ev.seed if ev.seed is not None else cfg.train.seed
    return derive(cfg, {**{f"eval.{f}": v for f, v in sets.items()}, "eval.seed": seed})


def no_sets_reason(cfg: RunConfig, field_name: str) -> str:
    """Why the section has no set of this kind, and how to name one."""
    example = {
        "probes": "eval.probes=[{dataset: cifar10, root: /data/cifar-10-batches-py}]",
        "compositionality": "eval.compositionality=[{benchmark: aro, root: /data/aro}]",
        "captions": "eval.captions=[{uri: s3://bucket/coco/val}]",
    }[field_name]
    _, manifest = training_manifest(cfg)
    if manifest.get("class_names" if field_name == "probes" else field_name):
        return f"the section names none (an empty list); name one, e.g. {example}"
    return (
        f"none is named, and data.train_uri ({cfg.data.train_uri}) is not a dataset `mdc data` wrote "
        f"(no manifest.json beside it with labels or pairs); name one, e.g. {example}"
    )


def require(cfg: RunConfig, field_name: str, who: str) -> None:
    """One line naming eval.FIELD when a command that needs such a set has none (after `resolve_section`)."""
    if not getattr(cfg.eval, field_name):
        raise ConfigError(f"{who} needs eval.{field_name}: {no_sets_reason(cfg, field_name)}")


def check_section(ev: EvalConfig, endpoint_url: str | None = None) -> None:
    """Fail in seconds, before any cluster work, when a set's folder cannot be reached (or is no
    labelled dataset, no benchmark): one line naming the field."""
    for i, spec in enumerate(ev.probes or ()):
        where = f"eval.probes.{i}.root"
        if spec.root is None:  # the training data's, or Debian's: resolve_section fills it or says why not
            continue
        if spec.dataset in readers.SHARD_DATASETS:
            _reachable(where, spec.root, endpoint_url, "a dataset `mdc data shapes|tuxpaint|emoji` wrote")
            try:
                labelled = bool(shards.read_manifest(spec.root, endpoint_url).get("class_names"))
            except (storage.StorageError, ValueError) as err:
                raise ConfigError(f"{where}: {err}") from None
            if not labelled:
                raise ConfigError(f"{where}: {storage.join(spec.root, shards.MANIFEST)} lists no class_names")
        elif not Path(spec.root).exists():
            raise ConfigError(
                f"{where}: {spec.root} does not exist (expected the {spec.dataset} layout, docs/evaluation.md)"
            )
    for i, spec in enumerate(ev.compositionality or ()):
        where = f"eval.compositionality.{i}.root"
        if spec.root is None:
            continue
        if spec.benchmark == "shapes":
            _reachable(where, storage.join(spec.root, COMPOSITIONALITY_DIR), endpoint_url, "`mdc data shapes` pairs")
        elif not Path(spec.root).is_dir():
            raise ConfigError(f"{where}: {spec.root} is not a folder (expected the {spec.benchmark} JSON files)")
    for i, spec in enumerate(ev.captions or ()):
        if spec.uri is not None:
            _reachable(
                f"eval.captions.{i}.uri", spec.uri, endpoint_url, "a folder of captioned .tar or .parquet shards"
            )


def _reachable(where: str, uri: str, endpoint_url: str | None, expected: str) -> None:
    try:
        storage.check_reachable(uri, endpoint_url)
    except storage.StorageError as err:
        raise ConfigError(f"{where}: {err} (expected {expected})") from None


# ----------------------------------------------------------------------------------- the subject


@dataclass
class Subject:
    """What is judged: an encoder, the same architecture at random init (the probe's baseline), and
    the captioner around the encoder when there is one (compositionality and captions need it)."""

    encoder: nn.Module  # encode_image, image_size: the probe's features
    captioner: nn.Module | None = None
    objective: str | None = None
    random_init: Callable[[int], nn.Module] | None = None  # the architecture at random init from a seed
    baseline_key: tuple | None = None  # subjects with equal keys share their random-init probes
    features: Callable[[readers.Split], np.ndarray] | None = None  # default: computed in this process
    baseline_features: Callable[[readers.Split], np.ndarray] | None = None  # default: of random_init(seed)
    _random_models: dict[int, nn.Module] = field(default_factory=dict, repr=False)

    def encoder_features(self, split: readers.Split) -> np.ndarray:
        return self.features(split) if self.features else probe.extract_features(self.encoder, split.sources)

    def random_init_features(self, split: readers.Split, seed: int) -> np.ndarray:
        if self.baseline_features:
            return self.baseline_features(split)
        if seed not in self._random_models:
            self._random_models[seed] = self.random_init(seed)
        return probe.extract_features(self._random_models[seed], split.sources)


def of_captioner(model: nn.Module, cfg: RunConfig, device="cpu") -> Subject:
    """A captioner (a checkpoint's model) as a subject; its baseline is its architecture at random
    init, shared by every captioner built alike (the registry's builder, the model section, the
    caption length, a null image or not)."""
    return Subject(
        encoder=model,
        captioner=model,
        objective=cfg.objective.name,
        random_init=lambda seed: probe.random_init(cfg, seed=seed).to(device),
        baseline_key=(
            id(registry.objective(cfg.objective.name).build),
            cfg.model.model_dump_json(),
            cfg.data.max_length,
            cfg.objective.null_image,
        ),
    )


def load_subject(source: str, endpoint_url: str | None = None, device: str = "cpu") -> tuple[Subject, RunConfig | None]:
    """(subject, its run config or None) of a checkpoint (local or s3://), a folder `mdc export`
    wrote (its captioner/ is the text side), `timm:NAME` (random init, an encoder alone) or
    `local-dir:DIR` (a timm folder; with DIR/captioner/ also the text side). Registered versions
    (models:/) are resolved to their folder by pipelines/run/model_registry.py first."""
    if not source.startswith(export.ENCODER_KINDS):
        folder = Path(source)
        if (folder / export.CAPTIONER).is_dir():
            source = str(folder / export.CAPTIONER)
        model, cfg = ckpt.load_pretrained(source, device, endpoint_url)
        return of_captioner(model, cfg, device), cfg
    encoder = export.load_encoder(source, device)
    subject = Subject(encoder)
    if source.startswith("local-dir:"):
        subject.random_init = functools.partial(export.random_init_encoder, source, device)
        captioner = Path(source[len("local-dir:") :]).expanduser() / export.CAPTIONER
        if captioner.is_dir():
            model, cfg = ckpt.load_pretrained(captioner, device)
            subject.captioner = export.swap_encoder(model, export.load_encoder(source, device), source).eval()
            subject.objective = cfg.objective.name
            return subject, cfg
    return subject, None


# ------------------------------------------------------------------------------------ evaluation


@dataclass
class Evaluation:
    """The figures (one flat dict, the keys above) and what lies behind them: per set, the probe's
    fit, the compositionality items and text-biased subsets, the captions written (`images`: the
    captioned images of each caption set); `skipped`: what could not be measured, and why."""

    metrics: dict[str, float] = field(default_factory=dict)
    details: dict[str, dict] = field(default_factory=dict)
    images: dict[str, list] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def evaluate(
    subject: Subject,
    ev: EvalConfig,
    which: Iterable[str] = KINDS,
    endpoint_url: str | None = None,
    baseline: dict[str, float] | None = None,
    decoding: Decoding | None = None,
    batch_size: int = 32,
    scorer: str = "auto",
) -> Evaluation:
    """The subject on every set of the section of the kinds in `which`. `baseline`: random-init
    accuracies measured before (`random_init_figures`), else they are measured here (and kept for
    subjects with the same `baseline_key`). `decoding` (captions) and `scorer` (compositionality;
    auto: the objective's own) are `mdc eval`'s options."""
    out, which = Evaluation(), tuple(which)
    unknown = sorted(set(which) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown evaluations {unknown}; expected some of {KINDS}")
    if "probe" in which:
        for spec in ev.probes or ():
            _probe(subject, spec, ev, endpoint_url, baseline or {}, out)
    if "compositionality" in which:
        for spec in ev.compositionality or ():
            _compositionality(subject, spec, ev, endpoint_url, batch_size, scorer, out)
    if "captions" in which:
        for spec in ev.captions or ():
            _captions(subject, spec, ev, endpoint_url, decoding, batch_size, out)
    return out


def _seed(ev: EvalConfig) -> int:
    return ev.seed if ev.seed is not None else 0


def _splits(spec, endpoint_url: str | None) -> tuple[readers.Split, readers.Split]:
    if spec.root is None and spec.dataset != "fashion-mnist":
        raise ConfigError(f"eval.probes: {spec.key} has no root (resolve the section against its run first)")
    root = spec.root or readers.FASHION_MNIST_ROOT
    return readers.read_split(spec.dataset, root, "train", endpoint_url), readers.read_split(
        spec.dataset, root, "test", endpoint_url
    )


_RANDOM_INIT: dict[tuple, dict[str, float]] = {}  # random-init figures by (baseline key, seed, probe dataset, root)


def _probe(subject: Subject, spec, ev: EvalConfig, endpoint_url, baseline: dict, out: Evaluation) -> None:
    train, test = _splits(spec, endpoint_url)
    result = probe.linear_probe(train, test, subject.encoder_features)
    out.details[probe_key(spec.key)] = result
    keys = {figure: probe_key(spec.key, f"random_init_{figure}") for figure in PROBE_FIGURES}
    if not ev.random_init or subject.random_init is None:
        random_init = None
    elif all(key in baseline for key in keys.values()):
        random_init = {figure: baseline[key] for figure, key in keys.items()}
    else:
        random_init = _random_init_probe(subject, spec, train, test, _seed(ev))
    for figure, key in keys.items():  # each figure beside its random-init value and gain
        out.metrics[probe_key(spec.key, figure)] = result[figure]
        if random_init is not None:
            out.metrics[key] = random_init[figure]
            out.metrics[probe_key(spec.key, GAINS[figure])] = result[figure] - random_init[figure]


def _random_init_probe(subject: Subject, spec, train: readers.Split, test: readers.Split, seed: int) -> dict:
    """The probe's figures (PROBE_FIGURES) of the subject's architecture at random init from `seed`,
    measured once per baseline key."""
    cache_key = (subject.baseline_key, seed, spec.dataset, spec.root) if subject.baseline_key else None
    if cache_key not in _RANDOM_INIT:
        features = functools.partial(subject.random_init_features, seed=seed)
        result = probe.linear_probe(train, test, features)
        figures = {figure: result[figure] for figure in PROBE_FIGURES}
        if cache_key is None:
            return figures
        _RANDOM_INIT[cache_key] = figures
    return _RANDOM_INIT[cache_key]


def random_init_figures(subject: Subject, ev: EvalConfig, endpoint_url: str | None = None) -> dict[str, float]:
    """The probes' random-init figures alone: measured once for all evaluations of a run."""
    if not ev.random_init or subject.random_init is None:
        return {}
    figures = {}
    for spec in ev.probes or ():
        for figure, value in _random_init_probe(subject, spec, *_splits(spec, endpoint_url), _seed(ev)).items():
            figures[probe_key(spec.key, f"random_init_{figure}")] = value
    return figures


@contextlib.contextmanager
def benchmark_items(spec, endpoint_url: str | None, seed: int) -> Iterator[dict[str, list]]:
    """{subset: items} of a benchmark set; `shapes` pairs in a bucket are copied to a temporary
    folder first (its ARO- and SugarCrepe-format files read as one benchmark)."""
    if spec.benchmark != "shapes":
        yield compositionality.read_benchmark(spec.benchmark, spec.root, spec.image_dir, spec.subsets, seed=seed)
        return
    with ckpt.local_copy(storage.join(spec.root, COMPOSITIONALITY_DIR), endpoint_url) as folder:
        items = {}
        for benchmark in ("aro", "sugarcrepe"):
            wanted = (
                None
                if spec.subsets is None
                else [s for s in spec.subsets if s in compositionality.benchmark_subsets(benchmark)]
            )
            if wanted != []:
                present = compositionality.read_benchmark(benchmark, folder, None, wanted, seed=seed)
                items |= {s: v for s, v in present.items() if s in compositionality.SHAPES_SUBSETS}
        yield items


def _compositionality(
    subject: Subject, spec, ev: EvalConfig, endpoint_url, batch_size: int, scorer: str, out: Evaluation
) -> None:
    if subject.captioner is None:
        out.skipped.append(f"compositionality {spec.key}: an encoder alone scores no captions")
        return
    scorer, score = compositionality.get_scorer(scorer, subject.objective)
    seed = _seed(ev)
    with benchmark_items(spec, endpoint_url, seed) as items:
        result = compositionality.evaluate_compositionality(
            subject.captioner, items, score, ev.samples, batch_size, seed, ev.limit, ev.normalize
        )
    for subset, accuracy in result["accuracy"].items():
        out.metrics[compositionality_key(spec.key, subset)] = accuracy
        if result["blind_accuracy"][subset] is not None:
            out.metrics[compositionality_key(spec.key, subset, blind=True)] = result["blind_accuracy"][subset]
    out.metrics[compositionality_key(spec.key, MACRO)] = result["macro_accuracy"]
    if result["macro_blind_accuracy"] is not None:
        out.metrics[compositionality_key(spec.key, MACRO, blind=True)] = result["macro_blind_accuracy"]
    out.details[f"{PREFIX}/compositionality/{spec.key}"] = {"benchmark": spec.benchmark, "scorer": scorer, **result}


def _captions(subject: Subject, spec, ev: EvalConfig, endpoint_url, decoding, batch_size: int, out: Evaluation) -> None:
    if subject.captioner is None or registry.objective(subject.objective).write is None:
        out.skipped.append(f"captions {spec.name}: {subject.objective or 'an encoder alone'} writes no captions")
        return
    images = captioning.group_by_image(shards.read_shards(spec.uri, endpoint_url), spec.limit)
    if not images:
        raise ValueError(f"eval.captions {spec.name}: no samples in {spec.uri}")
    result = captioning.evaluate_captions(
        subject.captioner, subject.objective, images, spec.lengths, decoding, batch_size, _seed(ev)
    )
    for length, figures in result["lengths"].items():
        out.metrics.update({captions_key(spec.name, length, k): v for k, v in figures.items()})
    out.details[f"{PREFIX}/captions/{spec.name}"] = result
    out.images[spec.name] = images
    if result["skipped_lengths"]:
        out.skipped.append(
            f"captions {spec.name}: lengths {result['skipped_lengths']} (above the model's or not its kind)"
        )


def text_biased(metrics: dict[str, float], name: str) -> list[str]:
    """The subsets of benchmark `name` whose blind accuracy is above BLIND_BIAS_THRESHOLD."""
    pattern = re.escape(compositionality_key(name, "")) + r"(\w+)/blind"
    found = (re.fullmatch(pattern, key) for key in metrics)
    return [
        m.group(1)
        for m in found
        if m and m.group(1) != MACRO and metrics[m.group(0)] > compositionality.BLIND_BIAS_THRESHOLD
    ]
