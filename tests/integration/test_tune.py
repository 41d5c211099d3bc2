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


@pytest.fixture(scope="module")
def asha_sweep(ray_cluster, tiny_data, tmp_path_factory):
    storage = tmp_path_factory.mktemp("sweeps")
    args = sweep_args(tiny_data, storage, "s", ray_cluster, *ASHA)
    started = time.monotonic()
    proc = run_cli(*args, timeout=300)
    return proc, storage, args, time.monotonic() - started


def test_asha_sweep_trials_are_imgtrain_runs(asha_sweep, capsys):
    proc, storage, _, took = asha_sweep
    assert proc.returncode == 0, proc.stderr
    trials_dir = storage / "s" / "trials"
    out = proc.stdout.splitlines()
    # one line per state change, no Ray or Tune output on the terminal
    assert out[0].startswith("sweep s: 2 trial(s), 1 at a time, scheduler asha, metric val_accuracy (max)")
    events = [line for line in out[1:] if re.match(r"\d\d:\d\d:\d\d trial-0000[01]: ", line)]
    assert [e.split(": ", 1)[1].split()[0] for e in events] == [
        "started", "epoch", "epoch", "finished", "started", "epoch", "stopped"], out
    table_at = next(i for i, line in enumerate(out) if line.startswith("sweep s  status: finished"))
    assert table_at == len(events) + 1, out  # nothing else between the events and the table
    assert proc.stderr == ""

    s = show(capsys, storage, "s")
    assert (s["status"], s["metric"], s["mode"], s["search"]) == ("finished", "val_accuracy", "max",
                                                                  {"lr": "grid(0.003, 1e-06)"})
    by_name = {t["name"]: t for t in s["trials"]}
    # ASHA stops the second trial on its first epoch's result; its workers, which do not wait for
    # Tune's answer, may have trained the next epoch by the time the stop reaches them (a loaded
    # machine): what is on disk is shown, whichever it is.
    assert {n: (t["params"], t["status"]) for n, t in by_name.items()} == {
        "trial-00000": ({"lr": 0.003}, "finished"), "trial-00001": ({"lr": 1e-06}, "stopped")}
    assert by_name["trial-00000"]["epochs_done"] == 2 and by_name["trial-00001"]["epochs_done"] in (1, 2)
    assert by_name["trial-00001"]["epochs_done"] == len(runs.epoch_history(trials_dir / "trial-00001"))

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
    stopped = runs.read_status(trials_dir / "trial-00001")
    assert stopped["status"] == "stopped" and "ASHA after epoch 1 of 2" in stopped["reason"]
    assert (storage / "s" / "logs" / "driver.log").is_file() and (storage / "s" / "logs" / "trial-00000.log").is_file()
    print(f"2-trial ASHA sweep: {took:.1f} s")


def test_rerun_of_a_finished_sweep_trains_nothing_and_other_settings_are_refused(asha_sweep, tiny_data, ray_cluster,
                                                                                capsys):
    proc, storage, args, _ = asha_sweep
    assert proc.returncode == 0, proc.stderr
    trials_dir = storage / "s" / "trials"
    before = {p.name: p.read_text() for p in trials_dir.glob("*/metrics.jsonl")}
    again = run_cli(*args, timeout=180)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stdout and "started" not in again.stdout
    assert {p.name: p.read_text() for p in trials_dir.glob("*/metrics.jsonl")} == before

    other = cli_here(capsys, *sweep_args(tiny_data, storage, "s", ray_cluster, *ASHA[:-2], "--epochs", "3"))
    assert_one_line_error(other, "sweep 's' already exists", "epochs: 2 -> 3")


def test_interrupted_sweep_resumes_without_rerunning_finished_trials(tiny_data, tmp_path, ray_cluster, capsys):
    # The second trial stops for good before its step 20 (rank 0 hangs: IMGTRAIN_INJECT_FAULT),
    # after its epoch-1 checkpoint; the first, with twice the batch, has 16 steps in all and
    # never gets there. So the Ctrl-C always finds the first trial done and the second one
    # training, with a checkpoint to resume from (the first version of this test raced a trial
    # to its end). One at a time: the second starts once Tune is stopping the first, so by its
    # first epoch (a Ray Train start later) Tune has long recorded the first as ended. Two at
    # once raced: the first's run had written "finished" while Tune, still stopping its process,
    # saved it as running, and the resumed sweep started it again (seen once; its run then
    # trained nothing). Both on the session's cluster: the sweep hands the fault in its
    # environment to its trials, whose processes have the cluster's environment.
    args = ["tune", "--data", str(tiny_data), "--name", "r", "--storage", str(tmp_path), "--search",
            "batch_size=grid(32,16)", "--scheduler", "fifo", "--epochs", "2", "--workers", "1",
            "--max-concurrent", "1", "--model", "timm:test_resnet", "--ingest", "torch", "--address", ray_cluster]
    trials_dir = tmp_path / "r" / "trials"
    proc = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, FAULT_ENV: "hang:0:20"})
    try:
        wait_for(lambda: any(r["kind"] == "epoch" for r in runs.read_metrics(trials_dir / "trial-00001")),
                 timeout=240, what="the second trial's first epoch", proc=proc)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: Tune saves its state and stops the trial
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err.startswith("interrupted; run the same command again"), err
    assert show(capsys, tmp_path, "r")["status"] == "interrupted"
    first = (trials_dir / "trial-00000" / runs.METRICS_FILE).read_text()

    again = run_cli(*args, timeout=240)
    assert again.returncode == 0, again.stderr
    assert "trial-00000: started" not in again.stdout and "trial-00001: started" in again.stdout
    assert (trials_dir / "trial-00000" / runs.METRICS_FILE).read_text() == first  # not trained again
    starts = [r for r in runs.read_metrics(trials_dir / "trial-00001") if r["kind"] == "start"]
    assert starts[0]["restored_from"] is None
    assert starts[-1]["restored_from"] is not None and starts[-1]["step"] == 16  # resumed from its checkpoint
    s = show(capsys, tmp_path, "r")
    assert s["status"] == "finished"
    assert [(t["status"], t["epochs_done"]) for t in s["trials"]] == [("finished", 2), ("finished", 2)]


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
