"""A real multi-node Ray cluster on this machine, driven by a test over stdin and stdout.

It runs in its own process (the test process is already connected to the session cluster):
a head node with no CPUs and two 1-CPU worker nodes, each with its own raylet. Commands, one
per line: ``remove NODE_ID`` kills that node's processes, ``add`` starts another 1-CPU node,
``quit`` (or end of input) stops them all. Every reply is one JSON line.
"""

import json
import sys

from ray.cluster_utils import Cluster


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
