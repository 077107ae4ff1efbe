"""Every use of Ray's private modules, in one place, for what Ray has no public switch for: the
printer of the workers' forwarded output (replaced to route it to a file while `[mdc] ` lines
still reach the console), the current-cluster file `ray start` writes (read; removed after a
test cluster), Ray Data's progress records (to say which operator a stalled run waits on), the
CPUs a streaming repartition's tasks ask for (`Dataset.repartition` takes none and asks a whole
CPU), and Ray's configuration read again after the process set RAY_AUTH_MODE (Ray reads it when
it is imported). Tested on the Ray versions below;
tests/test_ray_private.py fails, naming the attribute, when an upgrade removes one."""

from __future__ import annotations

import contextlib

import ray
import ray._common.utils
import ray._private.ray_logging
import ray._private.utils
import ray._private.worker
import ray._raylet

TESTED_RAY_VERSIONS = ("2.60.0",)
USED = (  # (module, attribute): what this module reads
    ("ray._private.worker", "print_to_stdstream"),
    ("ray._private.ray_logging", "global_worker_stdstream_dispatcher"),
    ("ray._private.utils", "read_ray_address"),
    ("ray._common.utils", "reset_ray_address"),
    ("ray.data._internal.stats", "STATS_ACTOR_NAME"),
    ("ray.data._internal.stats", "STATS_ACTOR_NAMESPACE"),
    ("ray._raylet", "Config"),
    ("ray.data._internal.logical.operators.map_operator", "StreamingRepartition"),
)
RAY_PRINTER = "ray_print_logs"  # the name ray.init gives its printer of forwarded worker output


def recorded_address() -> str | None:
    """The address the last `ray start` on this machine wrote, if any."""
    return ray._private.utils.read_ray_address()


def forget_recorded_address(address: str) -> None:
    """Remove the current-cluster file when it names `address` (a test cluster that is gone), so
    that a later `connect_ray` does not try to join it."""
    if recorded_address() == address:
        ray._common.utils.reset_ray_address()


def _dispatcher():
    return ray._private.ray_logging.global_worker_stdstream_dispatcher


def has_ray_printer() -> bool:
    return any(name == RAY_PRINTER for name, _ in _dispatcher().handlers)


def set_output_handler(name: str, handler) -> None:
    """Forwarded worker output goes to `handler` (a batch of lines each call) instead of Ray's printer."""
    _dispatcher().remove_handler(RAY_PRINTER)
    _dispatcher().remove_handler(name)
    _dispatcher().add_handler(name, handler)


def remove_output_handler(name: str, restore_ray_printer: bool) -> None:
    _dispatcher().remove_handler(name)
    if restore_ray_printer:
        _dispatcher().add_handler(
            RAY_PRINTER, lambda data: ray._private.worker.print_to_stdstream(data, ignore_prefix=False)
        )


@contextlib.contextmanager
def raylet_notices_to(route):
    """The raylet's notices (printed by the driver's own printer, not forwarded) go to `route`."""
    original = ray._private.worker.print_to_stdstream
    ray._private.worker.print_to_stdstream = lambda data, ignore_prefix: route(data)
    try:
        yield
    finally:
        ray._private.worker.print_to_stdstream = original


def repartition_in_one_task(ds: ray.data.Dataset) -> ray.data.Dataset:
    """`ds`, the result of `repartition(target_num_rows_per_block=...)`, with its tasks asking for
    no CPU and run one at a time. Each asks a whole CPU otherwise, which a node that training
    leaves half a CPU never has: the stream stalls. With no CPU and no cap, every epoch's start
    sends a burst of them, each in a new worker process (a second or two of CPU to start), which
    the training workers wait behind; one at a time keeps up (a task slices and joins blocks in
    about 2 ms)."""
    # imported on use, as data_stats_actor's: the module loads Ray Data's planner
    from ray.data._internal.logical.operators.map_operator import StreamingRepartition

    operator = ds._logical_plan.dag
    assert isinstance(operator, StreamingRepartition), type(operator)
    operator.ray_remote_args["num_cpus"] = 0
    object.__setattr__(operator, "compute", ray.data.TaskPoolStrategy(size=1))  # a frozen dataclass
    return ds


def reread_config() -> None:
    """Ray reads its configuration (RAY_AUTH_MODE among it) when it is imported: read it again."""
    ray._raylet.Config.initialize("")


def data_stats_actor():
    """Ray Data's actor of progress records (what its progress bars show)."""
    # imported on use: a stall is rare, and the module loads Ray Data
    from ray.data._internal.stats import STATS_ACTOR_NAME, STATS_ACTOR_NAMESPACE

    return ray.get_actor(STATS_ACTOR_NAME, namespace=STATS_ACTOR_NAMESPACE)
