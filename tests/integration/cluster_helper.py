"""A real multi-node Ray cluster on this machine, driven by a test over stdin and stdout.

It runs in its own process (the test process is already connected to the session cluster):
a head node with no CPUs and two 1-CPU worker nodes, each with its own raylet. Commands, one
per line: ``remove NODE_ID`` kills that node's processes, ``add`` starts another 1-CPU node,
``quit`` (or end of input) stops them all. Every reply is one JSON line. Ray's autoscaling
coordinator here refreshes its view of the nodes every 2 s (``QuickTicks``; the elastic test
took 81 s with Ray's 20, 66 s with it).
"""

import json
import sys

import ray
from ray.cluster_utils import Cluster
from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class QuickTicks(_AutoscalingCoordinatorActor):
    """Ray's autoscaling coordinator, which refreshes its view of the cluster every 2 s instead of
    20: an elastic run sizes its worker group from that view, so the test waited up to 20 s
    after each node's loss and each node's start for Ray to notice. What the test proves is
    what the run does once Ray has noticed, not how soon it does."""

    TICK_INTERVAL_S = 2


def start_quick_coordinator(cluster: Cluster) -> None:
    """The coordinator Ray Train creates on first use (``get_or_create_autoscaling_coordinator``:
    its name, namespace and options), created first, on the head node, which is never removed."""
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(QuickTicks).options(
        name="AutoscalingCoordinator", namespace="AutoscalingCoordinator", lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.head_node.node_id, soft=False)).remote()
    ray.get(actor.__ray_ready__.remote())
    ray.shutdown()  # detached: it outlives this connection (Cluster cannot remove a node a driver is on)


def main() -> None:
    # A removed node is declared dead after 3 failed health checks a second apart (about 3 s)
    # instead of Ray's 5 at 3 s: the surviving rank, blocked in an all-reduce, learns of the loss
    # only then, and the test would spend the difference waiting.
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": health})
    nodes = {}

    def add() -> str:
        node = cluster.add_node(num_cpus=1)
        nodes[node.node_id] = node
        return node.node_id

    try:
        start_quick_coordinator(cluster)
        print(json.dumps({"address": cluster.address, "nodes": [add(), add()]}), flush=True)
        for line in sys.stdin:
            command, *args = line.split()
            if command == "remove":
                cluster.remove_node(nodes.pop(args[0]), allow_graceful=False)
                print(json.dumps({"removed": args[0]}), flush=True)
            elif command == "add":
                print(json.dumps({"added": add()}), flush=True)
            elif command == "quit":
                break
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
