"""A real two-node Ray cluster, started the way the README tells users to start one.

``ray start --head`` and ``ray start --address=HEAD`` (its own node: its own raylet, 1 CPU and
its own temp dir), token authentication on as Ray 2.60 sets it up by default. The second node
runs in its own mount namespace where one folder is hidden behind an empty tmpfs: a node whose
disk does not share that folder, the mistake imgtrain must catch before training starts. Both
nodes are started with an S3 endpoint nothing listens on: a cluster whose nodes cannot reach the
bucket this machine reaches.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from imgtrain.checkpoint_policy import POLICY
from imgtrain.storage import runs
from imgtrain.training.watchdog import read_workers
from tests.integration.ray_nodes import RAY, processes_mentioning, wait_for_line
from tests.ports import unused_port

pytestmark = pytest.mark.integration


def can_hide_a_folder() -> bool:
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    shared, private = root / "shared", root / "private"
    shared.mkdir()
    private.mkdir()
    # A HOME of its own with a Ray token, as `ray start --head` leaves on a head node; a driver
    # on the head finds it there (imgtrain turns token authentication on when joining).
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(uuid.uuid4().hex)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=str(home), RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", RAY_USAGE_STATS_ENABLED="0")
    # the nodes' way to the bucket (test_doctor_checks_the_bucket_from_every_node) leads nowhere
    node_env = {**env, "IMGTRAIN_S3_ENDPOINT": "http://127.0.0.1:1", "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
    # Short temp dirs (Unix socket paths are limited to 107 bytes), one per node.
    temp_dirs = [tempfile.mkdtemp(prefix=f"imgtrain-node{i}-", dir="/tmp") for i in (0, 1)]
    port = unused_port()
    address = f"127.0.0.1:{port}"
    masked = can_hide_a_folder()
    nodes = []
    try:
        head_log = root / "head.log"
        nodes.append(subprocess.Popen(
            [RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
             "--include-dashboard=false", f"--temp-dir={temp_dirs[0]}", "--block"],
            stdout=open(head_log, "w"), stderr=subprocess.STDOUT, env=node_env, start_new_session=True))
        wait_for_line(head_log, "Ray runtime started", nodes[0])
        worker = [RAY, "start", f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                  f"--temp-dir={temp_dirs[1]}", "--block"]
        if masked:  # this node sees an empty folder where the others see `private`
            worker = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                      f'mount -t tmpfs none "{private}" && exec "$@"', "sh", *worker]
        worker_log = root / "worker.log"
        nodes.append(subprocess.Popen(
            worker, stdout=open(worker_log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**node_env, "RAY_AUTH_MODE": "token"}))  # as the README says for the other nodes
        wait_for_line(worker_log, "Ray runtime started", nodes[1])
        yield {"address": address, "shared": shared, "private": private, "masked": masked, "env": env}
    finally:
        for node in nodes:  # what a user's Ctrl-C or `kill` does: the node stops all it started
            with contextlib.suppress(ProcessLookupError):
                node.send_signal(signal.SIGTERM)
        for node in nodes:
            node.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(processes_mentioning(d) for d in temp_dirs) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [pid for d in temp_dirs for pid in processes_mentioning(d)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for d in temp_dirs:
            shutil.rmtree(d, ignore_errors=True)
        assert not left, f"processes of the test cluster outlived it: {left}"


def imgtrain(cluster, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a process of this machine (``env``: more of its environment)."""
    return subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout,
                          env={**cluster["env"], "COLUMNS": "200", **(env or {})})


def test_doctor_sees_both_nodes_and_that_storage_is_shared(two_nodes, tiny_data):
    done = imgtrain(two_nodes, "doctor", "--address", two_nodes["address"], "--storage", str(two_nodes["shared"]),
                    "--data", str(tiny_data), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ready"] and report["verdict"] == "ready to train"
    assert checks["cluster"]["detail"].startswith(f"{two_nodes['address']}: 2 node(s) alive, 2 CPUs")
    assert len(checks["cluster"]["lines"]) == 2 and sum("(head)" in line for line in checks["cluster"]["lines"]) == 1
    assert checks["shared storage"]["status"] == "ok" and "every node (2)" in checks["shared storage"]["detail"]


def test_doctor_checks_the_bucket_from_every_node(two_nodes, s3_server):
    # this machine reaches the bucket, the nodes do not: each node's own answer is shown
    blind = imgtrain(two_nodes, "doctor", "--storage", "s3://imgtrain/runs", "--address", two_nodes["address"],
                     env=s3_server)
    assert blind.returncode == 1, blind.stdout + blind.stderr
    assert "not every node can use s3://imgtrain/runs" in blind.stdout
    assert blind.stdout.count("Could not connect") >= 2


def test_training_runs_with_a_worker_on_each_node(two_nodes, tiny_data):
    storage = two_nodes["shared"]
    done = imgtrain(two_nodes, "train", "--data", str(tiny_data), "--name", "two-nodes", "--address",
                    two_nodes["address"], "--storage", str(storage), "--workers", "2", "--ingest", "torch",
                    "--epochs", "1", "--batch-size", "32", "--eval-batch-size", "50", "--model", "timm:test_resnet")
    assert done.returncode == 0, done.stderr
    run_dir = storage / "two-nodes"
    workers = read_workers(run_dir)
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert len({w["node_id"] for w in workers}) == 2  # one worker on each node
    result = runs.load_run(str(storage), "two-nodes")
    assert result.status == "finished" and [r["world_size"] for r in result.history] == [2]
    assert result.history[0]["val_samples"] == 100


def test_storage_one_node_cannot_see_is_refused_before_training(two_nodes, tiny_data):
    if not two_nodes["masked"]:
        pytest.skip("cannot give a node its own mount namespace here (unshare --mount needs root)")
    private = two_nodes["private"]
    doctor = imgtrain(two_nodes, "doctor", "--address", two_nodes["address"], "--storage", str(private))
    assert doctor.returncode == 1
    assert "FAIL  shared storage" in doctor.stdout and f"cannot see {private}" in doctor.stdout

    start = time.monotonic()
    done = imgtrain(two_nodes, "train", "--data", str(tiny_data), "--name", "hidden", "--address",
                    two_nodes["address"], "--storage", str(private), "--workers", "2", "--ingest", "torch",
                    "--epochs", "1", "--batch-size", "32", timeout=60)
    assert done.returncode == 2
    message = done.stderr.strip()
    assert re.match(rf"error: storage is not shared by every node of the cluster: node [\d.]+ \([0-9a-f]{{8}}\) "
                    rf"cannot see {re.escape(str(private / 'hidden'))} ", message), message
    assert "NFS" in message and len(message.splitlines()) == 1
    assert time.monotonic() - start < 60
    assert not [p for p in (private / "hidden").iterdir() if POLICY.is_checkpoint(p.name)]


def test_a_wrong_token_is_refused_in_seconds_with_what_to_do(two_nodes, tiny_data, tmp_path):
    wrong = {**two_nodes, "env": {**two_nodes["env"], "RAY_AUTH_TOKEN": "not-the-token"}}
    start = time.monotonic()
    done = imgtrain(wrong, "train", "--data", str(tiny_data), "--name", "intruder", "--address",
                    two_nodes["address"], "--storage", str(tmp_path), timeout=30)
    assert time.monotonic() - start < 30
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error: the Ray cluster at {two_nodes['address']} requires token authentication and refused this "
        "process; set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the output of `ray get-auth-token` on its head node>")
    assert not (tmp_path / "intruder").exists()
