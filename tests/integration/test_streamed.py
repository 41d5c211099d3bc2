"""Real photos, streamed: a generated JPEG folder prepared; trained on through each rank's Ray
Data pipeline (decoded and augmented by tasks), retried by Ray Train after an exception, failed
past max_failures and resumed inside an epoch with another world size, in the global order an
uninterrupted run of the local backend follows; resumed on the local backend (the same readers
and per-row augmentation, no Ray) to the same bits; and predicted on in bounded memory
measured from outside the process."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

import imgtrain
from imgtrain.config import TrainConfig, rank_share
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.errors import ImgtrainError
from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.faults import InjectedFault
from imgtrain.training.progress import TrainingDisplay
from tests.conftest import peak_rss_of, quiet_display
from tests.integration.ledger import committed_batches, global_batches, ledger_lines

pytestmark = pytest.mark.integration

# 4 classes x 40 photos, 10 % validation, 20 % test: 112 training rows; batch 16 -> 7 steps.
# One torch thread per process: with one per core, OpenMP spins against the other processes
# of a busy machine (5 times slower here).
# Every photo augmentation on, and mixup/CutMix over the global batch (gathered from both ranks):
# the order, the resumes and the world sizes below hold with them.
SETTINGS = dict(workers=2, epochs=2, batch_size=16, eval_batch_size=16, log_every_steps=1,
                checkpoint_every_steps=3, deterministic=True, ledger=True, threads_per_worker=1,
                augment_policy="randaugment", color_jitter=0.4, random_erasing=0.25, mixup=0.4, cutmix=1.0,
                model="timm:test_resnet")  # what is proved is the data's path, whatever the model: a quick one
STEPS = 7
COLOURS = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]


def photo(rng, c: int, i: int, size: int) -> Image.Image:
    """A JPEG-able photo a model can tell apart from other classes (its own colour and stripe),
    in one of several sizes."""
    h, w = size + (i % 3) * 4, size + (i % 2) * 6
    pixels = np.clip(rng.normal(COLOURS[c], 30, (h, w, 3)), 0, 255).astype(np.uint8)
    pixels[:, (c * w) // 4:(c * w) // 4 + 3] = 255
    return Image.fromarray(pixels)


def make_photos(root: Path, per_class: int, size: int = 40, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for c in range(len(COLOURS)):
        for i in range(per_class):
            path = root / f"class{c}" / f"{i:04d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            photo(rng, c, i, size).save(path, quality=90)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    make_photos(root / "src", per_class=40)
    manifest = prepare("folder", root / "data", root / "src", PrepareOptions(size=(32, 32), val_fraction=0.1))
    assert manifest["storage"] == "encoded" and manifest["preset"] == "photos"
    assert manifest["splits"]["train"]["num_samples"] == 112
    return root / "data"


def config(data, storage, name, **overrides) -> TrainConfig:
    return TrainConfig(data=str(data), storage=str(storage), name=name, **{**SETTINGS, **overrides})


@pytest.fixture(scope="module")
def reference(photos, tmp_path_factory) -> Path:
    """An uninterrupted run on the local backend (in this process, seconds): the global order
    every run must follow at any world size and on either backend, and the numbers a resumed
    local run must reproduce."""
    storage = tmp_path_factory.mktemp("ref")
    result = imgtrain.train(config(photos, storage, "ref", backend="local", workers=1), display=quiet_display())
    assert result.status == "finished"
    return result.path


@dataclasses.dataclass
class Grown:
    path: Path  # the run
    error: str  # the message of the failure past max_failures (`imgtrain train` prints "error: " and it)
    status_then: str  # status.json's status after it
    starts_then: list[tuple[int, int]]  # (step, epoch step) of each worker group until then
    resumed_output: str  # what the resuming call printed


@pytest.fixture(scope="module")
def grown(ray_cluster, photos, tmp_path_factory) -> Grown:
    """A streamed run on Ray, each rank's Ray Data pipeline started at the beginning and inside
    an epoch, at two world sizes. Two workers; rank 0 raises before global step 11 (epoch 1,
    mid-epoch) twice: Ray Train retries the worker group from the step checkpoint after step 9
    (max_failures=1), and the second time the run fails. The same request with one worker then
    resumes it from that checkpoint."""
    storage = tmp_path_factory.mktemp("grown")
    grow = config(photos, storage, "grow", max_failures=1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAULT_ENV, "raise:0:11:2")
        with pytest.raises(ImgtrainError) as failed:
            imgtrain.train(grow, display=quiet_display())
    run_dir = storage / "grow"
    starts = [(r["step"], r["epoch_step"]) for r in runs.read_metrics(run_dir) if r["kind"] == "start"]
    status = runs.read_status(run_dir)["status"]
    shown = io.StringIO()
    result = imgtrain.train(dataclasses.replace(grow, workers=1), display=TrainingDisplay(Console(file=shown, width=200)))
    assert result.status == "finished"
    return Grown(run_dir, str(failed.value), status, starts, shown.getvalue())


def history(run_dir: Path) -> list[tuple]:
    return [(r["epoch"], r["train_loss"], r["val_accuracy"], r["val_samples"]) for r in runs.epoch_history(run_dir)]


def test_ray_data_pipelines_stream_every_row_once_per_epoch(grown):
    batches = global_batches(grown.path)
    assert sorted(batches) == list(range(2 * STEPS))
    for epoch in range(2):
        ids = [i for s in range(epoch * STEPS, (epoch + 1) * STEPS) for i in batches[s]]
        assert len(ids) == len(set(ids)) == STEPS * 16  # none replayed, none skipped
    assert batches[0] != batches[STEPS]  # another order each epoch
    first = runs.epoch_history(grown.path)[0]
    assert first["val_split"] == "val"  # --val-fraction: training selects on val, test stays untouched
    assert first["world_size"] == 2 and first["val_samples"] == 16  # the validation split (4 x 4), every row once across both ranks
    assert (grown.path / "config.json").is_file()
    assert runs.load_run(str(grown.path.parent), "grow").status == "finished"


def test_an_exception_on_one_rank_is_retried_then_past_max_failures_the_run_fails_clearly(grown):
    assert (grown.path / ".faults" / "raise-0-11-2").is_file()  # the fault fired twice
    assert grown.starts_then == [(0, 0), (9, 2)]  # one retry, from the step checkpoint
    # one line: the root cause and where the run resumes from
    assert len(grown.error.splitlines()) == 1, grown.error
    assert grown.error.startswith("training failed: rank 0: InjectedFault"), grown.error
    assert "resumes from checkpoint_epoch_0001_step_0000009" in grown.error
    assert grown.status_then == "failed"


def test_a_streamed_run_resumes_exactly_with_another_world_size(grown, reference):
    assert "resuming run 'grow' at epoch 2, step 9" in grown.resumed_output
    committed = committed_batches(grown.path)
    assert {step: len(ranks) for step, ranks in committed.items()} == {s: 2 if s < 9 else 1 for s in range(2 * STEPS)}
    # one worker takes what two took, and what the local backend took: the same rows at every step
    assert global_batches(grown.path) == global_batches(reference)
    # every worker group's rows at every step, the retried and the failed ones included
    rows = global_batches(reference)
    for line in ledger_lines(grown.path):
        share = rank_share(SETTINGS["batch_size"], line["world_size"], line["rank"])
        assert line["ids"] == rows[line["step"]][share], (line["step"], line["rank"], line["world_size"])
    assert [r["epoch"] for r in runs.epoch_history(grown.path)] == [0, 1]


def test_a_streamed_run_resumed_inside_an_epoch_trains_what_an_uninterrupted_one_does(
        photos, tmp_path, reference, monkeypatch):
    # The local backend: the same readers, decoding and per-row augmentation as each Ray rank's
    # pipeline, only not in Ray tasks. The run fails before global step 11 (epoch 1, mid-epoch);
    # the same request resumes it from the step checkpoint after step 9.
    cut = config(photos, tmp_path, "cut", backend="local", workers=1)
    monkeypatch.setenv(FAULT_ENV, "raise:0:11")
    with pytest.raises(InjectedFault):
        imgtrain.train(cut, display=quiet_display())
    monkeypatch.delenv(FAULT_ENV)
    result = imgtrain.train(cut, display=quiet_display())

    assert result.status == "finished" and (result.path / ".faults" / "raise-0-11-1").is_file()
    assert [r["step"] for r in runs.read_metrics(result.path) if r["kind"] == "start"] == [0, 9]
    assert global_batches(result.path) == global_batches(reference)
    assert history(result.path) == history(reference)  # the same losses and accuracies, to the bit


def copies_of_photos(folder: Path, n: int, size: int, seed: int) -> None:
    """``n`` JPEG files in ``folder``'s class folders: the encoded bytes of 64 photos written
    again and again (each file is read and decoded on its own; making every one unique only
    took time)."""
    rng = np.random.default_rng(seed)
    pool = []
    for i in range(64):
        buffer = io.BytesIO()
        photo(rng, i % len(COLOURS), i, size).save(buffer, format="JPEG", quality=90)
        pool.append(buffer.getvalue())
    for i in range(n):
        path = folder / f"class{i % len(COLOURS)}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pool[i % len(pool)])


def test_predict_streams_a_large_folder_in_bounded_memory(tmp_path):
    # A model of 96x96 RGB photos; 3,000 128x128 photos would take 83 MB held as its input (more
    # decoded at their own size): predict's peak memory must not grow with the folder. Measured
    # here (anonymous memory, batches of 8): 1,000 -> 437-438 MB, 3,000 -> 439-440 MB (2,000 ->
    # 474 MB and 6,000 -> 478-481 MB on another day; the larger pair cost 8 CPU-seconds more).
    # Small batches: with 64 images a forward pass's activations come and go by about 100 MB, and
    # the 3 times longer run samples their top more often (once 2,000 -> 573 MB, 6,000 -> 622 MB).
    # A small model and one torch thread: the images are what is measured, and ResNet-18's
    # compute took 60 s of 6,000 here (230 s with two threads on a busy machine).
    src = tmp_path / "train-src"
    make_photos(src, per_class=10, size=96)
    prepare("folder", tmp_path / "data96", src, PrepareOptions(size=(96, 96)))
    cfg = TrainConfig(data=str(tmp_path / "data96"), storage=str(tmp_path / "runs"), name="m96", backend="local",
                      model="mobilenet_v3_small", epochs=1, batch_size=8, limit_train_batches=1, eval_batch_size=8,
                      threads_per_worker=1)
    imgtrain.train(cfg, display=quiet_display())
    peaks = {}
    for n in (1000, 3000):
        folder = tmp_path / f"in-{n}"
        copies_of_photos(folder, n, size=128, seed=n)
        peaks[n] = peak_rss_of(["predict", "m96", str(folder), "--out", str(tmp_path / f"p{n}.parquet"),
                                "--storage", str(tmp_path / "runs"), "--backend", "local", "--batch-size", "8",
                                "--threads", "1"])
    print("peak anonymous memory of predict (MB):", {n: round(p / 2**20) for n, p in peaks.items()})
    held = 3000 * 96 * 96 * 3
    assert peaks[3000] - peaks[1000] < held * 0.25, (peaks, held)  # far under what holding them would take
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "p3000.parquet")) == 3000
