"""How many torch threads each training process gets, and which of Ray's processes give way to it."""

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


def test_ray_helpers_are_told_apart_from_training_and_pool_workers():
    from imgtrain.cluster import is_helper

    assert is_helper(["ray::TrainController.run"]) and is_helper(["ray::Monitor.drain"])
    assert is_helper(["/venv/lib/ray/core/src/ray/gcs/gcs_server", "--gcs_server_port=0"])
    assert is_helper(["/venv/bin/python", "-u", "/venv/lib/ray/dashboard/agent.py", "--node-ip-address=x"])
    assert not is_helper(["ray::RayTrainWorker.run_train_fn"])  # the training itself
    assert not is_helper(["ray::IDLE"])  # a pool worker: may become a training worker
    # the raylet names the agents in its arguments; niced, it would hand its nice value to every worker it forks
    assert not is_helper(["/venv/lib/ray/core/src/ray/raylet/raylet", "--agent_command=python -u /x/dashboard/agent.py"])


def test_helpers_under_this_process_are_niced_and_the_others_keep_their_priority(tmp_path):
    import subprocess
    import sys

    from imgtrain.cluster import HELPER_NICE, deprioritize_helpers

    script = tmp_path / "log_monitor.py"
    script.write_text("import sys; sys.stdin.read()\n")
    waiting = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    children = {  # Popen returns once the child has exec'd: its command line is the one given
        "daemon": subprocess.Popen([sys.executable, "-u", str(script)], stdin=subprocess.PIPE),
        "actor": subprocess.Popen(["ray::TrainController.run", *waiting[1:]], executable=sys.executable,
                                  stdin=subprocess.PIPE),
        "trainer": subprocess.Popen(["ray::RayTrainWorker.run_train_fn", *waiting[1:]], executable=sys.executable,
                                    stdin=subprocess.PIPE),
        "other": subprocess.Popen(waiting, stdin=subprocess.PIPE),
    }
    try:
        before = os.getpriority(os.PRIO_PROCESS, children["other"].pid)
        niced = deprioritize_helpers()
        assert niced == {children["daemon"].pid, children["actor"].pid}
        nice = {name: os.getpriority(os.PRIO_PROCESS, child.pid) for name, child in children.items()}
        assert nice == {"daemon": HELPER_NICE, "actor": HELPER_NICE, "trainer": before, "other": before}
        assert deprioritize_helpers(done=niced) == niced  # a second scan: nothing new
    finally:
        for child in children.values():
            child.communicate(b"")
