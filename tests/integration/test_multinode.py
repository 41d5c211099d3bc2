"""A real two-node Ray cluster, started the way the README tells users to start one.

``ray start --head`` and ``ray start --address=HEAD`` (its own node: its own raylet, 1 CPU and
its own temp dir), token authentication on as Ray 2.60 sets it up by default. The second node
runs in its own mount namespace where one folder is hidden behind an empty tmpfs: a node whose
disk does not share that folder, the mistake imgtrain must catch before training starts. Both
nodes are started with an S3 endpoint nothing listens on: a cluster whose nodes cannot reach the
bucket this machine reaches. Last, an elastic run loses the second node (every process of it
SIGKILLed, as when its machine dies) and grows back when a third joins.
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
from imgtrain.training.ray_backend import START_TIMEOUT_ENV
from imgtrain.training.watchdog import read_workers
from tests.conftest import wait_for
from tests.integration.ledger import global_batches
from tests.integration.ray_nodes import RAY, processes_mentioning, wait_for_line
from tests.ports import unused_port

pytestmark = pytest.mark.integration


def can_hide_a_folder() -> bool:
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


# A lost node is declared dead after 3 failed health checks a second apart (about 3 s) instead of
# Ray's 5 at 3 s: the surviving rank of an elastic run, blocked in an all-reduce, learns of the
# loss only then, and the test would spend the difference waiting.
QUICK_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
                       "health_check_failure_threshold": 3}


class Nodes:
    """The test cluster's nodes: each a ``ray start --block`` process with a temp dir of its own."""

    def __init__(self, root, env):
        self.root, self.env, self.address = root, env, f"127.0.0.1:{unused_port()}"
        self.started: list[tuple[subprocess.Popen, str]] = []  # (its `ray start`, its temp dir)

    def start(self, *args: str, wrapper: tuple[str, ...] = (), env: dict | None = None) -> str:
        """A node (``args``: more for ``ray start``), once it says it runs; returns its temp dir,
        short (Unix socket paths are limited to 107 bytes)."""
        index = len(self.started)
        temp_dir = tempfile.mkdtemp(prefix=f"imgtrain-node{index}-", dir="/tmp")
        log = self.root / f"node{index}.log"
        node = subprocess.Popen([*wrapper, RAY, "start", *args, "--node-ip-address=127.0.0.1", "--num-cpus=1",
                                 f"--temp-dir={temp_dir}", "--block"], stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, env=env or self.env, start_new_session=True)
        self.started.append((node, temp_dir))
        wait_for_line(log, "Ray runtime started", node)
        return temp_dir

    def add_worker(self, wrapper: tuple[str, ...] = ()) -> str:
        return self.start(f"--address={self.address}", wrapper=wrapper,
                          env={**self.env, "RAY_AUTH_MODE": "token"})  # as the README says for the other nodes

    def lose(self, temp_dir: str) -> None:
        """The node's machine dies: every process of it (its raylet, agents and workers) SIGKILLed at once."""
        for pid in processes_mentioning(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for node, _ in self.started:  # what a user's Ctrl-C or `kill` does: the node stops all it started
            with contextlib.suppress(ProcessLookupError):
                node.send_signal(signal.SIGTERM)
        for node, _ in self.started:
            node.wait(timeout=60)
        temp_dirs = [d for _, d in self.started]
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
    nodes = Nodes(root, node_env)
    masked = can_hide_a_folder()
    try:
        nodes.start("--head", f"--port={nodes.address.rpartition(':')[2]}", "--include-dashboard=false",
                    f"--system-config={json.dumps(QUICK_HEALTH_CHECKS)}")
        # this node sees an empty folder where the others see `private`
        hidden = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                  f'mount -t tmpfs none "{private}" && exec "$@"', "sh") if masked else ()
        worker = nodes.add_worker(wrapper=hidden)
        # Ray's autoscaling coordinator with a 2 s refresh (cluster_helper.QuickTicks), created
        # before a run creates Ray's own: what the elastic run sizes its worker group from
        coordinator = subprocess.run([sys.executable, "-m", "tests.integration.cluster_helper", nodes.address],
                                     env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
        assert coordinator.returncode == 0, coordinator.stderr[-3000:]
        yield {"address": nodes.address, "shared": shared, "private": private, "masked": masked, "env": env,
               "nodes": nodes, "worker": worker}
    finally:
        nodes.stop_all()


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


# The elastic run: 256 rows / batch 16, 16 steps an epoch. More epochs than the test ever waits
# for: how many pass before the run grows back depends on Ray's timers against this machine's
# speed (16-18 s from the new node's start: Ray Train looks every ELASTIC_CHECK_S, at a view of
# the cluster the QuickTicks coordinator refreshes every 2 s; 7 epochs at one worker on a quiet
# machine). A run sized to end just after growing back once ended before it (8 epochs), and on
# a busy machine trains on for a minute after it (10 epochs); this one is stopped once the grown
# group has finished an epoch. SIGKILL: how a run ends is other tests' business, and Ray Train
# takes SIGINT over (the process then exits 1, the run marked failed).
EPOCHS, STEPS_PER_EPOCH = 100, 16
# After the loss Ray Train may still count the dead node (its view of the cluster is refreshed
# every 2 s here), ask for two workers and wait for their placement before trying with one:
# imgtrain's 20 s for elastic runs, unless the user sets Ray's own variable, as this test does
# (the nodes here are up at once: placing a worker takes milliseconds).
PLACEMENT_WAIT_S = 5


def checkpointed_since_last_start(run_dir, world_size: int, epoch_end: bool = False) -> bool:
    """The latest worker group has ``world_size`` workers and has saved a checkpoint since it
    started (``epoch_end``: an epoch's, so that whole epoch is in the run)."""
    records = runs.read_metrics(run_dir)
    last = max((i for i, r in enumerate(records) if r["kind"] == "start"), default=None)
    return (last is not None and records[last]["world_size"] == world_size
            and any(r.get("checkpoint") and (r["kind"] == "epoch" or not epoch_end) for r in records[last + 1:]))


def print_timeline(run_dir, moments: dict[str, float]) -> None:
    """The test's moments and the run's worker-group starts and checkpoints, in seconds from the
    test's start (shown when the test fails: which wait took the time)."""
    for r in runs.read_metrics(run_dir) if run_dir.exists() else []:
        if r["kind"] == "start":
            moments[f"start at step {r['step']}, {r['world_size']} worker(s)"] = r["time"]
        elif r.get("checkpoint") and "time" in r:
            moments[f"{r['kind']} at step {r['step']}"] = r["time"]
    start = moments["test"]
    print("\n".join(f"{t - start:6.1f} s  {what}" for what, t in sorted(moments.items(), key=lambda m: m[1])))


def test_training_with_a_worker_on_each_node_shrinks_when_one_is_lost_and_grows_back_when_one_joins(two_nodes,
                                                                                                     tiny_data):
    """The README's cluster trains an elastic run (``--workers 1-2``), one worker on each node;
    the second node's machine dies (its every process SIGKILLed), the run goes on with one
    worker, and grows back to two once a new node joins. Last in this module: the other tests
    need the node it loses."""
    storage, nodes = two_nodes["shared"], two_nodes["nodes"]
    run_dir = storage / "elastic"
    moments = {"test": time.time()}  # printed at the end: where the minutes went, if it fails
    driver = subprocess.Popen(
        [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(tiny_data), "--name", "elastic",
         "--storage", str(storage), "--address", two_nodes["address"], "--workers", "1-2", "--ingest", "torch",
         "--epochs", str(EPOCHS), "--batch-size", "16", "--checkpoint-every-steps", "8", "--max-failures", "3",
         "--ledger", "--log-every-steps", "1", "--eval-batch-size", "50",
         "--model", "timm:test_resnet", "--threads-per-worker", "1"],  # the resizes are the point, not the model
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**two_nodes["env"], "COLUMNS": "200", START_TIMEOUT_ENV: str(PLACEMENT_WAIT_S)})
    try:
        wait_for(lambda: checkpointed_since_last_start(run_dir, 2), 240, "two workers and a checkpoint", driver)
        first_group = read_workers(run_dir)
        moments["node lost"] = time.time()
        nodes.lose(two_nodes["worker"])
        wait_for(lambda: checkpointed_since_last_start(run_dir, 1), 180, "one worker going on", driver)
        moments["node added"] = time.time()
        nodes.add_worker()
        # Grown back, and through a whole epoch's end: the epoch it grew in is complete.
        wait_for(lambda: checkpointed_since_last_start(run_dir, 2, epoch_end=True), 180, "growing back to two workers",
                 driver)
        moments["driver stopped"] = time.time()
        driver.kill()  # everything the test asks of the run is on disk; the rest would repeat it
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
        print_timeline(run_dir, moments)

    assert sorted(w["rank"] for w in first_group) == [0, 1]
    assert len({w["node_id"] for w in first_group}) == 2  # one worker on each node
    worlds = [s["world_size"] for s in runs.read_metrics(run_dir) if s["kind"] == "start"]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2
    history = runs.epoch_history(run_dir)
    assert history[0]["world_size"] == 2 and {r["val_samples"] for r in history} == {100}
    epochs = [r["epoch"] for r in history]
    assert epochs == list(range(len(epochs))) and len(epochs) >= 2  # none missing, the resizes' epochs among them
    batches = global_batches(run_dir)
    assert sorted(batches) == list(range(len(batches)))  # every step trained, none missing, in every group
    for epoch in epochs:  # every row exactly once per epoch, through both resizes
        ids = [i for s in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH) for i in batches[s]]
        assert len(ids) == len(set(ids)) == 16 * STEPS_PER_EPOCH
    # the global batch never changed; the steps after the last epoch's end are left out: the test
    # kills the run there, and a step one rank had logged and the other had not is cut in half
    assert {len(batches[s]) for s in range(len(epochs) * STEPS_PER_EPOCH)} == {16}
