"""Ctrl-C, a closed terminal and SIGTERM stop `imgtrain train` as docs/training.md says: status.json
``interrupted``, the progress display closed with "interrupted", one line on stderr naming the
command that resumes the run, exit status 130 (SIGINT), 129 (SIGHUP) or 143 (SIGTERM), every
process the driver started gone, and that command then resumes the run from its checkpoint.

Each run is real and tiny: rank 0 stops for good before step 3 (``hang:0:3``), after the step-2
checkpoint, so the signal always finds a run in the middle of training with a checkpoint to
resume from. The test snapshots the driver's process tree (with a cluster of its own: GCS,
raylet, workers) and the run's Ray Train workers just before the signal and checks they are gone.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.watchdog import WORKERS_FILE
from tests.conftest import run_cli, wait_for
from tests.terminal import Terminal

pytestmark = pytest.mark.integration
# What is proved is how the command stops, whatever the model and the ingest: timm's small test
# ResNet (ResNet-18 builds, steps and checkpoints 30 times the weights) and the torch DataLoader
# (no Ray Data start-up).
QUICK = ("--model", "timm:test_resnet", "--ingest", "torch")

# The command starts as a user's shell starts it: SIGINT and SIGHUP at their defaults and
# unblocked (a child inherits an ignored or blocked signal, and the suite's process may have one).
CLI = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGHUP}); "
    "sys.argv[0] = 'imgtrain'; runpy.run_module('imgtrain.cli', run_name='__main__')"
)


def train_command(tiny_data: Path, storage: Path, name: str, backend: str) -> list[str]:
    return [sys.executable, "-c", CLI, "train", "--data", str(tiny_data), "--storage", str(storage), "--name", name,
            "--backend", backend, "--workers", "1", "--threads-per-worker", "1", "--epochs", "1",
            "--batch-size", "32", "--checkpoint-every-steps", "2", "--log-every-steps", "1",
            *QUICK]


def checkpointed(run_dir: Path) -> bool:
    """The driver has the record of the step-2 checkpoint (rank 0 then stops before step 3)."""
    return any(r.get("checkpoint") for r in runs.read_metrics(run_dir))


def wait_for_checkpoint(term: Terminal, run_dir: Path) -> None:
    wait_for(lambda: checkpointed(run_dir) or term.proc.poll() is not None, 240, "the step-2 checkpoint")
    assert term.proc.poll() is None, term.text()


def _started(pid: int) -> str | None:
    """Process ``pid``'s start time, None once it is gone (a zombie is gone: it only waits to be reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _cmdline(pid: int) -> bytes:
    """Process ``pid``'s command line, empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def process_tree(root: int) -> set[tuple[int, str]]:
    """``root`` and every process below it now, as (pid, start time): a pid reused later is not one of them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        start = _started(pid)
        if start is not None:
            found.add((pid, start))
        todo += children.get(pid, [])
    return found


def run_workers(run_dir: Path) -> set[tuple[int, str]]:
    """The run's Ray Train workers (``workers.json``), as ``process_tree`` gives processes: on a
    joined cluster they are not the driver's children."""
    path = run_dir / WORKERS_FILE
    pids = [w["pid"] for w in json.loads(path.read_text())["workers"]] if path.exists() else []
    return {(pid, start) for pid in pids if (start := _started(pid)) is not None}


def assert_all_gone(tree: set[tuple[int, str]]) -> None:
    def left():
        return [(pid, _cmdline(pid)[:80]) for pid, start in tree if _started(pid) == start]

    try:  # Ray's processes end as the driver stops them, before it exits; a moment for the kernel
        wait_for(lambda: not left(), 10, "the run's processes to end")
    except AssertionError:
        raise AssertionError(f"left running: {left()}") from None


def resume_line(text: str, name: str, storage: Path) -> str:
    """The last line of ``text``, checked to be the one that says how to resume; its command."""
    last = text.strip().splitlines()[-1]
    assert last == f"interrupted: resume with imgtrain train --name {name} --storage {shlex.quote(str(storage))}", text
    return last.removeprefix("interrupted: resume with imgtrain ")


def assert_resumes(command: str, run_dir: Path) -> None:
    """The command the line names resumes the run from its step-2 checkpoint and finishes it."""
    done = run_cli(*shlex.split(command))
    assert done.returncode == 0, done.stderr
    assert runs.read_status(run_dir)["status"] == "finished"
    assert [r["step"] for r in runs.read_metrics(run_dir) if r["kind"] == "start"] == [0, 2]


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_ctrl_c_in_a_terminal_stops_the_run_and_says_how_to_resume(tiny_data, tmp_path, monkeypatch, request,
                                                                   backend):
    """SIGINT to the command's process group, as a terminal sends Ctrl-C. The Ray run joins the
    session's running cluster, as a user of a cluster does (the hangup test below stops a cluster
    of the driver's own): the driver stops the run's workers on a cluster it does not own. The
    command it names resumes the run (the local run's resume here; a Ray run's resume from its
    checkpoint is test_resume's and test_fsdp's: a fit less)."""
    monkeypatch.setenv(FAULT_ENV, "hang:0:3")
    run_dir = tmp_path / "cc"
    joined = ["--address", request.getfixturevalue("ray_cluster")] if backend == "ray" else []
    with Terminal(train_command(tiny_data, tmp_path, "cc", backend) + joined, cwd=tmp_path, columns=220) as term:
        wait_for_checkpoint(term, run_dir)
        workers = run_workers(run_dir) if backend == "ray" else set()
        assert workers or backend == "local", "no Ray Train worker recorded in workers.json"
        tree = process_tree(term.proc.pid) | workers
        os.killpg(term.proc.pid, signal.SIGINT)
        assert term.wait(timeout=120) == 130, term.text()
        screen = term.text()
    assert runs.read_status(run_dir)["status"] == "interrupted"
    assert "Traceback" not in screen
    bar = [line for line in screen.splitlines() if line.startswith("train ")]
    assert len(bar) == 1 and bar[0].endswith("  interrupted"), screen  # the bar closed, its ETA gone
    command = resume_line(screen, "cc", tmp_path)
    assert_all_gone(tree)
    if backend == "local":
        monkeypatch.delenv(FAULT_ENV)
        assert_resumes(command, run_dir)


def test_sigterm_to_the_driver_alone_stops_a_ray_run(tiny_data, tmp_path, ray_cluster):
    """SIGTERM to the driver only, as a scheduler (Slurm, Kubernetes, ``kill PID``) stops a job:
    ray.init's own SIGTERM handler (``sys.exit``, a failure) is not left in place, and the run
    ends interrupted. The driver joins the session's cluster (one Ray start less; the tests above
    stop a cluster of the driver's own); the resume command is the one the Ctrl-C test runs."""
    run_dir = tmp_path / "alone"
    command = train_command(tiny_data, tmp_path, "alone", "ray") + ["--quiet", "--address", ray_cluster]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                            env={**os.environ, FAULT_ENV: "hang:0:3"})
    try:
        wait_for(lambda: checkpointed(run_dir), 240, "the step-2 checkpoint", proc)
        workers = run_workers(run_dir)
        assert workers, "no Ray Train worker recorded in workers.json"
        tree = process_tree(proc.pid) | workers
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err
    assert runs.read_status(run_dir)["status"] == "interrupted"
    assert "Traceback" not in out + err
    resume_line(err, "alone", tmp_path)
    assert_all_gone(tree)


def test_a_closed_terminal_stops_a_ray_run_and_its_cluster(tiny_data, tmp_path, monkeypatch):
    """The terminal closes (writes to it fail), then the shell sends SIGHUP to the command's
    process group, where the driver's GCS and raylet are too; stderr went to a file (``2>err``)."""
    monkeypatch.setenv(FAULT_ENV, "hang:0:3")
    run_dir, err_file = tmp_path / "hup", tmp_path / "err.txt"
    with open(err_file, "w") as err, \
            Terminal(train_command(tiny_data, tmp_path, "hup", "ray"), cwd=tmp_path, columns=220, stderr=err) as term:
        wait_for_checkpoint(term, run_dir)
        tree = process_tree(term.proc.pid)
        # a cluster of the command's own: no Ray Train preemption watcher (cluster.ONE_MACHINE_RAY_ENV)
        assert not [pid for pid, _ in tree if b"PreemptionWatcher" in _cmdline(pid)], "a preemption watcher runs"
        term.hang_up()
        os.killpg(term.proc.pid, signal.SIGHUP)
        assert term.wait(timeout=120) == 129, err_file.read_text()
    assert runs.read_status(run_dir)["status"] == "interrupted"
    resume_line(err_file.read_text(), "hup", tmp_path)
    assert "Traceback" not in err_file.read_text()
    assert_all_gone(tree)
