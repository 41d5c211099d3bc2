"""imgtrain tune for real: Ray Tune trials that are imgtrain runs, on the session's Ray cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from tests.conftest import assert_one_line_error, cli_here, run_cli, wait_for
from tests.integration.test_signals import checkpointed

pytestmark = pytest.mark.integration

# timm's small test ResNet (what is proved is Tune's, whatever the model): lr 0.003 learns in 8
# steps (val accuracy 0.35 after 1 epoch, 0.42 after 2, local backend); lr 1e-6 does not (0.07):
# run one at a time in grid order, ASHA stops the second at its first rung. Every sweep here
# feeds its trials with the torch DataLoader: Ray Data's start-up costs each trial seconds (Ray
# Data ingest is proved in test_train and others).
ASHA = ["--search", "lr=grid(0.003,1e-6)", "--scheduler", "asha", "--epochs", "2", "--workers", "1", "--ingest", "torch",
        "--batch-size", "32", "--eval-batch-size", "50", "--model", "timm:test_resnet", "--max-concurrent", "1"]


def sweep_args(data, storage, name, address, *more):
    return ["tune", "--data", str(data), "--name", name, "--storage", str(storage), "--address", address, *more]


def show(capsys, storage, name) -> dict:
    proc = cli_here(capsys, "tune", "show", name, "--storage", str(storage), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def events(stdout: str) -> list[tuple[str, str]]:
    """(trial, what happened) for each state change the sweep printed."""
    found = [re.match(r"\d\d:\d\d:\d\d (trial-\d{5}): (\w+)", line) for line in stdout.splitlines()]
    return [m.groups() for m in found if m]


def test_an_interrupted_asha_sweep_resumes_its_trials_as_imgtrain_runs(tiny_data, tmp_path, ray_cluster, capsys):
    # One sweep, stopped by Ctrl-C and run again twice. The first trial (lr 0.003) finishes; the
    # second (lr 1e-6) stops for good before its step 6 (rank 0 hangs: IMGTRAIN_INJECT_FAULT, for
    # that trial only), after its step-4 checkpoint, so the Ctrl-C always finds the first trial
    # done and the second one training, with a checkpoint to resume from. One at a time: the
    # second starts once Tune is stopping the first, so by its first checkpoint (a Ray Train start
    # later) Tune has long recorded the first as ended (two at once raced: the first's run had
    # written "finished" while Tune, still stopping its process, saved it as running). The fault
    # is in the first command's environment only: the sweep hands it to its trials, whose
    # processes have the session cluster's environment, and the commands after it train on.
    storage = tmp_path
    args = sweep_args(tiny_data, storage, "s", ray_cluster, *ASHA, "--checkpoint-every-steps", "4")
    trials_dir = storage / "s" / "trials"
    proc = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, FAULT_ENV: "hang:0:6@trial-00001"})
    try:
        wait_for(lambda: checkpointed(trials_dir / "trial-00001"), timeout=240,
                 what="the second trial's first checkpoint", proc=proc)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: Tune saves its state and stops the trial
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err.startswith("interrupted; run the same command again"), err
    # one line per state change, no Ray or Tune output on the terminal
    assert out.splitlines()[0].startswith("sweep s: 2 trial(s), 1 at a time, scheduler asha, metric val_accuracy (max)")
    assert events(out) == [("trial-00000", "started"), ("trial-00000", "epoch"), ("trial-00000", "epoch"),
                           ("trial-00000", "finished"), ("trial-00001", "started")], out
    assert show(capsys, storage, "s")["status"] == "interrupted"
    first = (trials_dir / "trial-00000" / runs.METRICS_FILE).read_text()

    # Run again: the finished trial is not trained again, the second resumes from its checkpoint
    # and ASHA, which Tune rebuilt empty, judges it against the first trial's recorded epochs: it
    # stops the second on its first epoch's result, as an uninterrupted sweep does. Its workers,
    # which do not wait for Tune's answer, may have trained the next epoch by the time the stop
    # reaches them (a loaded machine): what is on disk is shown, whichever it is.
    again = run_cli(*args, timeout=240)
    assert again.returncode == 0, again.stderr
    assert again.stderr == ""
    assert events(again.stdout) == [("trial-00001", "started"), ("trial-00001", "epoch"),
                                    ("trial-00001", "stopped")], again.stdout
    lines = again.stdout.splitlines()
    table_at = next(i for i, line in enumerate(lines) if line.startswith("sweep s  status: finished"))
    assert re.match(r"\d\d:\d\d:\d\d trial-00001: stopped", lines[table_at - 1]), again.stdout  # nothing between
    assert (trials_dir / "trial-00000" / runs.METRICS_FILE).read_text() == first
    # The resume, as the trial's driver said it before its workers started. Not its start record:
    # that travels from rank 0 through the monitor actor, and ASHA's stop can end the driver before
    # it arrives (seen in CI; the epoch records then come back from the checkpoint, the start not).
    trial_log = (storage / "s" / "logs" / "trial-00001.log").read_text()
    assert trial_log.count("resuming run 'trial-00001' at epoch 1, step 4 from checkpoint_epoch_0000_step_0000004") == 1
    starts = [r for r in runs.read_metrics(trials_dir / "trial-00001") if r["kind"] == "start"]
    assert starts[0]["restored_from"] is None and starts[0]["step"] == 0, starts

    s = show(capsys, storage, "s")
    assert (s["status"], s["metric"], s["mode"], s["search"]) == ("finished", "val_accuracy", "max",
                                                                  {"lr": "grid(0.003, 1e-06)"})
    by_name = {t["name"]: t for t in s["trials"]}
    assert {n: (t["params"], t["status"]) for n, t in by_name.items()} == {
        "trial-00000": ({"lr": 0.003}, "finished"), "trial-00001": ({"lr": 1e-06}, "stopped")}
    assert by_name["trial-00000"]["epochs_done"] == 2 and by_name["trial-00001"]["epochs_done"] in (1, 2)
    assert by_name["trial-00001"]["epochs_done"] == len(runs.epoch_history(trials_dir / "trial-00001"))
    stopped = runs.read_status(trials_dir / "trial-00001")
    assert stopped["status"] == "stopped" and "ASHA after epoch 1 of 2" in stopped["reason"]

    # the best trial, from the runs' own metrics.jsonl
    best_of = {n: max(r["val_accuracy"] for r in runs.epoch_history(trials_dir / n)) for n in by_name}
    best = max(best_of, key=best_of.get)
    assert best_of["trial-00000"] > best_of["trial-00001"]
    assert {n: t["best_metric"] for n, t in by_name.items()} == best_of
    assert s["best"]["name"] == best and s["best"]["best_metric"] == best_of[best]
    assert s["best"]["config"]["lr"] == 0.003 and s["best"]["config"]["name"] == best
    assert Path(s["best"]["checkpoint"]).parent == trials_dir / best
    assert (Path(s["best"]["checkpoint"]) / "model.pt").is_file()

    # each trial is an ordinary run: runs show works on it, with the trial's settings
    shown = cli_here(capsys, "runs", "show", best, "--storage", str(trials_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    run = json.loads(shown.stdout)
    assert (run["status"], run["epochs_completed"]) == ("finished", 2)
    assert runs.read_config(trials_dir / "trial-00001")["lr"] == 1e-06
    assert (storage / "s" / "logs" / "driver.log").is_file() and (storage / "s" / "logs" / "trial-00000.log").is_file()

    # A finished sweep run again trains nothing; other settings are refused.
    before = {p.name: p.read_text() for p in trials_dir.glob("*/metrics.jsonl")}
    third = run_cli(*args, timeout=180)
    assert third.returncode == 0, third.stderr
    assert "resuming" in third.stdout and "started" not in third.stdout
    assert {p.name: p.read_text() for p in trials_dir.glob("*/metrics.jsonl")} == before
    other = cli_here(capsys, *sweep_args(tiny_data, storage, "s", ray_cluster, *ASHA[:-2], "--epochs", "3",
                                         "--checkpoint-every-steps", "4"))
    assert_one_line_error(other, "sweep 's' already exists", "epochs: 2 -> 3")


def test_bad_sweeps_fail_in_seconds_with_one_line(ray_cluster, tiny_data, tmp_path, capsys):
    base = ["tune", "--data", str(tiny_data), "--name", "b", "--storage", str(tmp_path)]
    assert_one_line_error(cli_here(capsys, *base, "--search", "lr=logunifrom(1e-4,1e-2)"),
                          "unknown function 'logunifrom'")
    assert_one_line_error(cli_here(capsys, *base, "--search", "learning_rate=uniform(0,1)"), "not a training setting")
    assert_one_line_error(cli_here(capsys, *base), "nothing to search")
    started = time.monotonic()  # a request the cluster cannot place: from a cold start, in seconds
    too_big = run_cli(*base, "--search", "lr=choice(0.1)", "--workers", "8", "--address", ray_cluster)
    assert_one_line_error(too_big, "8 worker(s)", "the Ray cluster has 4")
    assert time.monotonic() - started < 60
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert_one_line_error(cli_here(capsys, *base[:4], "taken", *base[5:], "--search", "lr=choice(0.1)"),
                          "is not an imgtrain sweep")
    assert_one_line_error(cli_here(capsys, "tune", "show", "nope", "--storage", str(tmp_path)), "no sweep named 'nope'")


def test_failed_trials_are_reported_and_a_sweep_of_failures_exits_non_zero(ray_cluster, tiny_data, tmp_path, capsys):
    proc = run_cli(*sweep_args(tiny_data, tmp_path, "f", ray_cluster, "--search", "model=choice(nosuchnet)",
                               "--epochs", "1", "--workers", "1", "--ingest", "torch"))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert re.search(r"trial-00000: failed: --model nosuchnet: no torchvision model 'nosuchnet'", proc.stdout)
    assert proc.stderr.startswith("error: every trial of sweep 'f' failed") and "Traceback" not in proc.stderr
    (trial,) = show(capsys, tmp_path, "f")["trials"]
    assert (trial["status"], trial["epochs_done"], trial["best_metric"]) == ("failed", 0, None)
    assert trial["error"].startswith("--model nosuchnet: no torchvision model")
