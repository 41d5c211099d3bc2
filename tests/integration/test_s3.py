"""Runs in an object store: ``--storage s3://...`` and ``--data s3://...`` against a real S3
server (moto, started by the test session), with the real CLI. Each "machine" (a CLI process,
or the CLI in this process with its environment) has its own working-copy cache: whatever it
finds, it found in the bucket. The session's Ray cluster was started with the way to the bucket
in its environment, as a cluster's nodes have their credentials."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from imgtrain.checkpoint_policy import POLICY
from imgtrain.data.format import read_split
from imgtrain.inference.predictor import Predictor
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from tests.conftest import assert_one_line_error, cli_here, wait_for
from tests.integration.test_serve import png_bytes, request, serving

pytestmark = pytest.mark.integration

BUCKET = "imgtrain"
RUNS = f"s3://{BUCKET}/runs"
DATA = f"s3://{BUCKET}/data/tiny"
# A small model (timm's test ResNet, 1.5 MB of weights): ResNet-18's 135 MB checkpoints (weights and
# optimizer state) through the test S3 server took most of these tests' time; what is proved is the store's.
SMALL_MODEL = ["--model", "timm:test_resnet"]
TRAIN = ["--workers", "2", "--epochs", "2", "--batch-size", "32", "--eval-batch-size", "50", "--log-every-steps", "2",
         *SMALL_MODEL]


def bucket(env: dict) -> pafs.S3FileSystem:
    host = env["IMGTRAIN_S3_ENDPOINT"].removeprefix("http://")
    return pafs.S3FileSystem(endpoint_override=host, scheme="http", region="us-east-1",
                             access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"])


def objects(env: dict, prefix: str) -> dict[str, int]:
    infos = bucket(env).get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True))
    return {i.path.removeprefix(f"{BUCKET}/{prefix}/"): i.size for i in infos if i.type == pafs.FileType.File}


def read_object(env: dict, rel: str) -> dict:
    with bucket(env).open_input_stream(f"{BUCKET}/{rel}") as f:
        return json.loads(f.read())


def write_object(env: dict, rel: str, record: dict) -> None:
    with bucket(env).open_output_stream(f"{BUCKET}/{rel}") as f:
        f.write(json.dumps(record).encode())


def machine(env: dict, tmp_path: Path, name: str) -> dict:
    """The environment of a process on another machine: same bucket, an empty cache of its own."""
    cache = tmp_path / f"cache-{name}"
    cache.mkdir(exist_ok=True)
    return {**os.environ, **env, "IMGTRAIN_CACHE": str(cache), "COLUMNS": "200"}


def cli(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout, env=env)


@contextlib.contextmanager
def on_machine(env: dict):
    """This process as another machine for the block: its environment is ``env`` (a cache of its own)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> Path:
    """The folder of the machine that trains ``srv`` (its cache, ``cache-trainer``, holds its working copy)."""
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def s3_trained(s3_server, ray_cluster, tiny_data, trainer):
    """The tiny data set uploaded as prepared, and a 2-worker run ``srv`` trained from it into the
    bucket by the real CLI off a terminal, on the session's cluster: (the bucket's environment,
    the finished command)."""
    pafs.copy_files(str(tiny_data), DATA.removeprefix("s3://"), source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=bucket(s3_server))
    env = machine(s3_server, trainer, "trainer")
    done = cli(env, "train", "--data", DATA, "--storage", RUNS, "--name", "srv", *TRAIN, "--address", ray_cluster)
    assert done.returncode == 0, done.stderr
    assert "run directory: s3://imgtrain/runs/srv" in done.stdout
    return s3_server, done


@pytest.fixture(scope="module")
def s3_run(s3_trained):
    return s3_trained[0]


def test_the_cli_off_a_terminal_prints_one_line_per_phase_and_epoch(s3_trained, ray_cluster):
    # The suite's one Ray run through the CLI off a terminal (a CI log, a pipe): no bar, no Ray noise.
    out, err = s3_trained[1].stdout, s3_trained[1].stderr
    assert "epoch   1/2" in out and "epoch   2/2" in out and "test accuracy" not in out
    assert "note: this data set has no val split" in out and "on the test split that chose it" in out
    assert "Traceback" not in out + err
    assert "WARNING" not in out + err  # Ray's own noise goes to logs/
    # one line per start-up phase with its duration, in order
    phases = re.findall(r"^(checking the data set|starting Ray|joining the Ray cluster at \S+|checking resources and storage|"
                        r"starting 2 workers|loading data|building the model|first \d+ steps?): \d+\.\d s$", out, re.M)
    assert phases == ["checking the data set", f"joining the Ray cluster at {ray_cluster}", "checking resources and storage",
                      "starting 2 workers", "loading data", "building the model", "first 2 steps"], out  # --log-every-steps 2


def test_the_run_lives_in_the_bucket(s3_run, trainer):
    found = objects(s3_run, "runs/srv")
    for name in ("config.json", "metrics.jsonl", "status.json", ".imgtrain-run", "logs/driver.log"):
        assert name in found, sorted(found)
    checkpoints = {k.split("/")[0] for k in found if POLICY.parse(k.split("/")[0]) is not None}
    assert checkpoints and all(f"{c}/model.pt" in found and f"{c}/meta.json" in found for c in checkpoints)
    assert ".lock" not in found and not any(k.startswith("logs/ray") for k in found)  # this machine's own
    status = json.loads(bucket(s3_run).open_input_stream(f"{BUCKET}/runs/srv/status.json").read())
    assert status["status"] == "finished"
    # Ray Train's workers uploaded the checkpoints: the driver's machine brought down their records only
    last = trainer / "cache-trainer" / "stores" / "s3" / BUCKET / "runs" / "srv" / POLICY.epoch_name(1)
    assert (last / "meta.json").is_file() and not (last / "model.pt").exists()


def test_the_ray_driver_calibrates_its_best_checkpoint_in_the_bucket(s3_run, trainer, sample_raw, tmp_path):
    """The end of a Ray run in an object store (``driver._calibrate``, on the trainer's working
    copy, the run's lock held as its driver holds it): the best checkpoint that Ray's workers
    uploaded is calibrated and its calibration uploaded into it; the weights brought down for
    the pass go again. The tiny set has no val split, so srv's own end fitted nothing: a val
    split of 100 other training digits stands in for it (``--data``)."""
    import numpy as np

    from imgtrain.config import TrainConfig
    from imgtrain.data.raw import RawDataset, gather
    from imgtrain.data.writer import write_dataset
    from imgtrain.storage import checkpoint as ckpt
    from imgtrain.storage import ownership, runs
    from imgtrain.training.driver import _calibrate

    rows = lambda s, a, b: gather(s.images, s.labels, s.ids, np.arange(a, b))  # noqa: E731
    val_data = tmp_path / "with-val"
    write_dataset(RawDataset(sample_raw.classes, rows(sample_raw.train, 0, 64), rows(sample_raw.test, 0, 20),
                             val=rows(sample_raw.train, 256, 356)), val_data, name="with-val", source="mnist-sample")
    notes = []
    with on_machine(machine(s3_run, trainer, "trainer")):
        run_dir = trainer / "cache-trainer" / "stores" / "s3" / BUCKET / "runs" / "srv"
        best = runs.read_run(run_dir).best_checkpoint
        assert not (best / ckpt.MODEL_FILE).exists()  # the driver's copy: the records only
        with ownership.locked(run_dir, "trained"):
            _calibrate(TrainConfig(name="srv", storage=RUNS, data=str(val_data)), best, type("Display", (), {
                "note": staticmethod(notes.append)})(), again=True)
    assert notes and notes[0].startswith(f"calibration of {best.name}: temperature T = "), notes
    assert f"{best.name}/calibrated.pt" in objects(s3_run, "runs/srv")
    assert ckpt.CALIBRATION_FILE in read_object(s3_run, f"runs/srv/{best.name}/meta.json")["sha256"]
    assert sorted(p.name for p in best.iterdir()) == [ckpt.CALIBRATION_FILE, ckpt.META_FILE]  # weights gone again


def test_runs_list_show_evaluate_predict_and_report_on_another_machine(s3_run, tmp_path, capsys):
    with on_machine(machine(s3_run, tmp_path, "reader")):
        listed = cli_here(capsys, "runs", "list", "--storage", RUNS, "--json")
        assert listed.returncode == 0, listed.stderr
        [run] = [r for r in json.loads(listed.stdout) if r["name"] == "srv"]
        assert run["location"] == f"{RUNS}/srv" and run["status"] == "finished" and run["epochs_completed"] == 2

        shown = cli_here(capsys, "runs", "show", "srv", "--storage", RUNS, "--json")
        assert shown.returncode == 0, shown.stderr
        best = json.loads(shown.stdout)["best_val_accuracy"]

        evaluated = cli_here(capsys, "evaluate", "srv", "--storage", RUNS, "--backend", "local", "--json")
        assert evaluated.returncode == 0, evaluated.stderr
        result = json.loads(evaluated.stdout)
        assert result["num_samples"] == 100
        assert result["accuracy"] == pytest.approx(best, abs=1e-9)  # the weights training validated

        out = tmp_path / "preds.parquet"
        predicted = cli_here(capsys, "predict", "srv", DATA, "--storage", RUNS, "--backend", "local", "--out", str(out))
        assert predicted.returncode == 0, predicted.stderr
        import pandas as pd

        preds = pd.read_parquet(out)
        assert len(preds) == 100
        assert (preds["pred_index"] == preds["label"]).mean() == pytest.approx(best, abs=1e-9)

        reported = cli_here(capsys, "report", "srv", "--storage", RUNS)
        assert reported.returncode == 0, reported.stderr
    assert "report/report.html" in objects(s3_run, "runs/srv")  # in the bucket, not only on this machine


def test_serve_a_run_from_the_bucket(s3_run, tiny_data, tmp_path, monkeypatch):
    for key, value in machine(s3_run, tmp_path, "server").items():
        monkeypatch.setenv(key, value)
    _, images, _ = read_split(tiny_data, "test")
    with serving(RUNS, tmp_path) as (_, port, _, _):
        answers = [request(port, "/predict", png_bytes(images[i]), "image/png") for i in range(8)]
    assert all(status == 200 for status, _ in answers), answers
    # the run's best checkpoint, loaded here from the bucket, answers the same
    expected = Predictor("srv", storage=RUNS).predict_proba(images[:8]).argmax(axis=1)
    assert [a["index"] for _, a in answers] == expected.tolist()


def test_a_driver_killed_mid_run_resumes_from_the_bucket_on_another_machine(s3_server, tiny_data, tmp_path, capsys):
    # The local backend: what is proved here is the driver's (the bucket's records, the lease, the
    # resume), the same for both backends; Ray Train's uploads to the bucket are s3_run's.
    args = ["train", "--data", str(tiny_data), "--storage", RUNS, "--name", "killed", "--backend", "local",
            "--epochs", "3", "--batch-size", "32", "--eval-batch-size", "50", "--threads-per-worker", "1", *SMALL_MODEL]
    # The first machine is lost in the middle of epoch 1: its driver stops at step 12 (alive: its
    # files keep going up every few seconds) until epoch 0's checkpoint is in the bucket, then is
    # SIGKILLed (with the local backend the driver is the only process of the run).
    first = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                             env={**machine(s3_server, tmp_path, "first"), FAULT_ENV: "hang:0:12"})
    try:  # meta.json is the last file of a checkpoint to go up: the checkpoint is whole
        wait_for(lambda: f"{POLICY.epoch_name(0)}/meta.json" in objects(s3_server, "runs/killed"), 240,
                 "the first checkpoint in the bucket", first, poll_s=0.2)
    finally:
        first.kill()
        first.wait(timeout=30)

    # as if the lost machine were another host: only its heartbeat can tell that its driver is gone
    status = read_object(s3_server, "runs/killed/status.json")
    assert status["status"] == "running"
    status["host"] = "another-machine"
    write_object(s3_server, "runs/killed/status.json", status)
    write_object(s3_server, "runs/killed/heartbeat.json", {"host": "another-machine", "pid": status["pid"],
                                                            "time": time.time()})
    env = machine(s3_server, tmp_path, "second")
    with on_machine(env):
        refused = cli_here(capsys, *args)
        assert_one_line_error(refused, "another-machine (its heartbeat")
        time.sleep(1.1)  # the bucket's times are whole seconds: the new heartbeat is seen as changed
        write_object(s3_server, "runs/killed/heartbeat.json", {"host": "another-machine", "pid": status["pid"],
                                                                "time": time.time() - 120})
        again = cli_here(capsys, *args)
        assert again.returncode == 0, again.stderr
        assert "resuming run 'killed' at epoch" in again.stdout
        shown = json.loads(cli_here(capsys, "runs", "show", "killed", "--storage", RUNS, "--json").stdout)
    assert shown["status"] == "finished"
    assert [m["epoch"] for m in shown["metrics"]] == [0, 1, 2]  # each epoch once, none lost


def test_clean_deletes_the_run_from_the_bucket(s3_run, tmp_path, capsys):
    assert objects(s3_run, "runs/srv")
    with on_machine(machine(s3_run, tmp_path, "cleaner")):
        done = cli_here(capsys, "clean", "runs", "srv", "--storage", RUNS, "--yes")
        assert done.returncode == 0, done.stderr
        assert objects(s3_run, "runs/srv") == {}
        listed = json.loads(cli_here(capsys, "runs", "list", "--storage", RUNS, "--json").stdout)
    assert "srv" not in [r["name"] for r in listed]


def test_a_bucket_that_does_not_exist_fails_in_seconds_with_one_line(s3_server, tiny_data, tmp_path, capsys):
    with on_machine(machine(s3_server, tmp_path, "bad")):
        started = time.monotonic()
        done = cli_here(capsys, "train", "--data", str(tiny_data), "--storage", "s3://no-such-bucket/runs",
                        "--name", "x", *TRAIN)
        assert_one_line_error(done, "no-such-bucket", "IMGTRAIN_S3_ENDPOINT")
        assert time.monotonic() - started < 60

        refused = cli_here(capsys, "train", "--data", str(tiny_data), "--storage", RUNS, "--name", "x",
                           "--overwrite", *TRAIN)
    assert_one_line_error(refused, "imgtrain clean runs x")


def test_doctor_checks_the_bucket_from_the_node(s3_server, ray_cluster, tmp_path):
    # from this node; nodes that cannot reach the bucket are test_multinode's
    env = machine(s3_server, tmp_path, "doctor")
    ready = cli(env, "doctor", "--storage", RUNS, "--address", ray_cluster, timeout=180)  # the session's node
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert "every node (1) writes, reads and deletes in s3://imgtrain/runs" in ready.stdout

