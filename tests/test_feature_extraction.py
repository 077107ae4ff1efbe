"""`mdc eval` end to end: Ray Data batch inference against the plain loop, every command through the
CLI into JSON files and MLflow, and checkpoints loaded from an S3 bucket."""

import functools
import json

import boto3
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from mdc.evaluation import probe, readers
from mdc.training.checkpoint import CONFIG, WEIGHTS, load_pretrained
from pipelines.cli import app
from pipelines.infra import tracking
from pipelines.infra.tracking import EVAL_EXPERIMENT
from pipelines.run.feature_extraction import Extractor, checkpoint_model


@pytest.fixture(scope="module")
def checkpoint(untrained_checkpoint):
    return untrained_checkpoint


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_batch_inference_matches_the_local_loop(ray_cluster, checkpoint, shapes_dir, tmp_path):
    model, _ = load_pretrained(checkpoint)
    shapes = readers.read_split("shapes", str(shapes_dir), "train")
    split = readers.Split(shapes.name, shapes.sources[:48], shapes.labels[:48], shapes.class_names)
    arrays = readers.Split(
        "arrays/test",
        np.random.default_rng(0).integers(0, 256, (20, 28, 28), dtype=np.uint8),
        np.zeros(20, np.int64),
        ["x"],
    )
    extractor = Extractor(
        model,
        functools.partial(checkpoint_model, str(checkpoint)),
        "ckpt",
        str(shapes_dir),
        batch_size=16,
        ray_threshold=1,
        cache_dir=tmp_path,
    )
    for data in (split, arrays):  # encoded bytes, then uint8 arrays
        expected = probe.extract_features(model, data.sources, batch_size=64)
        np.testing.assert_allclose(extractor(data), expected, rtol=1e-4, atol=1e-5)
    assert len(list((tmp_path / "ckpt").glob("*.npy"))) == 2


def invoke(*args: str):
    result = CliRunner().invoke(app, ["eval", *args])
    assert result.exit_code == 0, result.output
    return result


def test_every_command_writes_json_and_logs_to_mlflow(checkpoint, shapes_dir, tmp_path):
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["--checkpoint", str(checkpoint), "--mlflow-uri", mlflow_uri]
    invoke(
        "probe",
        *common,
        "--dataset",
        "shapes",
        "--root",
        str(shapes_dir),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "probe.json"),
    )
    invoke(
        "zeroshot",
        *common,
        "--dataset",
        "shapes",
        "--root",
        str(shapes_dir),
        "--limit",
        "4",
        "--samples",
        "2",
        "--template",
        "a {}",
        "--template",
        "a red {}",
        "--out",
        str(tmp_path / "zeroshot.json"),
    )
    invoke(
        "compositionality",
        *common,
        "--benchmark",
        "sugarcrepe",
        "--root",
        str(shapes_dir / "compositionality"),
        "--samples",
        "2",
        "--limit",
        "4",
        "--out",
        str(tmp_path / "sugarcrepe.json"),
    )
    invoke(
        "captions",
        *common,
        "--data",
        str(shapes_dir / "val"),
        "--lengths",
        "4,8,20",
        "--limit",
        "3",
        "--out",
        str(tmp_path / "captions.json"),
    )

    probe_result = json.loads((tmp_path / "probe.json").read_text())
    assert {"accuracy", "random_init_accuracy", "best_c", "val_accuracy"} <= set(probe_result)
    assert json.loads((tmp_path / "zeroshot.json").read_text())["templates"] == ["a {}", "a red {}"]
    sugarcrepe = json.loads((tmp_path / "sugarcrepe.json").read_text())
    assert sugarcrepe["scorer"] == "montecarlo" and set(sugarcrepe["accuracy"]) == {"swap_obj", "swap_att"}
    assert set(sugarcrepe["blind_accuracy"]) == {"swap_obj", "swap_att"} and sugarcrepe["normalize"] == "none"
    captions = json.loads((tmp_path / "captions.json").read_text())
    assert list(captions["lengths"]) == ["4", "8"] and captions["skipped_lengths"] == [20]
    report = (tmp_path / "captions.html").read_text()
    assert report.count('class="caption-image"') == 3 and "CIDEr-D" in report  # one image per captioned image

    client = MlflowClient(tracking.absolute_tracking_uri(mlflow_uri))
    runs = client.search_runs([client.get_experiment_by_name(EVAL_EXPERIMENT).experiment_id])
    assert len(runs) == 4 and all(run.info.status == "FINISHED" for run in runs)
    metrics = {k: v for run in runs for k, v in run.data.metrics.items()}
    assert metrics["eval/probe/shapes/accuracy"] == pytest.approx(probe_result["accuracy"])
    val = f"eval/captions/{shapes_dir.name}"  # the caption set: its dataset's folder (val/ is a split)
    assert {"eval/compositionality/sugarcrepe/macro", f"{val}/N8/cider", "eval/zeroshot/shapes/accuracy"} <= set(
        metrics
    )
    captions_run = next(r for r in runs if f"{val}/N4/bleu4" in r.data.metrics)
    assert {a.path for a in client.list_artifacts(captions_run.info.run_id, "eval")} == {
        "eval/captions.json",
        "eval/captions.html",
    }


def test_results_go_into_the_training_run_with_run_id(checkpoint, shapes_dir, tmp_path):
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.get_or_create_run(tracking.absolute_tracking_uri(mlflow_uri), "mdc", "train-run", {"lr": 1})
    invoke(
        "compositionality",
        "--checkpoint",
        str(checkpoint),
        "--mlflow-uri",
        mlflow_uri,
        "--run-id",
        run_id,
        "--benchmark",
        "aro",
        "--root",
        str(shapes_dir / "compositionality"),
        "--scorer",
        "heuristic",
        "--normalize",
        "token",
        "--limit",
        "2",
        "--out",
        str(tmp_path / "aro.json"),
    )
    run = MlflowClient(tracking.absolute_tracking_uri(mlflow_uri)).get_run(run_id)
    aro = "eval/compositionality/aro"
    assert {f"{aro}/vg_relation", f"{aro}/vg_relation/blind", f"{aro}/macro"} <= set(run.data.metrics)
    assert {
        m.step
        for m in MlflowClient(tracking.absolute_tracking_uri(mlflow_uri)).get_metric_history(run_id, f"{aro}/macro")
    } == {10}  # the checkpoint's step
    assert json.loads((tmp_path / "aro.json").read_text())["normalize"] == "token"


def test_a_missing_field_fails_with_the_file_and_field(checkpoint, tmp_path):
    (tmp_path / "swap_obj.json").write_text(json.dumps({"0": {"filename": "a.jpg", "caption": "a cat"}}))
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "compositionality",
            "--checkpoint",
            str(checkpoint),
            "--benchmark",
            "sugarcrepe",
            "--root",
            str(tmp_path),
            "--mlflow-uri",
            "",
        ],
    )
    assert result.exit_code == 2
    assert "swap_obj.json: item '0': missing field 'negative_caption'" in " ".join(result.output.split())


def test_load_pretrained_from_a_bucket_downloads_once(s3_server, checkpoint, tmp_path):
    bucket = s3_server.make_bucket("eval-checkpoints")
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1")
    for name in (WEIGHTS, CONFIG):
        s3.upload_file(str(checkpoint / name), "eval-checkpoints", f"run/checkpoint_00000010/{name}")
    uri = f"{bucket}/run/checkpoint_00000010"
    model, cfg = load_pretrained(uri, endpoint_url=s3_server.endpoint_url, cache_dir=tmp_path)
    expected, _ = load_pretrained(checkpoint)
    assert cfg.data.max_length == 16
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
    s3.delete_object(Bucket="eval-checkpoints", Key=f"run/checkpoint_00000010/{WEIGHTS}")
    load_pretrained(uri, endpoint_url=s3_server.endpoint_url, cache_dir=tmp_path)  # served from the cache
    with pytest.raises(FileNotFoundError, match="checkpoint_00000011/model.safetensors cannot be read"):
        load_pretrained(f"{bucket}/run/checkpoint_00000011", endpoint_url=s3_server.endpoint_url, cache_dir=tmp_path)


def test_shapes_compositionality_from_a_bucket(s3_server, checkpoint):
    from mdc.data.shapes import write_shapes_dataset
    from mdc.evaluation.compositionality import evaluate_shapes

    bucket = s3_server.make_bucket("eval-shapes")
    write_shapes_dataset(f"{bucket}/shapes", num=80, seed=0, endpoint_url=s3_server.endpoint_url)
    model, _ = load_pretrained(checkpoint)
    result = evaluate_shapes(model, "mdc", f"{bucket}/shapes", s3_server.endpoint_url, "heuristic", limit=2)
    assert result["scorer"] == "heuristic"
    assert set(result["accuracy"]) == {
        "aro/vg_relation",
        "aro/vg_attribution",
        "sugarcrepe/swap_obj",
        "sugarcrepe/swap_att",
    }
    assert result["num_items"]["aro/vg_relation"] > 0
