"""Ray's autoscaling coordinator, with a quicker timer, for a test's own multi-node cluster.

``python -m tests.integration.cluster_helper ADDRESS`` (in the environment that joins the
cluster) creates it on the head node before any run does. Ray Train's elastic runs size their
worker group from its view of the nodes, which Ray refreshes every 20 s and ``QuickTicks`` every
2 s: the elastic test took 81 s with Ray's timer, 66 s with it.
"""

import sys

import ray
from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class QuickTicks(_AutoscalingCoordinatorActor):
    """Ray's autoscaling coordinator, which refreshes its view of the cluster every 2 s instead of
    20: an elastic run sizes its worker group from that view, so the test waited up to 20 s
    after each node's loss and each node's start for Ray to notice. What the test proves is
    what the run does once Ray has noticed, not how soon it does."""

    TICK_INTERVAL_S = 2


def start_quick_coordinator(address: str) -> None:
    """The coordinator Ray Train creates on first use (``get_or_create_autoscaling_coordinator``:
    its name, namespace and options), created first, on the head node, which is never removed."""
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("node:__internal_head__"))
    actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(QuickTicks).options(
        name="AutoscalingCoordinator", namespace="AutoscalingCoordinator", lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
    ray.get(actor.__ray_ready__.remote())
    ray.shutdown()  # detached: it outlives this connection


if __name__ == "__main__":
    start_quick_coordinator(sys.argv[1])
