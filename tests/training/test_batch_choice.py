"""The global batch when the user sets none (``--batch-size 0``, the default): chosen from the
training split's size so a small data set gets enough optimizer steps and trains on all of
its rows (160 images at batch 128 were one step an epoch, 32 images left out, and diverged:
issue 46), recorded in config.json and kept by a resumed run; a batch the user set (a flag, a
config file, Python) is kept as given, with a warning when an epoch is only a few steps."""

from __future__ import annotations

import json
import warnings

import pytest

import imgtrain
from imgtrain.config import AUTO_MIN_STEPS, DEFAULT_BATCH, FEW_STEPS, auto_batch_size, steps_per_epoch
from imgtrain.errors import ImgtrainWarning
from tests.conftest import cli_here, quiet_display, subset, tiny_config

SMALL = dict(backend="local", workers=1, model="tinycnn_8", epochs=1, deterministic=True, bn_calibration=0)


@pytest.fixture(scope="module")
def data_160(tmp_path_factory, sample_raw):
    """160 training images, as in the report: 1 step of 128 an epoch, 32 left out."""
    from imgtrain.data.writer import write_dataset

    out = tmp_path_factory.mktemp("data") / "d160"
    write_dataset(subset(sample_raw, 160, 50), out, name="d160", source="mnist-sample")
    return out


def small_config(data, storage, name, **overrides):
    settings = {**tiny_config(data, storage, name, **SMALL).to_dict(), "batch_size": 0, **overrides}
    return imgtrain.TrainConfig(**settings)


def started(storage, name) -> dict:
    lines = [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in lines if r.get("kind") == "start")


def stored_batch(storage, name) -> int:
    return json.loads((storage / name / "config.json").read_text())["batch_size"]


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize("n, batch", [
    (100_000, 128), (4000, 128),  # the demo keeps the recipe's batch (31 steps)
    (1024, 128), (1023, 64), (1000, 64), (500, 32), (200, 16), (160, 16),
    (127, 18), (100, 16), (31, 31), (20, 20), (1, 1),  # below 8 steps of 16: equal steps
])
def test_the_default_batch_is_halved_until_an_epoch_has_enough_steps(n, batch):
    assert auto_batch_size(n) == batch


def test_the_chosen_batch_never_leaves_out_an_eighth_of_the_split():
    for n in range(1, 20_000):
        batch = auto_batch_size(n)
        steps = steps_per_epoch(n, batch)
        assert steps >= 1 and n % batch < n / 8, (n, batch)
        assert steps >= AUTO_MIN_STEPS or batch <= 2 * 16, (n, batch)  # only a tiny split has fewer steps
        assert batch <= DEFAULT_BATCH


def test_the_batch_holds_what_one_step_needs():
    """One sample per worker per --accumulate piece: 40 workers x 1 piece, 4 x 8."""
    assert auto_batch_size(160, 40) == 80 and auto_batch_size(500, 32) == 32 and auto_batch_size(5000, 200) == 200


# ---------------------------------------------------------------- a run


def test_a_small_split_trains_on_every_row_in_enough_steps_by_default(tiny_cnn, data_160, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImgtrainWarning)  # no few-steps warning for the chosen batch
        result = imgtrain.train(small_config(data_160, tmp_path, "auto"), display=quiet_display())
    start = started(tmp_path, "auto")
    assert start["steps_per_epoch"] == 10 and start["local_batch_sizes"] == [16]
    assert result.metrics["train_samples"].tolist() == [160]  # none left out
    assert stored_batch(tmp_path, "auto") == 16 == result.config["batch_size"]


def test_a_resumed_run_keeps_the_batch_it_began_with(tiny_cnn, data_160, tmp_path):
    """A run that began with batch 32 (set, or chosen by an older rule) resumed with the default:
    it trains on at 32, so the data order and the steps stay those of an uninterrupted run."""
    imgtrain.train(small_config(data_160, tmp_path, "kept", batch_size=32), display=quiet_display())
    result = imgtrain.train(small_config(data_160, tmp_path, "kept", epochs=2), display=quiet_display())
    assert result.status == "finished" and stored_batch(tmp_path, "kept") == 32
    assert result.metrics["step"].tolist() == [5, 10]


def test_a_batch_the_user_set_is_kept_with_a_warning_when_an_epoch_is_few_steps(tiny_cnn, data_160, tmp_path):
    with pytest.warns(ImgtrainWarning, match=r"an epoch is 1 optimizer step \(160 training samples, batch 128, "
                                             r"32 left out each epoch\)"):
        imgtrain.train(small_config(data_160, tmp_path, "python", batch_size=128), display=quiet_display())
    assert started(tmp_path, "python")["steps_per_epoch"] == 1 < FEW_STEPS


def test_a_config_file_setting_the_batch_counts_as_set(tiny_cnn, data_160, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("batch_size = 64\n")
    storage = tmp_path / "runs"
    proc = cli_here(capsys, "train", "--config", str(config), "--data", str(data_160), "--name", "file",
                    "--storage", str(storage), "--backend", "local", "--workers", "1", "--model", "tinycnn_8",
                    "--epochs", "1", "--bn-calibration", "0", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert stored_batch(storage, "file") == 64
    assert "warning: an epoch is 2 optimizer steps (160 training samples, batch 64, 32 left out" in proc.stderr
