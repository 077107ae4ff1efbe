"""`mdc scaling`: the dataset-scaling experiment — one model per nested subset size, each probed.

Each size becomes `data.subset_fraction = size / total`: a sample is kept when the hash of its key
is below the fraction, so every smaller subset lies inside every larger one. The training budget
is the same number of steps for every size (`train.steps`), so every model sees the same number of
pairs — steps × global batch, as in the paper — and a small subset is simply repeated
for more epochs; only the number of distinct pairs changes along the curve.

The run is idempotent, so a schedule can start it again and again: a size whose `results.json`
exists beside its checkpoints (STORAGE/NAME-SIZE/results.json, written last) is neither trained nor
probed again, and a size that was interrupted resumes from its last checkpoint (same run name). The
curve (probe accuracy against subset size) and the table go to MLflow as artifacts of one parent
run NAME, whose children are the per-size training runs.
"""

from __future__ import annotations

import functools
import json
import posixpath
import tempfile
import traceback
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pyarrow.fs as pafs

from mdc.config import RunConfig, build_config
from mdc.data import shards, storage
from mdc.evaluation import probe, readers
from mdc.training.checkpoint import load_pretrained
from pipelines.infra import progress, tracking
from pipelines.infra.console import UserError, console, first_line_of
from pipelines.run import concurrency, model_registry, reports
from pipelines.run.driver import run_training

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9}
RESULTS, ERROR = "results.json", "error.txt"
CURVE, TABLE_CSV, TABLE_MD = "scaling_curve.png", "scaling.csv", "scaling.md"
COLUMNS = ("size", "run_name", "fraction", "steps", "pairs_seen", "probe_accuracy", "mlflow_run_id", "checkpoint_uri")


class ScalingError(UserError):
    """Sizes or a dataset manifest the experiment cannot use; the message names the value or file."""


def parse_sizes(text: str) -> list[int]:
    """`5M,10M,20M` or `60,120,200` → sorted distinct pair counts (K, M, B suffixes)."""
    sizes = set()
    for token in filter(None, (t.strip() for t in text.split(","))):
        number, scale = (token[:-1], SUFFIXES[token[-1].upper()]) if token[-1].upper() in SUFFIXES else (token, 1)
        try:
            value = Decimal(number) * scale  # exact: 1.1K is 1100
        except InvalidOperation:
            raise ScalingError(f"--sizes: {token!r} is not a number with an optional K/M/B suffix") from None
        if not value.is_finite() or value < 1 or value != int(value):
            raise ScalingError(f"--sizes: {token!r} must be a whole number of pairs >= 1")
        sizes.add(int(value))
    if not sizes:
        raise ScalingError(f"--sizes: no sizes in {text!r}")
    return sorted(sizes)


def size_label(size: int) -> str:
    """The shortest exact label: 5000000 → 5M, 1500 → 1500, 60 → 60 (used in run names)."""
    for suffix, scale in sorted(SUFFIXES.items(), key=lambda item: -item[1]):
        if size % scale == 0:
            return f"{size // scale}{suffix}"
    return str(size)


def parent_uri(uri: str) -> str:
    return posixpath.dirname(uri.rstrip("/")) if storage.is_s3(uri) else str(Path(uri).resolve().parent)


def read_dataset_manifest(root: str, endpoint_url: str | None = None) -> tuple[str, dict]:
    """(URI, content) of the manifest.json of the dataset at `root`; content is {} when there is none."""
    uri = storage.join(root, shards.MANIFEST)
    try:
        return uri, shards.read_manifest(uri, endpoint_url)
    except storage.StorageError:
        return uri, {}
    except ValueError as err:
        raise ScalingError(str(err)) from None


def split_total(train_uri: str, manifest_uri: str, manifest: dict, endpoint_url: str | None = None) -> int:
    """Samples in the split at `train_uri`: from its dataset's manifest, else from the totals
    img2dataset keeps in the split's `_stats.json`."""
    split = posixpath.basename(train_uri.rstrip("/"))
    try:
        return int(manifest["splits"][split]["num_samples"])
    except (KeyError, TypeError):
        pass
    try:
        total = shards.stats_total(train_uri, endpoint_url)
    except ValueError as err:
        raise ScalingError(str(err)) from None
    if total is None:
        raise ScalingError(
            f"{manifest_uri}: no field splits.{split}.num_samples (or no such file), and no "
            f"{shards.IMG2DATASET_STATS} in {train_uri}; pass --total"
        )
    return total


def subset_fraction(size: int, total: int) -> float:
    if size > total:
        raise ScalingError(f"size {size} is larger than the {total} pairs of the training split")
    return size / total


def read_result(uri: str, endpoint_url: str | None) -> dict | None:
    """The stored result of a finished size, or None (an unreachable store raises, never retrains)."""
    fs, path = storage.open_fs(uri, endpoint_url)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    return json.loads(storage.read_bytes(uri, endpoint_url))


class Probe:
    """Linear probe of exported checkpoints on one labelled dataset, read once on first use."""

    def __init__(self, dataset: str, root: str, endpoint_url: str | None):
        self.dataset, self.root, self.endpoint_url, self.splits = dataset, root, endpoint_url, None

    def check(self) -> None:
        """Fail before any training if the probe dataset cannot be used."""
        if self.dataset not in readers.dataset_kinds():
            raise ScalingError(f"--probe-dataset {self.dataset!r}: expected one of {readers.dataset_kinds()}")
        if self.dataset in readers.SHARD_DATASETS:
            uri, manifest = read_dataset_manifest(self.root, self.endpoint_url)
            if not manifest.get("class_names"):
                raise ScalingError(
                    f"{uri}: no field class_names (or no such file): --probe-data must be a "
                    "labelled dataset written by `mdc data shapes|tuxpaint`"
                )

    def __call__(self, checkpoint_uri: str) -> float:
        if self.splits is None:
            self.splits = [readers.read_split(self.dataset, self.root, s, self.endpoint_url) for s in ("train", "test")]
        model, _ = load_pretrained(checkpoint_uri, "cpu", self.endpoint_url)
        result = probe.linear_probe(*self.splits, lambda split: probe.extract_features(model, split.sources))
        return result["accuracy"]


def size_config(base: RunConfig, name: str, size: int, total: int) -> RunConfig:
    raw = base.model_dump()
    raw["name"] = f"{name}-{size_label(size)}"
    raw["data"]["subset_fraction"] = subset_fraction(size, total)
    return build_config(raw, source=f"size {size}")


def pairs_seen(cfg: RunConfig) -> int:
    return cfg.train.steps * cfg.global_batch


def write_report(rows: list[dict], directory: Path, title: str) -> list[Path]:
    """The curve (PNG) and the table (CSV, Markdown) of the sizes done so far."""
    table = reports.markdown_table(
        COLUMNS[:6],
        [
            [
                str(r["size"]),
                r["run_name"],
                f"{r['fraction']:.4f}",
                str(r["steps"]),
                str(r["pairs_seen"]),
                f"{r['probe_accuracy']:.4f}",
            ]
            for r in rows
        ],
    )
    (directory / TABLE_MD).write_text(title + "\n\n" + table)
    return [
        reports.scaling_png([r["size"] for r in rows], [r["probe_accuracy"] for r in rows], directory / CURVE, title),
        reports.write_csv(directory / TABLE_CSV, COLUMNS, rows),
        directory / TABLE_MD,
    ]


def result_row(cfg: RunConfig, size: int, summary, accuracy: float) -> dict:
    """One size's line of the table, also its results file: what a relaunch reads instead of training."""
    return {
        "size": size,
        "run_name": cfg.name,
        "fraction": cfg.data.subset_fraction,
        "steps": cfg.train.steps,
        "pairs_seen": pairs_seen(cfg),
        "probe_accuracy": accuracy,
        "mlflow_run_id": summary.mlflow_run_id,
        "checkpoint_uri": summary.checkpoint_uri,
    }


def train_size(cfg: RunConfig, size: int, parent: str, probe: Probe, channel=None) -> dict | tuple[str, str, str]:
    """One size trained and probed: its row, also written to its results file; or, when it failed,
    (run name, error line, where its traceback is)."""
    endpoint = cfg.data.endpoint_url
    mlflow_uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    # Created here with the parent tag; run_training finds it by name and logs into it.
    tracking.get_or_create_run(mlflow_uri, cfg.experiment, cfg.name, cfg.model_dump(), parent_run_id=parent)
    try:
        summary = run_training(cfg, channel=channel)
        with concurrency.serialized():  # probes run here, in the driver, one at a time
            accuracy = probe(summary.checkpoint_uri)
    except SystemError:
        raise  # how Ray passes on an interrupt (Ctrl-C, a timeout) that came while it waited: stop
    except Exception as err:
        error_uri = storage.join(cfg.storage_uri, cfg.name, ERROR)
        storage.write_bytes(error_uri, traceback.format_exc().encode(), endpoint)
        console.print(f"{cfg.name}: failed: {first_line_of(err)}", highlight=False)
        return (cfg.name, first_line_of(err), error_uri)
    tracking.log_metrics(mlflow_uri, summary.mlflow_run_id, {f"eval/probe/{probe.dataset}/accuracy": accuracy})
    tracking.log_metrics(mlflow_uri, parent, {"scaling/probe_accuracy": accuracy}, step=size)
    row = result_row(cfg, size, summary, accuracy)
    storage.write_bytes(storage.join(cfg.storage_uri, cfg.name, RESULTS), json.dumps(row, indent=2).encode(), endpoint)
    console.print(f"{cfg.name}: probe {accuracy:.4f}")
    return row


def run_scaling(
    base: RunConfig, sizes: list[int], total: int, name: str, probe: Probe, max_concurrent: int | None = None
) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """Train and probe every size that has no result yet, `max_concurrent` at once (default: what
    fits the cluster); returns one row per finished size and the failed ones as (run name, error
    line, where its traceback is). A failed size does not stop the others; its traceback goes to
    STORAGE/NAME-SIZE/error.txt."""
    endpoint = base.data.endpoint_url
    mlflow_uri = tracking.absolute_tracking_uri(base.mlflow_uri)
    params = {
        "sizes": ",".join(map(str, sizes)),
        "total": total,
        "train_uri": base.data.train_uri,
        "subset_salt": base.data.subset_salt,
        "steps": base.train.steps,
        "pairs_seen": pairs_seen(base),
    }
    parent = tracking.get_or_create_run(mlflow_uri, base.experiment, name, params)
    rows, failures = [], []
    try:
        done, pending = {}, {}
        for size in sizes:
            cfg = size_config(base, name, size, total)
            row = read_result(storage.join(cfg.storage_uri, cfg.name, RESULTS), endpoint)
            if row is not None:
                console.print(f"{cfg.name}: done before (probe {row['probe_accuracy']:.4f}), skipped")
                done[size] = row
            else:
                pending[size] = cfg
        n, pending = concurrency.plan_concurrency(pending, max_concurrent)
        with progress.shared(n, console) as channel:
            calls = {
                size: functools.partial(train_size, cfg, size, parent, probe, channel) for size, cfg in pending.items()
            }
            outcomes = {**done, **concurrency.run_all(calls, n)}
        for size in sizes:  # in size order, whatever the order of finishing
            (failures if isinstance(outcomes[size], tuple) else rows).append(outcomes[size])
        model_registry.alias_best(mlflow_uri, {r["run_name"]: r["probe_accuracy"] for r in rows})
        title = f"{name}: {pairs_seen(base)} pairs seen per model ({base.train.steps} steps)"
        with tempfile.TemporaryDirectory() as directory:
            tracking.log_artifacts(
                mlflow_uri, parent, write_report(rows, Path(directory), title) if rows else [], "scaling"
            )
            if rows:
                console.print(Path(directory, TABLE_MD).read_text(), markup=False)
    except BaseException:
        tracking.finish_run(mlflow_uri, parent, "FAILED")
        raise
    tracking.finish_run(mlflow_uri, parent, "FAILED" if failures else "FINISHED")
    return rows, failures
