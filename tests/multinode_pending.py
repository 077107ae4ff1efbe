# ruff: noqa: F811
"""NOT COLLECTED (the name does not start with test_): two multi-node tests written for issue 26
and not yet seen to pass; move them into tests/test_multinode.py once they do.

Seen on 2026-12-02 on a 2-core machine loaded by another suite (one run each):
- test_losing_...: the first run failed as designed when the watcher gave up at 150 s before rank 1
  reached its hold (the fault never fired, so the test went red: "rank 1 never held at step 7").
  With a 480 s deadline the hold fired and the group restarted, but the restarted workers never
  reached step 7: DataStallError (MapBatches(read_shards) produced no row in 300 s), and the next
  test found 1 CPU in the cluster, so the replacement node was most likely not added (the watcher
  thread's failure is not surfaced yet). To look at: whether remove_node/add_node from a thread
  while the driver blocks in fit() works, and make the watcher record its exception in `seen`.
- test_a_study_...: not run on an intact cluster (it got the 1-CPU cluster the test above left and
  refused --max-concurrent 2 with the ConfigError from pipelines.cluster.share_ingest).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray
import yaml
from mlflow.tracking import MlflowClient

from mdc.train import checkpoint as ckpt
from pipelines import tracking
from tests.test_multinode import (  # noqa: F401, F811 (fixtures used by name)
    OBJECT_STORE,
    damaged_data,
    loss_steps,
    multinode,
    node_lines,
    run_logged,
    spread_config,
    steady,
    trained_rows,
)


def remove_when_held(cluster, logs: Path, run_dir: Path, done: threading.Event, seen: dict) -> None:
    """Wait (at most 480 s: a loaded machine starts a cluster and 2 workers slowly) until rank 1
    holds at step 7, checkpoint 6 complete; then kill its node at once, as a preemption would, and
    add a replacement. What it saw goes into `seen`."""
    deadline = time.monotonic() + 480
    while not (logs / "held").exists():
        if done.is_set() or time.monotonic() > deadline:
            seen["error"] = "rank 1 never held at step 7"
            return
        time.sleep(0.2)
    held = (logs / "held").read_text()
    while ckpt.problem(str(run_dir / "checkpoint_00000006")) is not None and time.monotonic() < deadline:
        time.sleep(0.2)  # rank 0 may still be committing it
    seen["checkpoint_6"] = ckpt.problem(str(run_dir / "checkpoint_00000006"))
    seen["removed"] = held
    node = next(n for n in cluster.worker_nodes if n.node_id == held)
    cluster.remove_node(node, allow_graceful=False)
    seen["training_when_removed"] = not done.is_set()
    seen["replacement"] = cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE).node_id


@pytest.mark.timeout(900)  # ~2 min alone, 5-8 on a loaded machine
def test_losing_the_node_of_rank_1_resumes_on_a_replacement_like_an_uninterrupted_run(
    multinode, steady, damaged_data, tmp_path
):
    steady_cfg, steady_summary, steady_logs = steady
    cfg = spread_config(tmp_path, "lost", damaged_data[0])
    done, seen = threading.Event(), {}
    watcher = threading.Thread(
        target=remove_when_held,
        args=(multinode, tmp_path / "logs" / "nodes", tmp_path / "ckpt" / "lost", done, seen),
        daemon=True,
    )
    watcher.start()
    try:
        summary = run_logged(cfg, tmp_path / "logs", hold_step=7, hold_rank=1)
    finally:
        done.set()
        watcher.join(timeout=60)
    assert "error" not in seen, seen
    assert seen["training_when_removed"] and seen["checkpoint_6"] is None  # the fault came mid-run, after 6
    ranks = {rank: node_lines(tmp_path / "logs" / "nodes", rank) for rank in (0, 1)}
    assert ranks[1][0][1] == seen["removed"]  # rank 1 trained on the node that went
    restarted = {node for lines in ranks.values() for _, node in lines[1:]}
    assert seen["replacement"] in restarted and seen["removed"] not in restarted

    run = MlflowClient(cfg.mlflow_uri).get_run(summary.mlflow_run_id)
    steps = tracking.metric_history(cfg.mlflow_uri, summary.mlflow_run_id, ["resumed_from_step"])
    assert [v for _, v in steps["resumed_from_step"]] == [6]
    assert run.info.status == "FINISHED" and summary.metrics["step"] == steady_summary.metrics["step"] == 9
    assert loss_steps(cfg, summary.mlflow_run_id) == loss_steps(steady_cfg, steady_summary.mlflow_run_id)
    assert summary.bad_records == steady_summary.bad_records == damaged_data[1]
    steady_run = MlflowClient(steady_cfg.mlflow_uri).get_run(steady_summary.mlflow_run_id)
    skipped = {k: v for k, v in run.data.metrics.items() if k.startswith("skipped/")}
    assert skipped == {k: v for k, v in steady_run.data.metrics.items() if k.startswith("skipped/")}

    # The data position: epoch 0 goes on without the shards checkpoint 6 had consumed, and trains
    # every row the uninterrupted run's epoch 0 trained.
    rows = trained_rows(tmp_path / "logs" / "rows")
    consumed = {
        rank: set(
            json.loads((tmp_path / "ckpt" / "lost" / "checkpoint_00000006" / f"extra_rank{rank}.json").read_text())[
                "data_position"
            ]["consumed"]
        )
        for rank in (0, 1)
    }
    assert consumed[0] == consumed[1] and consumed[0]
    after = {(shard, row) for epoch, step, shard, row in rows if epoch == 0 and step > 6}
    assert not {shard for shard, _ in after} & consumed[0]
    epoch0 = {(shard, row) for epoch, _, shard, row in rows if epoch == 0}
    assert epoch0 == {(shard, row) for epoch, _, shard, row in trained_rows(steady_logs / "rows") if epoch == 0}
    assert Counter(step for _, step, _, _ in rows if step > 6) == Counter(
        step for _, step, _, _ in trained_rows(steady_logs / "rows") if step > 6
    )  # no step after the resume trained twice


def concurrency_plan(path: Path, steps: int) -> Path:
    """2 arms × 2 seeds of one 0.5-CPU worker each, no evaluation but the training loss."""
    plan = {
        "name": "pairs",
        "seeds": [0, 1],
        "datasets": {"shapes": {"kind": "shapes", "num": 200}},
        "budget": {
            "data.max_length": 16,
            "data.val_uri": None,
            "train.steps": steps,
            "train.batch_size": 8,
            "train.num_workers": 1,
            "train.cpus_per_worker": 0.5,
            "train.log_every": 3,
            "train.checkpoint_every": steps,
            "optim.warmup_steps": 1,
        },
        "arms": {"mdc": {"objective.name": "mdc"}, "cmlm": {"objective.name": "cmlm"}},
        "evaluations": {"probe": False, "compositionality": False, "caption_lengths": []},
        "claims": [{"name": "losses differ", "metric": "final_loss", "arm_a": "mdc", "arm_b": "cmlm"}],
    }
    path.write_text(yaml.safe_dump(plan))
    return path


def most_at_once(intervals: list[tuple[int, int]]) -> int:
    """The largest number of [start, end] intervals that hold one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    most = running = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def test_most_at_once_counts_overlaps():
    assert most_at_once([(0, 10), (5, 15), (10, 20), (16, 30)]) == 2  # one ending as another starts: not 3
    assert most_at_once([(0, 10), (11, 20)]) == 1
    assert most_at_once([(0, 10), (1, 9), (2, 8)]) == 3


def count_worker_groups(stop: threading.Event, counts: list[int]) -> None:
    """How many training worker groups (their placement groups) are placed, every 0.2 s."""
    while not stop.wait(0.2):
        table = ray.util.placement_group_table().values()
        counts.append(sum(1 for pg in table if pg["state"] == "CREATED"))


@pytest.mark.timeout(600)  # ~2 min alone, 5 on a loaded machine
def test_a_study_with_max_concurrent_2_trains_two_at_a_time(multinode, tmp_path, capsys):
    from pipelines.study import load_plan, run_study

    path = concurrency_plan(tmp_path / "plan.yaml", steps=12)
    stop, placed = threading.Event(), []
    watcher = threading.Thread(target=count_worker_groups, args=(stop, placed), daemon=True)
    watcher.start()
    try:
        run_study(load_plan(path), path, tmp_path / "out", max_concurrent=2)
    finally:
        stop.set()
        watcher.join(timeout=10)
    output = capsys.readouterr().out
    assert max(placed) == 2, Counter(placed)  # two worker groups placed at once, never a third

    client = MlflowClient(tracking.absolute_tracking_uri(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"))
    [parent] = client.search_runs(
        [client.get_experiment_by_name("mdc").experiment_id], "tags.`mdc.run_name` = 'study-pairs'"
    )
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(r.data.tags["mdc.run_name"] for r in children) == [
        "pairs-cmlm-s0",
        "pairs-cmlm-s1",
        "pairs-mdc-s0",
        "pairs-mdc-s1",
    ]
    assert all(r.info.status == "FINISHED" for r in children)
    assert most_at_once([(r.info.start_time, r.info.end_time) for r in children]) == 2
    assert "2 run(s) at once (--max-concurrent" in output
    for name in ("pairs-mdc-s0", "pairs-cmlm-s1"):  # one display: every run's lines, each named
        assert f"{name} step 12/12" in output, output[-3000:]
