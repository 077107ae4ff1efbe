"""Elastic training (`workers.count: [MIN, MAX]`) on Ray's multi-node harness on this machine:
a head (the driver's node, one CPU for ingest) and worker nodes that each advertise one `trainer`
resource, the one custom resource a worker needs (`workers.resources`), so a node holds
one worker and the head none.

The run starts on one trainer node with 1 of [1, 2] workers; at step 4 the test adds a second
node and the group grows to 2 from checkpoint 3; at step 8 the test removes it and the group goes
on with 1 from checkpoint 6, to the end. The global batch is the same throughout (16 pairs: 2
micro-batches of 8 on one worker, 1 on each of two); 256 rows keep the 12 steps in epoch 0 (a new
epoch restarts ingest, about a minute here).
"""

from __future__ import annotations

import pytest
from helpers import epoch_order, in_background, multinode_cluster, rows_by_step, run_overrides, wait_until
from mlflow.tracking import MlflowClient

from mdc.config import load_config
from mdc.data.img2dataset import generated_rows, write_img2dataset_folder
from mdc.training import checkpoint as ckpt
from pipelines.infra import tracking
from pipelines.infra.local_cluster import add_node
from pipelines.worker.callbacks import GroupLog, RowRecorder, group_lines

pytestmark = pytest.mark.ray
TRAINER_NODE = {"num_cpus": 1, "resources": {"trainer": 1}}


@pytest.fixture(scope="module")
def one_trainer_node():
    with multinode_cluster(1, TRAINER_NODE) as cluster:
        yield cluster


@pytest.mark.timeout(900)  # ~3 min alone (three worker groups start), more on a loaded machine
def test_an_elastic_group_grows_when_a_node_joins_and_shrinks_when_it_goes(one_trainer_node, tmp_path, capsys):
    from pipelines.run.driver import run_training

    def checkpoint(step: int):
        return ckpt.checkpoint_dir(str(tmp_path / "ckpt" / "elastic"), step)

    data = tmp_path / "data"
    write_img2dataset_folder(
        generated_rows(256, image_size=32, failed_every=0), str(data), "webdataset", samples_per_shard=16
    )
    cfg = load_config(
        None,
        [
            *run_overrides(tmp_path, "elastic", data),
            "workers.count=[1,2]",
            "train.batch_size=8",
            "train.global_batch_size=16",
            "workers.cpus=0.5",
            "workers.resources={trainer: 1}",
            "workers.resize_check_s=2",
            "train.steps=12",
            "checkpoint.every=3",
            "checkpoint.keep=10",
            "train.log_every=1",
            "workers.max_failures=3",
            "optim.warmup_steps=1",
        ],
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "rows").mkdir()
    run = in_background(
        run_training,
        cfg,
        callbacks=[GroupLog(str(logs), holds=((1, 4, 0), (2, 8, 0))), RowRecorder(str(tmp_path / "rows"))],
    )
    wait_until(lambda: (logs / "held_1_4").exists(), run, 420, "the group of 1 to hold at step 4")
    added = add_node(one_trainer_node, **TRAINER_NODE)
    wait_until(lambda: (logs / "held_2_8").exists(), run, 420, "a group of 2 to hold at step 8")
    wait_until(lambda: ckpt.problem(str(checkpoint(6))) is None, run, 60, "checkpoint 6 to be complete")
    one_trainer_node.remove_node(added, allow_graceful=False)  # as a spot preemption would
    assert not run.done()  # both node changes came mid-run
    summary = run.result(timeout=600)

    # Three groups: 1 worker from step 1, 2 from checkpoint 3, 1 again from checkpoint 6.
    assert [(step, world) for step, world, _ in group_lines(logs, 0)] == [(1, 1), (4, 2), (7, 1)]
    assert [(step, world) for step, world, _ in group_lines(logs, 1)] == [(4, 2)]
    history = tracking.metric_history(cfg.mlflow_uri, summary.mlflow_run_id, ["workers", "resumed_from_step"])
    assert history["workers"] == [(0, 1.0), (3, 2.0), (6, 1.0)]
    assert [v for _, v in history["resumed_from_step"]] == [3, 6]
    output = capsys.readouterr().out
    assert "elastic: 1 worker from step 0" in output
    assert "workers 1 → 2 at step 3" in output and "workers 2 → 1 at step 6" in output

    record = MlflowClient(cfg.mlflow_uri).get_run(summary.mlflow_run_id)
    assert record.info.status == "FINISHED" and summary.metrics["step"] == 12
    losses = MlflowClient(cfg.mlflow_uri).get_metric_history(summary.mlflow_run_id, "loss")
    assert sorted({m.step for m in losses}) == list(range(1, 13))
    assert ckpt.problem(str(checkpoint(12))) is None

    # Every optimiser step, whatever the group's size, trained the next 16 rows of epoch 0's one
    # order, 16 / W on each rank; step 7, trained by the group of 2 and again after the shrink
    # (checkpoint 6), the same rows both times.
    order = epoch_order(cfg)
    trained = rows_by_step(tmp_path / "rows")
    assert sorted(trained) == list(range(1, 13))
    for step, (rows, per_rank) in trained.items():
        expected = sorted(order[16 * (step - 1) : 16 * step])
        assert sorted(set(rows)) == expected and len(rows) == 16 * (2 if step == 7 else 1), step
        assert sorted(per_rank.values()) == ([8, 8] if step in (4, 5, 6) else [8, 24] if step == 7 else [16]), step
