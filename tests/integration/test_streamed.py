"""Real photos, streamed: a generated JPEG folder prepared, trained on through each rank's Ray
Data pipeline (decoded and augmented by tasks), interrupted by a killed worker and by a change
of world size, and predicted on in bounded memory measured from outside the process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import imgtrain
from imgtrain import runs
from imgtrain.config import TrainConfig
from imgtrain.data.prepare import prepare
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from tests.conftest import peak_rss_of, quiet_display, run_cli

pytestmark = pytest.mark.integration

# 4 classes x 40 photos, 10 % validation, 20 % test: 112 training rows; batch 16 -> 7 steps.
SETTINGS = dict(workers=2, epochs=2, batch_size=16, eval_batch_size=16, log_every_steps=1,
                checkpoint_every_steps=3, deterministic=True, ledger=True)
STEPS = 7


def make_photos(root: Path, per_class: int, size: int = 40, seed: int = 0) -> int:
    """JPEGs a model can tell apart (each class its own colour and stripe), in several sizes;
    returns their total bytes."""
    rng = np.random.default_rng(seed)
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]
    total = 0
    for c, colour in enumerate(colours):
        for i in range(per_class):
            h, w = size + (i % 3) * 4, size + (i % 2) * 6
            pixels = np.clip(rng.normal(colour, 30, (h, w, 3)), 0, 255).astype(np.uint8)
            pixels[:, (c * w) // 4:(c * w) // 4 + 3] = 255
            path = root / f"class{c}" / f"{i:04d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(path, quality=90)
            total += path.stat().st_size
    return total


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    make_photos(root / "src", per_class=40)
    manifest = prepare("folder", root / "data", source_path=root / "src", size=(32, 32), val_fraction=0.1)
    assert manifest["storage"] == "encoded" and manifest["preset"] == "photos"
    assert manifest["splits"]["train"]["num_samples"] == 112
    return root / "data"


def config(data, storage, name, **overrides) -> TrainConfig:
    return TrainConfig(data=str(data), storage=str(storage), name=name, **{**SETTINGS, **overrides})


@pytest.fixture(scope="module")
def reference(ray_cluster, photos, tmp_path_factory) -> Path:
    result = imgtrain.train(config(photos, tmp_path_factory.mktemp("ref"), "ref"), display=quiet_display())
    assert result.status == "finished"
    return result.path


def global_batches(run_dir: Path) -> dict[int, list[int]]:
    """{global step: ids of the whole global batch, rank 0's first}, as the final weights saw
    them (a step trained again after a failure: the last worker group's lines win)."""
    started, steps = {}, defaultdict(lambda: defaultdict(dict))
    for path in sorted((run_dir / "ledger").glob("rank-*.jsonl")):
        for line in runs.read_jsonl(path):
            started[line["group"]] = line["group_started"]
            steps[line["step"]][line["group"]][line["rank"]] = line["ids"]
    last = {step: by_group[max(by_group, key=started.get)] for step, by_group in steps.items()}
    return {step: [i for rank in sorted(ranks) for i in ranks[rank]] for step, ranks in last.items()}


def history(run_dir: Path) -> list[tuple]:
    return [(r["epoch"], r["train_loss"], r["val_accuracy"], r["val_samples"]) for r in runs.epoch_history(run_dir)]


def test_the_streamed_reference_covers_every_row_once_per_epoch(reference, photos):
    batches = global_batches(reference)
    assert sorted(batches) == list(range(2 * STEPS))
    for epoch in range(2):
        ids = [i for s in range(epoch * STEPS, (epoch + 1) * STEPS) for i in batches[s]]
        assert len(ids) == len(set(ids)) == STEPS * 16  # none replayed, none skipped
    assert batches[0] != batches[STEPS]  # another order each epoch
    first = runs.epoch_history(reference)[0]
    assert first["val_split"] == "val"  # --val-fraction: training selects on val, test stays untouched
    assert first["val_samples"] == 16  # the validation split (4 x 4), every row once across both ranks
    assert (reference / "config.json").is_file() and runs.load_run(str(reference.parent), "ref").status == "finished"


def test_a_killed_worker_is_replaced_and_the_streamed_run_is_the_same_run(
        ray_cluster, photos, tmp_path, reference, monkeypatch):
    # Rank 1's process is SIGKILLed before global step 11 (epoch 1, mid-epoch); Ray Train
    # restarts the group from the newest checkpoint it registered: the step checkpoint after
    # step 9 (the pipelines then start mid-epoch) or, if the death was noticed first, epoch 0's.
    monkeypatch.setenv(FAULT_ENV, "kill:1:11")
    result = imgtrain.train(config(photos, tmp_path, "kill", max_failures=1), display=quiet_display())
    assert result.status == "finished" and (result.path / ".faults" / "kill-1-11-1").is_file()
    starts = [r["step"] for r in runs.read_metrics(result.path) if r["kind"] == "start"]
    assert starts in ([0, 9], [0, 7])
    assert global_batches(result.path) == global_batches(reference)
    assert history(result.path) == history(reference)


def test_a_streamed_run_resumes_exactly_with_another_world_size(ray_cluster, photos, tmp_path, reference):
    args = ["train", "--data", str(photos), "--storage", str(tmp_path), "--name", "grow", "--epochs", "2",
            "--batch-size", "16", "--eval-batch-size", "16", "--log-every-steps", "1", "--checkpoint-every-steps",
            "3", "--deterministic", "--ledger", "--address", ray_cluster]
    env = {**os.environ, FAULT_ENV: "raise:0:4", "COLUMNS": "200"}
    failed = subprocess.run([sys.executable, "-m", "imgtrain.cli", *args, "--workers", "2"], capture_output=True,
                            text=True, timeout=300, env=env)
    assert failed.returncode == 2 and "resumes from checkpoint_epoch_0000_step_0000003" in failed.stderr
    again = run_cli(*args, "--workers", "1")
    assert again.returncode == 0, again.stderr
    # one worker now takes what two took: the same rows at every step
    assert global_batches(tmp_path / "grow") == global_batches(reference)


def test_predict_streams_a_large_folder_in_bounded_memory(photos, tmp_path):
    # A model of 96x96 RGB photos; 6,000 128x128 photos would take 166 MB held as its input (more
    # decoded at their own size): predict's peak memory must not grow with the folder. Measured
    # here (anonymous memory, batches of 8): 2,000 -> 485 MB, 6,000 -> 476-480 MB. Small batches:
    # with 64 images a forward pass's activations come and go by about 100 MB, and the 3 times
    # longer run samples their top more often (once 2,000 -> 573 MB, 6,000 -> 622 MB).
    src = tmp_path / "train-src"
    make_photos(src, per_class=10, size=96)
    prepare("folder", tmp_path / "data96", source_path=src, size=(96, 96))
    cfg = TrainConfig(data=str(tmp_path / "data96"), storage=str(tmp_path / "runs"), name="m96", backend="local",
                      epochs=1, batch_size=8, limit_train_batches=1, eval_batch_size=8)
    imgtrain.train(cfg, display=quiet_display())
    peaks = {}
    for n in (2000, 6000):
        folder = tmp_path / f"in-{n}"
        make_photos(folder, per_class=n // 4, size=128, seed=n)
        peaks[n] = peak_rss_of(["predict", "m96", str(folder), "--out", str(tmp_path / f"p{n}.parquet"),
                                "--storage", str(tmp_path / "runs"), "--backend", "local", "--batch-size", "8"])
    held = 6000 * 96 * 96 * 3
    assert peaks[6000] - peaks[2000] < held * 0.25, (peaks, held)  # far under what holding them would take
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "p6000.parquet")) == 6000
