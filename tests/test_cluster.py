"""How many torch threads each training process gets; the address a join hands ray.init."""

import os
import socket
import sys

from imgtrain import cluster
from imgtrain.cluster import GPU_PROCESS_THREADS, threads_for


def test_cpu_workers_share_the_cores_and_a_gpu_worker_keeps_few_threads():
    cores = os.cpu_count() or 1
    assert threads_for(1) == cores
    assert threads_for(2) == max(1, cores // 2)
    assert threads_for(cores * 4) == 1  # never 0
    # host work between a GPU's kernels is small, and many sleeping threads are slow to wake
    assert threads_for(1, gpu=True) == GPU_PROCESS_THREADS == 2


def test_the_users_setting_wins():
    assert threads_for(2, given=3) == 3
    assert threads_for(1, given=8, gpu=True) == 8


def test_on_a_ray_without_its_token_setup_the_checked_address_is_the_one_joined(monkeypatch):
    """Another Ray version (no token-setup module): check_joinable still returns the address it
    reached, never None, which ray.init takes as "start a new local cluster"."""
    import ray._private.services as services  # Ray itself imported first, whole

    # held open, on every interface: Ray resolves 127.0.0.1 to this machine's address
    with socket.create_server(("", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setitem(sys.modules, "ray._private.authentication.authentication_token_setup", None)
        assert cluster.check_joinable(address) == services.canonicalize_bootstrap_address(address)
