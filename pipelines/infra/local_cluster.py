"""A multi-node Ray cluster on this machine, for the tests and benchmarks whose nodes come and go:
Ray's own harness (`ray.cluster_utils.Cluster`) starts a head and worker nodes, each its own
raylet with its own resources, as Ray tests itself.

Ray starts and removes nodes only from the main thread (a node's start installs signal
handlers: from another thread `add_node` raises "signal only works in main thread"), so a test
that changes the cluster under a run trains in a driver thread and changes nodes from the main one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster

from pipelines.infra import ray_private
from pipelines.infra.ray_connection import auth_token

OBJECT_STORE = 200 * 1024**2  # per node: the tests' datasets are a few MB
IDLE_WORKERS_KEPT = "64"  # RAY_num_workers_soft_limit: idle worker processes a node keeps


def add_node(cluster, **node):
    """A worker node with `node`'s resources (Cluster.add_node's arguments: num_cpus, resources,
    ...), up before this returns (main thread only)."""
    added = cluster.add_node(object_store_memory=OBJECT_STORE, **node)
    cluster.wait_for_nodes(timeout=60)
    return added


@contextlib.contextmanager
def local_cluster(head_cpus: float, *nodes: dict) -> Iterator:
    """A head with `head_cpus` CPUs (the driver's node) and one worker node for each of `nodes`
    (add_node's arguments), connected; after, Ray is shut down and the current-cluster file that
    the head writes (as `ray start` does) removed, so that a later `mdc` command does not try to
    join a cluster that is gone."""
    if auth_token() is None:  # token auth like any cluster mdc runs: the nodes and drivers inherit it
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    if os.environ.setdefault("RAY_AUTH_MODE", "token") == "token":
        ray_private.reread_config()
    # With Ray's default limit, a 1-CPU node killed each idle reader process a second after its
    # task, and the next task paid a new process's imports: 12 shards read by 12 processes in
    # 91-107 s, against 2 processes in 38 s with this (the raylets read it when they start).
    os.environ.setdefault("RAY_num_workers_soft_limit", IDLE_WORKERS_KEPT)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "object_store_memory": OBJECT_STORE, "include_dashboard": True},
        connect=False,
    )
    try:
        for node in nodes:
            add_node(cluster, **node)
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        address = cluster.address
        cluster.shutdown()
        ray_private.forget_recorded_address(address)
