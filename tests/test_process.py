"""What a command changes in its own process for signals (``ops/process.py``): real signals to
this process, and a real child process's signal mask."""

from __future__ import annotations

import signal
import subprocess

import pytest

from imgtrain.ops import process


def blocked_in(status: str) -> set[int]:
    """The signals a /proc/PID/status text says are blocked."""
    mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_a_hangup_or_sigterm_interrupts_the_block_as_ctrl_c_does_and_says_which(signum):
    # Python's default, as a shell started from a terminal leaves it: a suite run under `nohup`
    # inherits SIGHUP ignored, which the block rightly keeps (the test below)
    outside = signal.signal(signum, signal.SIG_DFL)
    try:
        with pytest.raises(KeyboardInterrupt), process.stops_interrupt() as stop:
            signal.raise_signal(signum)  # to this thread, handled before the next line
            raise AssertionError("the signal went by")
        assert stop.signum == signum
        assert signal.getsignal(signum) == signal.SIG_DFL
    finally:
        signal.signal(signum, outside)


def test_a_hangup_ignored_already_stays_ignored():
    """``nohup imgtrain train ...``: the run is to go on when the terminal closes."""
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with process.stops_interrupt() as stop:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
        assert stop.signum is None
    finally:
        signal.signal(signal.SIGHUP, saved)


def test_processes_started_in_the_block_have_hangups_blocked_and_this_thread_keeps_its_mask():
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with process.hangup_blocked():
        inside = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True, check=True).stdout
    outside = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True, check=True).stdout
    assert signal.SIGHUP in blocked_in(inside)
    assert signal.SIGHUP not in blocked_in(outside)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
