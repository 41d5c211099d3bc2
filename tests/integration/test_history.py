"""Nothing lost from a run's history, however the driver dies: the kill matrix.

One run of the local backend (where the training loop runs in the driver's own process) is
SIGKILLed at named moments, one after the other: during the first steps, right after a step
checkpoint and right after an epoch checkpoint are stored (before their records reach
metrics.jsonl), while a checkpoint is being copied into the run, and during validation. Each
kill is followed by the same command. After every process, every epoch trained so far is in
metrics.jsonl exactly once (an epoch whose record was lost comes back from the checkpoint the
run resumes from), status.json and the checkpoints agree, and the final history equals an
uninterrupted run's, to the bit (--deterministic). None of this depends on Ray: the driver's
records and the checkpoints are the same for both backends. The Ray backend's own case, rank 0's
worker SIGKILLed right after a checkpoint and replaced by Ray Train, is in test_resume.py.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import imgtrain
from imgtrain.checkpoint_policy import POLICY
from imgtrain.config import TrainConfig
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.progress import TrainingDisplay
from tests.conftest import cli_here

pytestmark = pytest.mark.integration

# 256 rows / batch 32 = 8 steps per epoch, 24 in all; step checkpoints at steps 4, 12 and 20.
# One torch thread: with one per core, OpenMP spins against whatever else runs on the machine
# (a run of these settings here, the machine busy: 55 s with 2 threads, 11 s with 1). A small model:
# what is proved is the history, whatever the model (ResNet-18 writes 135 MB at each checkpoint).
SETTINGS = dict(backend="local", epochs=3, batch_size=32, eval_batch_size=50, log_every_steps=1,
                checkpoint_every_steps=4, deterministic=True, threads_per_worker=1, model="timm:test_resnet")
HISTORY_KEYS = ("epoch", "step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_f1_macro",
                "train_samples", "val_samples", "lr")
# (fault, what the process has done when it dies), in the order the run reaches them
KILLS = [
    ("kill:0:2", "trained two steps, no checkpoint yet"),
    ("kill-saved:0:4", "stored a step checkpoint, not yet recorded"),
    ("kill-saved:0:8", "stored epoch 0's checkpoint, its epoch record not written"),
    ("kill-validating:0:16", "validating epoch 1"),
    ("kill-saving:0:20", "copying a step checkpoint into the run"),
    ("kill-saved:0:24", "stored the last epoch's checkpoint, its record not written"),
]


def cli_args(data: Path, storage: Path) -> list[str]:
    return ["train", "--data", str(data), "--storage", str(storage), "--name", "matrix", "--backend", "local",
            "--epochs", "3", "--batch-size", "32", "--eval-batch-size", "50", "--log-every-steps", "1",
            "--checkpoint-every-steps", "4", "--deterministic", "--threads-per-worker", "1", "--model", "timm:test_resnet"]


# Every `imgtrain train` here is a process of its own, SIGKILLed for real. They are forked from
# one process that imported imgtrain and torch once: a cold start spends 3 s on imports (5 s on a
# busy machine), seven times here. It reads a JSON request a line and answers with the child's
# exit code (negative: the signal that ended it), or "timeout".
FORKER = r"""
import json, os, signal, sys, time, traceback
import imgtrain.cli, imgtrain.training.local_backend  # what `imgtrain train --backend local` imports

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: `imgtrain ARGS`, its output into files
        code = 1
        try:
            os.environ.update(request["env"])
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                                    (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
                os.dup2(os.open(path, flags), fd)
            sys.argv = ["imgtrain", *request["args"]]
            imgtrain.cli.main()
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    while not (ended := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    if not ended[0]:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(ended[1]) if ended[0] else "timeout", flush=True)
"""


@pytest.fixture(scope="module")
def imgtrain_cli(tmp_path_factory):
    """``run(args, fault=None)``: the CompletedProcess of ``imgtrain ARGS`` in a new process
    forked by FORKER, with the fault ``IMGTRAIN_INJECT_FAULT`` names."""
    forker = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "COLUMNS": "200"})
    outputs, numbers = tmp_path_factory.mktemp("outputs"), itertools.count()

    def run(args: list[str], fault: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        n = next(numbers)
        out, err = outputs / f"{n}.out", outputs / f"{n}.err"
        request = {"args": args, "env": {**(env or {}), **({FAULT_ENV: fault} if fault else {})}, "timeout": 240,
                   "stdout": str(out), "stderr": str(err)}
        forker.stdin.write(json.dumps(request) + "\n")
        forker.stdin.flush()
        answer = forker.stdout.readline().strip()
        assert answer and answer != "timeout", (answer or "the forking process ended", args, fault)
        return subprocess.CompletedProcess(["imgtrain", *args], int(answer), out.read_text(), err.read_text())

    yield run
    forker.stdin.close()  # ends its loop
    try:
        forker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        forker.kill()
        forker.wait()


def epoch_records(run_dir: Path) -> list[dict]:
    """Every epoch record in metrics.jsonl, duplicates included (epoch_history would hide them)."""
    return [r for r in runs.read_metrics(run_dir) if r["kind"] == "epoch"]


def completed_epochs(run_dir: Path) -> int:
    """Epochs finished according to the newest checkpoint that verifies."""
    good, _ = ckpt.verified(run_dir)
    if not good:
        return 0
    meta = ckpt.read_meta(good[-1])
    return meta["in_epoch"]["epoch"] if "in_epoch" in meta else meta["epoch"] + 1


def assert_history_matches_checkpoints(run_dir: Path, lost_last: bool) -> None:
    epochs = [r["epoch"] for r in epoch_records(run_dir)]
    assert epochs == list(range(len(epochs))), f"epochs recorded: {epochs}"  # each once, none skipped
    done = completed_epochs(run_dir)
    # A driver killed between a checkpoint and its record has not written that epoch yet: the
    # next start recovers it. Nothing else may be missing.
    assert len(epochs) == (done - 1 if lost_last else done), (epochs, done)


def history(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in HISTORY_KEYS} for r in runs.epoch_history(run_dir)]


def test_a_driver_killed_at_any_moment_loses_no_epoch_of_the_history(tiny_data, tmp_path, capsys, imgtrain_cli):
    reference = imgtrain.train(TrainConfig(data=str(tiny_data), storage=str(tmp_path / "ref"), name="ref",
                                           **SETTINGS), display=TrainingDisplay(quiet=True))
    storage = tmp_path / "runs"
    run_dir = storage / "matrix"
    args = cli_args(tiny_data, storage)
    cache = tmp_path / "cache"  # the user's cache, where a checkpoint is written before it joins the run
    staged = cache / "staging"
    for n, (fault, moment) in enumerate(KILLS):
        proc = imgtrain_cli(args, fault, env={"IMGTRAIN_CACHE": str(cache)})
        assert proc.returncode == -signal.SIGKILL, (fault, proc.returncode, proc.stderr[-2000:])
        if n:  # the same command after a killed driver resumes the run
            assert "resuming run 'matrix'" in proc.stdout, (fault, proc.stdout)
        assert (run_dir / ".faults" / f"{fault.split(':')[0]}-0-{fault.split(':')[2]}-1").is_file()
        assert runs.read_status(run_dir)["status"] == "interrupted", moment  # not "running" forever
        assert_history_matches_checkpoints(run_dir, lost_last=fault.startswith("kill-saved:0:") and fault.endswith(("8", "24")))
        if fault.startswith("kill-saving"):  # died with a checkpoint in its staging folder, not in /tmp
            assert list(staged.glob("*/rank-0/*/meta.json")), list(staged.rglob("*"))
    lost_epoch_2 = epoch_records(run_dir)
    assert [r["epoch"] for r in lost_epoch_2] == [0, 1]  # epoch 2's record died with the driver

    final = imgtrain_cli(args, env={"IMGTRAIN_CACHE": str(cache)})
    assert final.returncode == 0, final.stderr
    assert "already complete" in final.stdout  # the last checkpoint was stored before the kill...
    records = epoch_records(run_dir)
    assert [r["epoch"] for r in records] == [0, 1, 2]  # ...and its record is recovered from it
    recovered = {r["epoch"]: r.get("recovered_from") for r in records}
    assert recovered == {0: POLICY.epoch_name(0), 1: None, 2: POLICY.epoch_name(2)}
    assert history(run_dir) == history(reference.path)  # the same numbers as an uninterrupted run
    assert runs.read_status(run_dir)["status"] == "finished"
    assert not list(run_dir.glob(".checkpoint_*.tmp"))  # the half-copied checkpoint was cleaned up
    assert not staged.exists() or not any(staged.iterdir())  # and what the killed saves left
    shown = cli_here(capsys, "runs", "show", "matrix", "--storage", str(storage), "--json")
    assert [m["epoch"] for m in json.loads(shown.stdout)["metrics"]] == [0, 1, 2]
