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

import csv
import json
import posixpath
import tempfile
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Optional

import traceback

import pyarrow.fs as pafs
import typer

from mdc.data import shards, storage
from mdc.config import DEFAULT_CONFIG, RunConfig, build_config, load_config
from pipelines.console import (VERBOSE_OPTION, Settings, UserError, console, first_line_of, report_failures,
                               user_errors)

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
        raise ScalingError(f"{manifest_uri}: no field splits.{split}.num_samples (or no such file), and no "
                           f"{shards.IMG2DATASET_STATS} in {train_uri}; pass --total")
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
        from mdc.evaluation import readers

        if self.dataset not in readers.dataset_kinds():
            raise ScalingError(f"--probe-dataset {self.dataset!r}: expected one of {readers.dataset_kinds()}")
        if self.dataset in readers.SHARD_DATASETS:
            uri, manifest = read_dataset_manifest(self.root, self.endpoint_url)
            if not manifest.get("class_names"):
                raise ScalingError(f"{uri}: no field class_names (or no such file): --probe-data must be a "
                                   "labelled dataset written by `mdc data shapes|tuxpaint`")

    def __call__(self, checkpoint_uri: str) -> float:
        from mdc.train.checkpoint import load_pretrained
        from mdc.evaluation import probe, readers

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
    return cfg.train.steps * cfg.train.global_batch


def write_report(rows: list[dict], directory: Path, title: str) -> list[Path]:
    """The curve (PNG) and the table (CSV, Markdown) of the sizes done so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [directory / CURVE, directory / TABLE_CSV, directory / TABLE_MD]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["size"] for r in rows], [r["probe_accuracy"] for r in rows], marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("distinct pairs in the training subset")
    ax.set_ylabel("linear probe top-1")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS[:6]) + " |", "|" + " --- |" * 6]
    lines += [f"| {r['size']} | {r['run_name']} | {r['fraction']:.4f} | {r['steps']} | {r['pairs_seen']} | "
              f"{r['probe_accuracy']:.4f} |" for r in rows]
    paths[2].write_text(title + "\n\n" + "\n".join(lines) + "\n")
    return paths


def run_scaling(base: RunConfig, sizes: list[int], total: int, name: str, probe: Probe
                ) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """Train and probe every size that has no result yet; returns one row per finished size and
    the failed ones as (run name, error line, where its traceback is). A failed size does not stop
    the others; its traceback goes to STORAGE/NAME-SIZE/error.txt."""
    from mlflow.tracking import MlflowClient

    from pipelines import tracking
    from pipelines.train import run_training

    endpoint = base.data.endpoint_url
    mlflow_uri = tracking.absolute_tracking_uri(base.mlflow_uri)
    client = MlflowClient(mlflow_uri)
    params = {"sizes": ",".join(map(str, sizes)), "total": total, "train_uri": base.data.train_uri,
              "subset_salt": base.data.subset_salt, "steps": base.train.steps, "pairs_seen": pairs_seen(base)}
    parent = tracking.get_or_create_run(mlflow_uri, base.experiment, name, params)
    rows, failures = [], []
    try:
        for size in sizes:
            cfg = size_config(base, name, size, total)
            results_uri = storage.join(cfg.storage_uri, cfg.name, RESULTS)
            row = read_result(results_uri, endpoint)
            if row is not None:
                console.print(f"{cfg.name}: done before (probe {row['probe_accuracy']:.4f}), skipped")
                rows.append(row)
                continue
            # Created here with the parent tag; run_training finds it by name and logs into it.
            tracking.get_or_create_run(mlflow_uri, cfg.experiment, cfg.name, cfg.model_dump(), parent_run_id=parent)
            try:
                summary = run_training(cfg)
                accuracy = probe(summary.checkpoint_uri)
            except SystemError:
                raise  # how Ray passes on an interrupt (Ctrl-C, a timeout) that came while it waited: stop
            except Exception as err:
                error_uri = storage.join(cfg.storage_uri, cfg.name, ERROR)
                storage.write_bytes(error_uri, traceback.format_exc().encode(), endpoint)
                failures.append((cfg.name, first_line_of(err), error_uri))
                console.print(f"{cfg.name}: failed: {first_line_of(err)}", highlight=False)
                continue
            client.log_metric(summary.mlflow_run_id, f"eval/probe/{probe.dataset}/accuracy", accuracy)
            client.log_metric(parent, "scaling/probe_accuracy", accuracy, step=size)
            row = {"size": size, "run_name": cfg.name, "fraction": cfg.data.subset_fraction,
                   "steps": cfg.train.steps, "pairs_seen": pairs_seen(cfg), "probe_accuracy": accuracy,
                   "mlflow_run_id": summary.mlflow_run_id, "checkpoint_uri": summary.checkpoint_uri}
            storage.write_bytes(results_uri, json.dumps(row, indent=2).encode(), endpoint)
            console.print(f"{cfg.name}: probe {accuracy:.4f}")
            rows.append(row)
        title = f"{name}: {pairs_seen(base)} pairs seen per model ({base.train.steps} steps)"
        with tempfile.TemporaryDirectory() as directory:
            for path in write_report(rows, Path(directory), title) if rows else []:
                client.log_artifact(parent, str(path), artifact_path="scaling")
            if rows:
                console.print(Path(directory, TABLE_MD).read_text(), markup=False)
    except BaseException:
        tracking.finish_run(mlflow_uri, parent, "FAILED")
        raise
    tracking.finish_run(mlflow_uri, parent, "FAILED" if failures else "FINISHED")
    return rows, failures


def scaling(ctx: typer.Context,
            sizes: str = typer.Option(..., help="subset sizes in pairs, K/M/B suffixes: 5M,10M,20M"),
            data: str = typer.Option(..., help="training split (local or s3://); manifest.json is in its parent"),
            name: str = typer.Option(..., help="experiment name: the parent MLflow run; runs are NAME-SIZE"),
            config: Path = typer.Option(DEFAULT_CONFIG, help="YAML run config shared by every size"),
            total: Optional[int] = typer.Option(None, min=1, help="pairs in the split (default: from manifest.json)"),
            probe_dataset: str = typer.Option("shapes", help="kind of the probe's labelled dataset "
                                              "(shapes, tuxpaint: shards, also s3://; others: a local root)"),
            probe_data: Optional[str] = typer.Option(None, help="root of the probe's dataset (default: the "
                                                     "dataset that holds --data)"),
            storage_uri: Optional[str] = typer.Option(None, "--storage", help="checkpoint storage URI (storage_uri)"),
            mlflow_uri: Optional[str] = None,
            address: Optional[str] = typer.Option(None, help="Ray cluster address; default: running or local"),
            verbose: bool = VERBOSE_OPTION):
    """Dataset scaling: one model per nested subset size, the same steps each, probed; a size with a
    stored result is skipped. Extra arguments are `section.key=value` overrides; the validation split
    is the `val` beside --data when the manifest lists one, unless `data.val_uri=` is given."""
    Settings.verbose = verbose
    with user_errors():
        from pipelines.runtime import absolute_paths, absolute_uri, check_inputs, ray_session

        data = absolute_uri(data)
        overrides = [f"data.train_uri={data}"]
        overrides += [f"{k}={v}" for k, v in {"storage_uri": storage_uri, "mlflow_uri": mlflow_uri}.items() if v]
        base = absolute_paths(load_config(config, overrides + list(ctx.args)))
        size_list = parse_sizes(sizes)
        manifest_uri, manifest = read_dataset_manifest(parent_uri(data), base.data.endpoint_url)
        total = total or split_total(data, manifest_uri, manifest, base.data.endpoint_url)
        for size in size_list:
            subset_fraction(size, total)
        probe = Probe(probe_dataset, absolute_uri(probe_data) or parent_uri(data), base.data.endpoint_url)
        probe.check()
        if "val" in manifest.get("splits", {}) and not any(arg.startswith("data.val_uri=") for arg in ctx.args):
            base.data.val_uri = storage.join(parent_uri(data), "val")
        check_inputs(base)
        log = (Path(base.storage_uri) if "://" not in base.storage_uri else Path("mdc-logs")).resolve() / name
        with ray_session(log / "ray.log", address, verbose):
            rows, failures = run_scaling(base, size_list, total, name, probe)
    report_failures("size", len(size_list), failures)
