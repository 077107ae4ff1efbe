"""Evaluation during training (pipelines/run/online_eval.py): which steps are evaluated, that an
evaluation reads the checkpoint's own weights, that rank 0 hands checkpoints over without waiting,
and a run on an unlabelled img2dataset folder that logs, while it trains, a probe on CIFAR-10's
python batches, ARO-format compositionality and captions against step, under the keys every command
uses, each equal to `mdc eval all` on the same checkpoint."""

import json
import threading

import pytest
import torch
from helpers import EVAL_KEYS, eval_overrides
from mlflow.tracking import MlflowClient
from ray.util import placement_group_table
from typer.testing import CliRunner

from mdc.config import ConfigError, derive, load_config
from mdc.evaluation import probe, suite
from mdc.training import checkpoint as ckpt
from pipelines.cli import app
from pipelines.run import online_eval
from pipelines.worker import online
from pipelines.worker.checkpointer import Checkpointer

PROBE = "eval/probe/cifar10/accuracy"
HELD_OUT = ["eval.probes=[{dataset: shapes, root: held-out}]"]


def config(*overrides):
    return load_config(None, ["data.max_length=16", "train.steps=50", "checkpoint.every=20", *overrides])


def test_online_steps_are_checkpoint_steps_that_carry_the_weights():
    cfg = config("eval.probe_every=15", "eval.compositionality_every=30", "eval.captions_every=25", *HELD_OUT)
    assert [cfg.eval.evaluations_at(s) for s in (15, 20, 25, 30, 45, 50)] == [
        ("probe",),
        (),
        ("captions",),
        ("probe", "compositionality"),
        ("probe",),
        ("captions",),
    ]
    saver = Checkpointer.__new__(Checkpointer)
    saver.cfg = cfg
    assert [s for s in range(1, 51) if saver.due(s)] == [15, 20, 25, 30, 40, 45, 50]
    assert [s for s in range(1, 51) if saver.exports(s)] == [15, 25, 30, 45, 50]  # the last for evaluation
    with pytest.raises(ConfigError, match="eval.probe_every needs eval.probes"):
        suite.resolve_section(config("eval.probe_every=15", "data.train_uri=/nowhere/folder"))


class Recorder:
    """Stands in for the evaluator actor: records what `submit.remote` was called with."""

    def __init__(self):
        self.calls = []
        self.submit = self

    def remote(self, *args):
        self.calls.append(args)
        return f"ref{args[0]}"


def test_rank0_hands_over_each_due_checkpoint_once_it_is_complete_and_waits_for_the_acks_at_the_last(monkeypatch):
    acknowledged = []
    monkeypatch.setattr(online, "ask", lambda refs, what: acknowledged.append(list(refs)))
    evaluator = Recorder()
    callback = online.EvaluationHandOver(config("eval.probe_every=20", *HELD_OUT), "/runs/r", evaluator)
    for step in (20, 40):
        for rank in (0, 1):
            for at in ("shard_written", "committed"):
                callback.checkpoint(step, rank, at)
    assert acknowledged == []  # training never waits for the evaluator
    callback.checkpoint(50, 1, "committed")
    callback.checkpoint(50, 0, "committed")  # the last checkpoint, not an online step
    assert evaluator.calls == [(20, "/runs/r/checkpoint_00000020"), (40, "/runs/r/checkpoint_00000040")]
    assert acknowledged == [["ref20", "ref40"]]


def test_an_evaluation_runs_where_its_bundle_says(monkeypatch):
    """eval.gpus > 0: the model moves to the GPU Ray gave the task (here the meta device stands in)."""
    assert online_eval.evaluation_device(0.0) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="eval.gpus = 1, but the evaluation task sees no CUDA device"):
        online_eval.evaluation_device(1.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert online_eval.evaluation_device(0.5) == torch.device("cuda")
    cfg = config("eval.probe_every=20", *HELD_OUT)
    seen = []

    def evaluate(subject, ev, which, endpoint_url, baseline):
        seen.append((next(subject.captioner.parameters()).device, which, baseline))
        return suite.Evaluation({PROBE: 1.0})

    monkeypatch.setattr(suite, "evaluate", evaluate)
    weights = probe.random_init(cfg).state_dict()
    figures = online_eval.evaluate_weights(cfg, weights, ("probe",), 1, torch.device("meta"), {"b": 0.5})
    assert figures == {PROBE: 1.0} and seen == [(torch.device("meta"), ("probe",), {"b": 0.5})]
    assert online_eval.bundle(derive(cfg, {"eval.cpus": 0.25, "eval.gpus": 1})) == {"CPU": 0.25, "GPU": 1}
    assert online_eval.bundle(derive(cfg, {"eval.cpus": 0.0})) == {}  # asks for nothing: nothing to set aside
    assert online_eval.bundle(config("eval.cpus=2")) == {}  # no online evaluation


def test_an_evaluation_scores_the_checkpoints_own_weights(shapes_dir, cifar10_dir, monkeypatch):
    """The one evaluation is handed a model with exactly the checkpoint's weights (seed 7's: no fresh
    build has them), in eval mode, and its figures are that model's, scored independently."""
    cfg = suite.resolve_section(
        config(
            f"data.train_uri={shapes_dir / 'train'}", "eval.probe_every=20", *eval_overrides(cifar10_dir, shapes_dir)
        )
    )
    trained, scored, evaluate = probe.random_init(cfg, seed=7), [], suite.evaluate
    monkeypatch.setattr(
        suite, "evaluate", lambda subject, *a, **k: scored.append(subject) or evaluate(subject, *a, **k)
    )
    figures = online_eval.evaluate_weights(cfg, trained.state_dict(), ("probe", "compositionality"), threads=1)
    [subject] = scored
    assert not subject.captioner.training and subject.encoder is subject.captioner
    for (name, value), expected in zip(subject.captioner.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(value, expected), name
    alone = evaluate(suite.of_captioner(trained, cfg), cfg.eval, ("probe", "compositionality")).metrics
    assert figures == alone and set(figures) == {k for k in EVAL_KEYS if "/captions/" not in k}


def test_the_summary_line_names_each_step_and_its_error():
    line = online_eval.summary_line(
        [
            {"step": 10, PROBE: 0.5, "seconds": 3.0},
            {"step": 20, PROBE: 0.625, "eval/compositionality/aro/macro": 0.75, "eval/compositionality/aro/x": 0.1},
            {"step": 30, "error": "not finished within eval.timeout_s = 5 s"},
        ]
    )
    assert line == (
        f"online evaluation — step 10: {PROBE} 0.500; step 20: eval/compositionality/aro/macro 0.750, "
        f"{PROBE} 0.625; step 30: not finished within eval.timeout_s = 5 s"
    )


def release_when_logged(stop, mlflow_uri: str, key: str, step: int, path) -> None:
    """Writes `path` once some run in `mlflow_uri` has logged `key` at `step` (polled until `stop`)."""
    client = MlflowClient(mlflow_uri)
    while not stop.wait(1.0):
        ids = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(ids) if ids else []
        if any(m.step == step for run in runs for m in client.get_metric_history(run.info.run_id, key)):
            path.write_text(str(step))
            return


def evaluation_bundles(stop, seen: list) -> None:
    """Every online evaluation bundle Ray holds, polled until `stop`."""
    while not stop.wait(0.5):
        for group in placement_group_table().values():
            if group["name"].endswith("-online-eval") and group["state"] == "CREATED":
                seen.append(group["bundles"])


@pytest.mark.ray
@pytest.mark.timeout(480)
def test_a_run_on_unlabelled_data_logs_its_eval_section_against_step_while_it_trains(
    ray_cluster, img2dataset_dir, cifar10_dir, shapes_dir, tmp_path
):
    """Two workers (0.5 CPU each) and ingest take every CPU but the evaluation's 0.25, which the run
    sets aside before its workers are placed: the step-10 evaluation is logged while the run trains.
    The workers wait at step 21 until it is (HoldUntilFile): an evaluation that waited for training
    to end would never be logged, and the hold would fail the run."""
    from pipelines.run.driver import run_training
    from pipelines.worker.callbacks import HoldUntilFile

    cfg = load_config(
        None,
        [
            "name=online",
            f"storage_uri={tmp_path / 'ckpt'}",
            f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"data.train_uri={img2dataset_dir}",  # no labels: what judges it is the eval section's
            "data.val_uri=null",
            "data.max_length=16",
            "train.batch_size=8",
            "train.steps=30",
            "checkpoint.every=100",
            "train.log_every=10",
            "optim.warmup_steps=5",
            "eval.probe_every=10",
            "eval.compositionality_every=30",
            "eval.captions_every=30",
            *eval_overrides(cifar10_dir, shapes_dir),
            "eval.cpus=0.25",  # ingest keeps 0.75 of the 2 CPUs
            "eval.timeout_s=240",
        ],
    )
    stop, bundles, released = threading.Event(), [], tmp_path / "step-10-probe-logged"
    watchers = [
        threading.Thread(target=evaluation_bundles, args=(stop, bundles), daemon=True),
        threading.Thread(target=release_when_logged, args=(stop, cfg.mlflow_uri, PROBE, 10, released), daemon=True),
    ]
    for watcher in watchers:
        watcher.start()
    try:
        summary = run_training(cfg, callbacks=[HoldUntilFile(step=21, path=str(released), timeout_s=240)])
    finally:
        stop.set()
        for watcher in watchers:
            watcher.join(timeout=10)
    assert released.exists()
    assert bundles and all(b == {0: {"CPU": 0.25}} for b in bundles), bundles[:3]
    client = MlflowClient(cfg.mlflow_uri)
    logged = {k for k in client.get_run(summary.mlflow_run_id).data.metrics if k.startswith("eval/")}
    assert logged == EVAL_KEYS  # every figure, under the key every command logs it with
    steps = {key: [m.step for m in client.get_metric_history(summary.mlflow_run_id, key)] for key in EVAL_KEYS}
    assert all(sorted(s) == ([10, 20, 30] if "/probe/" in k else [30]) for k, s in steps.items()), steps
    probe_10 = min(m.timestamp for m in client.get_metric_history(summary.mlflow_run_id, PROBE))
    last_loss = max(m.timestamp for m in client.get_metric_history(summary.mlflow_run_id, "loss"))
    print(f"the step-10 probe was logged {(last_loss - probe_10) / 1000:.1f} s before training ended")
    assert probe_10 < last_loss
    assert [r["step"] for r in summary.online] == [10, 20, 30] and not any("error" in r for r in summary.online)
    baselines = {r[PROBE.replace("accuracy", "random_init_accuracy")] for r in summary.online}
    assert len(baselines) == 1  # measured once, handed to every step's evaluation
    run_dir = str(tmp_path / "ckpt" / "online")
    at_10, at_30 = (ckpt.read_weights(ckpt.checkpoint_dir(run_dir, s)) for s in (10, 30))
    assert any(not torch.equal(at_10[k], at_30[k]) for k in at_30)  # each step scored its own weights

    out = tmp_path / "all.json"  # the final checkpoint judged again by `mdc eval all`: the same figures
    result = CliRunner().invoke(
        app, ["eval", "all", "--checkpoint", summary.checkpoint_uri, "--out", str(out), "--mlflow-uri", ""]
    )
    assert result.exit_code == 0, result.output
    again = json.loads(out.read_text())["metrics"]
    final = {k: v for k, v in summary.online[2].items() if k.startswith("eval/")}
    clock = "captions_per_s"  # a speed, not a score
    assert {k: v for k, v in again.items() if clock not in k} == {k: v for k, v in final.items() if clock not in k}
    print("online probe at steps 10, 20, 30:", [r[PROBE] for r in summary.online])
    artifacts = [a.path for a in client.list_artifacts(summary.mlflow_run_id, "report")]
    assert "report/online.png" in artifacts
    left = [g["state"] for g in placement_group_table().values() if g["name"] == "online-online-eval"]
    assert left and "CREATED" not in left, left  # the run gave its bundle back when it ended
