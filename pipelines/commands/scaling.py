"""`mdc scaling`: the dataset-scaling experiment — one model per nested subset size, each probed.

Each size becomes `data.subset_fraction = size / total`: a sample is kept when the hash of its key
is below the fraction, so every smaller subset lies inside every larger one. The training budget
is the same number of steps for every size (`train.steps`), so every model sees the same number of
pairs — steps × global batch, as in the paper — and a small subset is simply repeated
for more epochs; only the number of distinct pairs changes along the curve.

Every model is judged on the run config's eval section (mdc/evaluation/suite.py), as every command
judges an encoder; the curve is its first probe's accuracy (eval/probe/NAME/accuracy) against the
subset size. The run is idempotent, so a schedule can start it again and again: a size whose
`results.json` exists beside its checkpoints (STORAGE/NAME-SIZE/results.json, written last) is
neither trained nor judged again, and a size that was interrupted resumes from its last checkpoint
(same run name). The curve and the table go to MLflow as artifacts of one parent run NAME, whose
children are the per-size training runs (pipelines/commands/experiment.py).
"""

from __future__ import annotations

import posixpath
import tempfile
from decimal import Decimal, InvalidOperation
from pathlib import Path

from mdc.config import RunConfig, build_config
from mdc.data import shards, storage
from mdc.evaluation import suite
from pipelines.commands import experiment
from pipelines.infra import tracking
from pipelines.infra.console import UserError, console
from pipelines.run import model_registry, reports

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9}
RESULTS = "results.json"
CURVE, TABLE_CSV, TABLE_MD = "scaling_curve.png", "scaling.csv", "scaling.md"
COLUMNS = ("size", "run_name", "fraction", "steps", "pairs_seen", "figure", "value", "mlflow_run_id", "checkpoint")


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


def size_config(base: RunConfig, name: str, size: int, total: int) -> RunConfig:
    raw = base.model_dump()
    raw["name"] = f"{name}-{size_label(size)}"
    raw["data"]["subset_fraction"] = subset_fraction(size, total)
    return build_config(raw, source=f"size {size}")


def pairs_seen(cfg: RunConfig) -> int:
    return cfg.train.steps * cfg.global_batch


def curve_key(cfg: RunConfig) -> str:
    """The figure of the curve: the eval section's first probe's accuracy."""
    return suite.probe_key(cfg.eval.probes[0].key)


def table_row(cfg: RunConfig, size: int, result: dict) -> dict:
    """One size's line of the table."""
    key = curve_key(cfg)
    return {
        "size": size,
        "run_name": cfg.name,
        "fraction": cfg.data.subset_fraction,
        "steps": cfg.train.steps,
        "pairs_seen": pairs_seen(cfg),
        "figure": key,
        "value": result["metrics"][key],
        "mlflow_run_id": result["mlflow_run_id"],
        "checkpoint": result["checkpoint"],
    }


def write_report(rows: list[dict], directory: Path, title: str) -> list[Path]:
    """The curve (PNG) and the table (CSV, Markdown) of the sizes done so far."""
    table = reports.markdown_table(
        COLUMNS[:7],
        [
            [
                str(r["size"]),
                r["run_name"],
                f"{r['fraction']:.4f}",
                str(r["steps"]),
                str(r["pairs_seen"]),
                r["figure"],
                f"{r['value']:.4f}",
            ]
            for r in rows
        ],
    )
    (directory / TABLE_MD).write_text(title + "\n\n" + table)
    return [
        reports.scaling_png([r["size"] for r in rows], [r["value"] for r in rows], directory / CURVE, title),
        reports.write_csv(directory / TABLE_CSV, COLUMNS, rows),
        directory / TABLE_MD,
    ]


def run_scaling(
    base: RunConfig, sizes: list[int], total: int, name: str, max_concurrent: int | None = None
) -> tuple[list[dict], list[experiment.Failure]]:
    """Train and judge every size that has no result yet, `max_concurrent` at once (default: what
    fits the cluster); returns one row per finished size and the failed ones. A failed size does
    not stop the others; its traceback goes to STORAGE/NAME-SIZE/error.txt. `base`'s eval section
    is concrete (suite.resolve_section) and has a probe (the curve's)."""
    params = {
        "sizes": ",".join(map(str, sizes)),
        "total": total,
        "train_uri": base.data.train_uri,
        "subset_salt": base.data.subset_salt,
        "steps": base.train.steps,
        "pairs_seen": pairs_seen(base),
        "figure": curve_key(base),
    }
    configs = {size: size_config(base, name, size, total) for size in sizes}
    with experiment.parent_run(base, name, params) as parent:
        results = experiment.run_runs(
            parent, configs, lambda cfg: storage.join(cfg.storage_uri, cfg.name, RESULTS), max_concurrent
        )
        rows = [table_row(configs[size], size, result) for size, result in results.items()]
        model_registry.alias_best(parent.mlflow_uri, {r["run_name"]: r["value"] for r in rows})
        title = f"{name}: {curve_key(base)}, {pairs_seen(base)} pairs seen per model ({base.train.steps} steps)"
        with tempfile.TemporaryDirectory() as directory:
            paths = write_report(rows, Path(directory), title) if rows else []
            tracking.log_artifacts(parent.mlflow_uri, parent.run_id, paths, "scaling")
            if rows:
                console.print(Path(directory, TABLE_MD).read_text(), markup=False)
    return rows, parent.failures
