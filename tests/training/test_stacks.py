"""Stacks from a real faulthandler dump: the training thread is found among the threads."""

import faulthandler
import threading

from imgtrain.training.stacks import training_frames


def waits_inside(event: threading.Event) -> None:
    event.wait()


def run_loop(ready: threading.Event, release: threading.Event) -> None:  # named as the training loop
    ready.set()
    waits_inside(release)


def test_the_training_threads_frames_come_innermost_last_from_run_loop_inward(tmp_path):
    ready, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=run_loop, args=(ready, release))
    worker.start()
    ready.wait()
    try:
        with open(tmp_path / "dump.txt", "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)  # what SIGUSR1 writes in a worker
    finally:
        release.set()
        worker.join()
    frames = training_frames((tmp_path / "dump.txt").read_text())
    assert frames[0].endswith("in run_loop") and "test_stacks.py" in frames[0]
    assert frames[1].endswith("in waits_inside")
    assert frames[-1].endswith("in wait")  # threading.Event.wait: where the thread sits
    assert not any("test_the_training_threads" in f for f in frames)  # other threads left out
    assert training_frames("Thread 0x1 (most recent call first):\n  File \"x.py\", line 1 in other\n") == []
