"""Dataset scaling: nested subsets of the requested sizes, and `mdc scaling` end to end on the local
Ray — two sizes trained and probed under one MLflow parent, and a rerun that trains nothing."""

import csv
import io
import json
import math

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from mdc.data import shards
from pipelines.cli import app
from pipelines.commands.scaling import (
    ScalingError,
    parse_sizes,
    read_dataset_manifest,
    size_label,
    split_total,
    subset_fraction,
)
from pipelines.data.ingest import Subset


def test_sizes_parse_with_suffixes():
    assert parse_sizes("20M,5M,10M") == [5_000_000, 10_000_000, 20_000_000]
    assert parse_sizes("60, 120,200,120") == [60, 120, 200]
    assert parse_sizes("1.5k,2B,1.1K") == [1100, 1500, 2_000_000_000]
    for bad in ("abc", "0", "1.5", "", "5X", "inf", "nan"):
        with pytest.raises(ScalingError, match="--sizes"):
            parse_sizes(bad)
    assert [size_label(n) for n in (5_000_000, 1500, 60, 2000)] == ["5M", "1500", "60", "2K"]


def test_subsets_are_nested_and_near_the_requested_size():
    """10k keys; each subset within 3 standard deviations of its binomial count, each inside the next."""
    total = 10_000
    samples = [shards.Sample(f"{i:09d}", b"", "a caption") for i in range(total)]
    kept = []
    for size in (500, 1000, 2500, 5000, 9000):
        p = subset_fraction(size, total)
        keys = {s.key for s in Subset(p, "scaling")(samples)}
        assert abs(len(keys) - size) <= 3 * math.sqrt(total * p * (1 - p)), (size, len(keys))
        assert all(previous <= keys for previous in kept)
        kept.append(keys)
    assert kept[0] != {s.key for s in Subset(subset_fraction(500, total), "other salt")(samples)}
    with pytest.raises(ScalingError, match="larger than"):
        subset_fraction(total + 1, total)


def test_total_comes_from_the_manifest_beside_the_split(tmp_path):
    shards.write_manifest(str(tmp_path), {"splits": {"train": {"num_samples": 216}}})
    uri, manifest = read_dataset_manifest(str(tmp_path))
    assert split_total(str(tmp_path / "train"), uri, manifest) == 216
    with pytest.raises(ScalingError, match=r"manifest.json: no field splits.val.num_samples"):
        split_total(str(tmp_path / "val"), uri, manifest)
    assert read_dataset_manifest(str(tmp_path / "nothing"))[1] == {}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sizes", "50,200"], "larger than the 100 pairs"),
        (["--sizes", "5Q"], "--sizes: '5Q'"),
        (["--sizes", "50"], "mdc scaling (its curve is the first probe's accuracy) needs eval.probes"),
        (["--sizes", "50", "eval.probes=[{dataset: mnist9, root: x}]"], "eval.probes.0: dataset 'mnist9'"),
        (["--sizes", "50", "model.preset=huge"], "model.preset"),
    ],
)
def test_bad_inputs_fail_before_any_training(tmp_path, extra, message):
    shards.write_manifest(str(tmp_path), {"splits": {"train": {"num_samples": 100}}})
    result = CliRunner().invoke(app, ["scaling", "--data", str(tmp_path / "train"), "--name", "x", *extra])
    assert result.exit_code == 2 and message in result.output, result.output


def _children(client, parent):
    runs = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return {r.data.tags["mdc.run_name"]: r for r in runs}


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_scaling_curve_under_one_parent_and_rerun_trains_nothing(ray_cluster, shapes_dir, tmp_path):
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [
        "scaling",
        "--sizes",
        "60,200",
        "--data",
        str(shapes_dir / "train"),
        "--name",
        "tiny",
        "--storage",
        str(tmp_path / "ckpt"),
        "--mlflow-uri",
        mlflow_uri,
        "data.val_uri=null",
        "data.max_length=16",
        "train.batch_size=8",
        "workers.count=1",
        "workers.cpus=0.5",
        "train.steps=6",
        "checkpoint.every=6",
        "train.log_every=3",
        "optim.warmup_steps=2",
        "eval.compositionality=[]",  # the default section's probe of the shapes labels alone
        "eval.captions=[]",
    ]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output[-3000:]

    client = MlflowClient(mlflow_uri)
    [parent] = client.search_runs([client.get_experiment_by_name("mdc").experiment_id], "tags.`mdc.run_name` = 'tiny'")
    assert parent.info.status == "FINISHED"
    children = _children(client, parent)
    assert sorted(children) == ["tiny-200", "tiny-60"]
    for run in children.values():
        assert run.info.status == "FINISHED"
        assert {k for k in run.data.metrics if k.startswith("eval/")} == {
            f"eval/probe/shapes/{figure}"
            for figure in ("accuracy", "random_init_accuracy", "gain")
            + ("balanced_accuracy", "random_init_balanced_accuracy", "balanced_gain")
        }
        assert {m.step for m in client.get_metric_history(run.info.run_id, "eval/probe/shapes/accuracy")} == {6}
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "scaling")}
    assert artifacts == {"scaling/scaling_curve.png", "scaling/scaling.csv", "scaling/scaling.md"}
    png = client.download_artifacts(parent.info.run_id, "scaling/scaling_curve.png", str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    table = open(client.download_artifacts(parent.info.run_id, "scaling/scaling.csv", str(tmp_path))).read()
    rows = list(csv.DictReader(io.StringIO(table)))
    total = shards.read_manifest(str(shapes_dir))["splits"]["train"]["num_samples"]
    assert [(r["run_name"], r["figure"]) for r in rows] == [
        ("tiny-60", "eval/probe/shapes/accuracy"),
        ("tiny-200", "eval/probe/shapes/accuracy"),
    ]
    assert rows[0]["pairs_seen"] == str(6 * 8) and float(rows[0]["fraction"]) == 60 / total
    result = json.loads((tmp_path / "ckpt" / "tiny-60" / "results.json").read_text())
    assert (
        float(rows[0]["value"])
        == result["metrics"]["eval/probe/shapes/accuracy"]
        == children["tiny-60"].data.metrics["eval/probe/shapes/accuracy"]
    )

    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output[-3000:]
    assert again.output.count("done before") == 2
    rerun = _children(client, parent)
    assert {n: (r.info.start_time, r.info.end_time) for n, r in rerun.items()} == {
        n: (r.info.start_time, r.info.end_time) for n, r in children.items()
    }
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
