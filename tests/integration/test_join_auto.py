"""``--address auto`` joins the cluster `ray start` runs here, whatever tokens this machine has."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest

from tests.integration.ray_nodes import RAY, processes_mentioning, wait_for_line
from tests.ports import unused_port

pytestmark = pytest.mark.integration

# What a command joining with "auto" does first: join, then start an actor (Ray Train's
# controller, imgtrain's Monitor) and call it.
JOIN_AND_CALL = """
import sys, ray
from pathlib import Path
from imgtrain import cluster
logs = Path(sys.argv[1])
logs.mkdir()
with cluster.ray_session("auto", 0, logs, "ray.log"):
    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, x):
            return x
    answer = ray.get(Echo.remote().echo.remote("answered"), timeout=60)
print(answer)  # after the session: during it, this process's output goes to the logs
"""


def test_auto_joins_a_cluster_without_authentication_on_a_machine_that_has_a_token(tmp_path):
    # A cluster started without token authentication (RAY_AUTH_MODE=disabled, or before this
    # machine had a token), and the token file any private cluster leaves (`make demo`): given
    # "auto", Ray 2.60 turns token mode on in the driver, and every actor died as it started.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(uuid.uuid4().hex)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    # Ray's files, and the address `ray start` leaves for "auto", in a folder of the test's own
    # (short: Unix socket paths are limited to 107 bytes), not in /tmp/ray, which is this machine's
    temp_dir = tempfile.mkdtemp(prefix="imgtrain-auto-", dir="/tmp")
    env["RAY_TMPDIR"] = temp_dir
    port = unused_port()
    log = tmp_path / "head.log"
    head = subprocess.Popen(
        [RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
         "--include-dashboard=false", "--block"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**env, "RAY_AUTH_MODE": "disabled"},
        start_new_session=True)
    try:
        wait_for_line(log, "Ray runtime started", head)
        done = subprocess.run([sys.executable, "-c", JOIN_AND_CALL, str(tmp_path / "logs")], capture_output=True,
                              text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == "answered"
    finally:
        with contextlib.suppress(ProcessLookupError):
            head.send_signal(signal.SIGTERM)  # the node stops all it started
        head.wait(timeout=60)
        for pid in processes_mentioning(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
