"""The demo's report.html: one image per held-out caption, the loss curves, every figure under its
MLflow key; also an MLflow artifact."""

import re
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from mdc.config import load_config
from mdc.data import shards
from mdc.evaluation import captioning
from pipelines.commands.demo import write_report
from pipelines.infra import tracking
from pipelines.run import reports


def test_demo_report_holds_every_caption_image_the_curves_and_the_tables(shapes_dir, tmp_path):
    cfg = load_config(None, ["name=report-run", f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    run_id = tracking.get_or_create_run(uri, cfg.experiment, cfg.name, {})
    logger = tracking.MetricLogger(uri, run_id)
    for step in range(1, 41):
        logger.log({"loss": 10 - step / 5, **({"val_loss": 9 - step / 6} if step % 20 == 0 else {})}, step)
    logger.flush()

    images = captioning.group_by_image(shards.read_shards(str(shapes_dir / "val")), 5)
    captions = {
        "sampler": "confidence",
        "num_images": len(images),
        "lengths": {"10": {"bleu4": 0.25, "cider": 1.5, "captions_per_s": 40.0}},
        "captions": [
            {"key": img.key, "references": img.references, "generated": {"10": f"caption <{i}>"}}
            for i, img in enumerate(images)
        ],
    }
    metrics = {
        "eval/probe/shapes/accuracy": 0.8,
        "eval/probe/shapes/random_init_accuracy": 0.5,
        "eval/compositionality/shapes/vg_relation": 0.9,
        "eval/compositionality/shapes/vg_relation/blind": 0.52,
    }
    path = write_report(tmp_path, cfg, SimpleNamespace(mlflow_run_id=run_id), metrics, images, captions)

    page = path.read_text()
    assert len(images) == 5 and page.count('class="caption-image"') == 5
    assert all(img.references[0] in page for img in images) and "caption &lt;3&gt;" in page
    assert page.count('class="curves"') == 1 and (tmp_path / "curves.png").stat().st_size > 5000
    assert re.search(r"<td>eval/compositionality/shapes/vg_relation/blind</td><td>0.5200</td>", page)  # its key
    assert "<td>eval/probe/shapes/accuracy</td>" in page and "CIDEr-D" in page and "N' = 10" in page
    logged = {a.path for a in MlflowClient(uri).list_artifacts(run_id, "report")}
    assert logged == {"report/report.html", "report/curves.png"}


def test_curves_follow_the_logged_history(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.get_or_create_run(uri, "e", "r", {})
    logger = tracking.MetricLogger(uri, run_id)
    logger.log({"loss": 3.0}, 1)
    logger.log({"loss": 2.0, "val_loss": 2.5}, 2)
    logger.flush()
    assert tracking.metric_history(uri, run_id, reports.CURVES) == {
        "loss": [(1, 3.0), (2, 2.0)],
        "val_loss": [(2, 2.5)],
    }


def _claim(low, high, verdict, expect="greater", margin=0.0):
    return {
        "name": f"claim {low}",
        "ci_low": low,
        "ci_high": high,
        "mean_diff": (low + high) / 2,
        "verdict": verdict,
        "expect": expect,
        "margin": margin,
    }


def test_each_claim_row_has_its_own_scale_holding_its_interval_and_zero(tmp_path):
    """A captions/s difference of −138 beside a probe difference of +0.01 must not squash the
    latter: each row spans its own interval, 0 and −margin, with a tenth of room each side."""
    small, large = _claim(-0.01, 0.03, "inconclusive"), _claim(-190.0, -80.0, "reversed")
    at_least = _claim(-0.3, -0.2, "reversed", expect="at_least", margin=0.5)
    assert reports.claim_x_range(small) == pytest.approx((-0.014, 0.034))
    assert reports.claim_x_range(large) == pytest.approx((-209.0, 19.0))
    assert reports.claim_x_range(at_least) == pytest.approx((-0.55, 0.05))
    png = reports.claims_png([small, large, at_least], tmp_path / "claims.png", 0.95)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_panel_no_trial_reported_to_says_why():
    """Every trial failed: the panel says so instead of staying empty (issue 52's empty panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipelines.run.reports import sweep_panel

    rows = [{"lr": 0.1, "loss": None, "error": "boom"}, {"lr": 0.2, "loss": None, "error": "boom"}]
    fig, (empty, full) = plt.subplots(1, 2)
    sweep_panel(empty, rows, "lr", "loss")
    sweep_panel(full, [{"lr": 0.1, "loss": 1.5, "error": ""}], "lr", "loss")
    assert [t.get_text() for t in empty.texts] == [
        "no trial reported loss\n(2 of 2 failed: results.md has their errors)"
    ]
    assert len(full.texts) == 0 and len(full.patches) == 1
    plt.close(fig)
