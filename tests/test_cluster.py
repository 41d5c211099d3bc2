"""How many torch threads each training process gets."""

import os

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
