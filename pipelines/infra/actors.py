"""The helper actors a run keeps beside its driver (progress channel, bad-record ledger, epoch plan,
evaluation queue): where they live and how they are asked. They sit on the driver's node, so a lost
worker node does not take them along while the run they serve goes on; a question to one that does
not answer is an error naming it, never a wait without end."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ACTOR_TIMEOUT_S = 60.0


def ask(call: ray.ObjectRef | list, what: str):
    """The answer of a call to one of the run's actors, or an error naming it after ACTOR_TIMEOUT_S."""
    try:
        return ray.get(call, timeout=ACTOR_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"{what} did not answer in {ACTOR_TIMEOUT_S:g} s") from None


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Pins an actor to the node this driver runs on (hard affinity: never elsewhere)."""
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
