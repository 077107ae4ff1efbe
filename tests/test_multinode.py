"""Training on several Ray nodes, on one machine, with Ray's own harness (`ray.cluster_utils.Cluster`:
each node its own raylet with its own resources): a head with no CPU (the driver's node) and two
1-CPU worker nodes.

- the two workers of a SPREAD run train on two different nodes, checkpoint and finish.

The node-loss and concurrent-study tests are in tests/multinode_pending.py (not collected): they
were written against this harness but not yet seen to pass (see the note there).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
from mlflow.tracking import MlflowClient

from mdc.config import load_config
from mdc.data.img2dataset import damage_folder, generated_rows, write_img2dataset_folder
from mdc.train import checkpoint as ckpt
from pipelines import ray_private
from pipelines.cluster import NodeLog

SHARDS, ROWS_PER_SHARD = 8, 16
OBJECT_STORE = 200 * 1024**2


@pytest.fixture(scope="module")
def multinode():
    """The cluster for this module; the session's local Ray (if a test started it) is stopped
    first and started again after."""
    from ray.cluster_utils import Cluster

    had_local = ray.is_initialized()
    if had_local:
        ray.shutdown()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "object_store_memory": OBJECT_STORE, "include_dashboard": False},
        connect=False,
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        address = cluster.address
        cluster.shutdown()
        ray_private.forget_recorded_address(address)
        if had_local:
            ray.init(num_cpus=2, object_store_memory=512 * 1024**2, include_dashboard=True)


@pytest.fixture(scope="module")
def damaged_data(tmp_path_factory) -> tuple[Path, dict]:
    """8 tar shards of 16 rows; shard 0 with 3 bad records, the last cut in half."""
    root = tmp_path_factory.mktemp("multinode-data")
    write_img2dataset_folder(
        generated_rows(SHARDS * ROWS_PER_SHARD, image_size=32, failed_every=0),
        str(root),
        "webdataset",
        samples_per_shard=ROWS_PER_SHARD,
    )
    return root, damage_folder(str(root), "webdataset")


def spread_config(tmp_path: Path, name: str, data: Path, **train):
    """Two 0.5-CPU workers, one a node (SPREAD), a 0.5-CPU reader: 9 steps, complete checkpoints
    at 3, 6, 9; epoch 0 (about 112 rows) ends in step 7 or 8."""
    items = {"steps": 9, "checkpoint_every": 3, "keep_checkpoints": 10, "log_every": 1, "max_failures": 3, **train}
    return load_config(
        None,
        [
            f"name={name}",
            f"storage_uri={tmp_path / 'ckpt'}",
            f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"data.train_uri={data}",
            "data.val_uri=null",
            "data.max_length=16",
            "data.shuffle_buffer=0",
            "data.ingest_cpus=0.5",
            "train.batch_size=8",
            "train.num_workers=2",
            "train.cpus_per_worker=0.5",
            "train.placement_strategy=SPREAD",
            "optim.warmup_steps=1",
            *[f"train.{k}={v}" for k, v in items.items()],
        ],
    )


def node_lines(directory: Path, rank: int) -> list[tuple[int, str]]:
    """(first step, node id) of each process that rank ran in, in order."""
    lines = (directory / f"rank{rank}.txt").read_text().split()
    return [(int(lines[i]), lines[i + 1]) for i in range(0, len(lines), 2)]


def trained_rows(directory: Path) -> list[tuple[int, int, int, int]]:
    """(epoch, step, shard, row) of every row each rank trained on (pipelines.worker.callbacks.RowRecorder)."""
    return [tuple(map(int, line.split())) for path in sorted(directory.glob("rank*.txt")) for line in path.open()]


def loss_steps(cfg, run_id: str) -> list[int]:
    history = MlflowClient(cfg.mlflow_uri).get_metric_history(run_id, "loss")
    return [m.step for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


def run_logged(cfg, directory: Path, **node_log):
    from pipelines.train import run_training

    (directory / "nodes").mkdir(parents=True)
    (directory / "rows").mkdir()
    log = NodeLog(str(directory / "nodes"), **node_log)
    return run_training(cfg, fault=log, trained_rows_dir=str(directory / "rows"))


@pytest.fixture(scope="module")
def steady(multinode, damaged_data, tmp_path_factory):
    """An uninterrupted SPREAD run: (config, summary, where its node and row logs are)."""
    tmp = tmp_path_factory.mktemp("steady")
    cfg = spread_config(tmp, "steady", damaged_data[0])
    return cfg, run_logged(cfg, tmp / "logs"), tmp / "logs"


@pytest.mark.timeout(600)  # with the cluster's start and the uninterrupted run: ~2.5 min alone, 6 on a loaded machine
def test_spread_puts_the_two_workers_on_two_nodes_and_checkpoints(multinode, steady):
    cfg, summary, logs = steady
    [(_, node0)], [(_, node1)] = node_lines(logs / "nodes", 0), node_lines(logs / "nodes", 1)
    workers = {node.node_id for node in multinode.worker_nodes}
    assert node0 != node1 and {node0, node1} == workers  # PACK would put both on one 1-CPU node
    assert summary.metrics["step"] == 9 and loss_steps(cfg, summary.mlflow_run_id) == list(range(1, 10))
    for step in (3, 6, 9):
        assert ckpt.problem(str(Path(cfg.storage_uri) / "steady" / f"checkpoint_{step:08d}")) is None
