"""The learning-rate range test (``imgtrain lr-find``, ``train --lr auto``, issue 50): the
suggestion rule on a known curve, the command's curve and plot, a model that diverges at once,
and a run that records what it chose and keeps it when resumed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from imgtrain.training import lr_find
from tests.conftest import assert_one_line_error, cli_here, quiet_display, tiny_config

SMALL = "timm:test_resnet"


def test_the_suggestion_is_the_steepest_descent_before_divergence():
    # a loss that falls fastest (per decade) at lr 1e-2, then rises past 4x its lowest
    lrs = list(np.logspace(-6, 1, 71))  # 0.1 decade a step
    loss = [2.3 - 2.0 / (1 + math.exp(-3 * (math.log10(lr) + 2))) + (50 * (lr - 0.3) if lr > 0.3 else 0)
            for lr in lrs]
    assert lr_find.suggest(lrs, loss) == pytest.approx(1e-2)  # the rise after it does not count
    smoothed = lr_find.smooth(loss)
    stop = next(i for i in range(1, len(lrs)) if lr_find.diverged(smoothed[:i + 1]))
    assert 0.3 < lrs[stop] < 10  # stopped by the rise, not before it
    # the smoothed curve's steepest point lags the raw one's by the average's window, as in fastai
    assert 1e-2 <= lr_find.suggest(lrs[:stop + 1], smoothed[:stop + 1]) <= 1e-1


def test_smoothing_is_the_bias_corrected_moving_average():
    assert lr_find.smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0 at the start
    assert lr_find.smooth([1.0, 3.0])[1] == pytest.approx((0.98 * 0.02 * 1 + 0.02 * 3) / (1 - 0.98 ** 2))


def test_a_loss_that_only_rises_has_no_suggestion():
    lrs = list(np.logspace(-7, 1, 40))
    assert lr_find.suggest(lrs, [1.0 + i for i in range(40)]) is None
    assert lr_find.suggest(lrs[:12], [1.0] * 12) is None  # too few points after the first 10


@pytest.mark.integration
def test_lr_find_writes_its_curve_and_plot_and_prints_the_suggestion(capsys, tiny_data, tmp_path):
    out = tmp_path / "curve"
    shown = cli_here(capsys, "lr-find", "--data", str(tiny_data), "--model", SMALL, "--backend", "local",
                     "--batch-size", "16", "--steps", "20", "--start-lr", "1e-4", "--out", str(out))
    assert shown.returncode == 0, shown.stderr
    line = shown.stdout.strip()
    assert line.startswith("suggested --lr ") and len(line.splitlines()) == 1, line
    rows = (tmp_path / "curve.csv").read_text().splitlines()
    assert rows[0] == "step,lr,loss,smoothed_loss" and 13 <= len(rows) - 1 <= 20
    lrs = [float(r.split(",")[1]) for r in rows[1:]]
    assert lrs[0] == pytest.approx(1e-4) and all(b > a for a, b in zip(lrs, lrs[1:]))  # the exponential ramp
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    suggested = float(line.split()[2])
    assert lrs[0] < suggested < lrs[-1]


@pytest.mark.integration
def test_a_model_that_diverges_at_once_is_said_in_one_line(capsys, tiny_data, tmp_path):
    # SGD from lr 50 up: the loss is not finite within the first steps, whatever the model
    shown = cli_here(capsys, "lr-find", "--data", str(tiny_data), "--model", SMALL, "--backend", "local",
                     "--batch-size", "32", "--optimizer", "sgd", "--start-lr", "50", "--end-lr", "100",
                     "--steps", "20", "--out", str(tmp_path / "curve"))
    assert_one_line_error(shown, "diverged at once", "--start-lr")


@pytest.mark.integration
def test_lr_auto_records_its_choice_and_a_resume_keeps_it(tiny_data, tmp_path):
    import imgtrain
    from imgtrain.config import AUTO_LR
    from imgtrain.storage import runs

    cfg = tiny_config(tiny_data, tmp_path, "auto", backend="local", workers=1, model=SMALL, epochs=1, lr="auto",
                      batch_size=8, limit_train_batches=2, bn_calibration=0)
    imgtrain.train(cfg, display=quiet_display())
    run_dir = tmp_path / "auto"
    chosen = json.loads((run_dir / "config.json").read_text())
    assert 0 < chosen["lr"] <= 10 and chosen["lr_source"].startswith("lr-find")
    found = [r for r in runs.read_metrics(run_dir) if r.get("kind") == "lr_find"]
    assert found and found[0]["lr"] == chosen["lr"] and found[0]["suggestion"] == pytest.approx(chosen["lr"], rel=0.05)
    assert (run_dir / "lr_find.png").is_file() and (run_dir / "lr_find.csv").is_file()
    curve_before = (run_dir / "lr_find.csv").read_bytes()
    epoch = [r for r in runs.read_metrics(run_dir) if r.get("kind") == "epoch"]
    assert epoch[-1]["lr"] <= chosen["lr"]  # the schedule's peak is the chosen LR

    # resumed with --lr auto again (and one more epoch): what it chose, not found again
    imgtrain.train(tiny_config(tiny_data, tmp_path, "auto", backend="local", workers=1, model=SMALL, epochs=2,
                               lr=AUTO_LR, batch_size=8, limit_train_batches=2, bn_calibration=0), display=quiet_display())
    again = json.loads((run_dir / "config.json").read_text())
    assert (again["lr"], again["lr_source"]) == (chosen["lr"], chosen["lr_source"])
    assert (run_dir / "lr_find.csv").read_bytes() == curve_before
    assert len([r for r in runs.read_metrics(run_dir) if r.get("kind") == "epoch"]) == 2


@pytest.mark.integration
def test_the_range_test_leaves_the_global_rng_as_it_found_it(tiny_data):
    import torch

    from imgtrain.config import TrainConfig
    from imgtrain.data.format import verify_dataset

    torch.manual_seed(123)
    before = torch.get_rng_state()
    cfg = TrainConfig(data=str(tiny_data), name="x", backend="local", workers=1, model=SMALL, batch_size=8)
    lr_find.range_test(cfg, verify_dataset(tiny_data), steps=13)
    assert torch.equal(torch.get_rng_state(), before)


def test_auto_is_read_from_flags_and_files_and_nothing_else_is(tmp_path):
    from imgtrain.config import TrainConfig, read_text, validate
    from imgtrain.configfile import read_config_file
    from imgtrain.errors import ImgtrainError

    assert read_text({"lr": "auto", "batch_size": "Auto", "epochs": 3}) == {"lr": "auto", "batch_size": "auto",
                                                                           "epochs": 3}
    assert read_text({"lr": "0.01", "batch_size": "64"}) == {"lr": 0.01, "batch_size": 64}
    (tmp_path / "run.toml").write_text('lr = "auto"\nbatch_size = "auto"\n')
    assert read_config_file(tmp_path / "run.toml") == ({"lr": "auto", "batch_size": "auto"}, [])
    validate(TrainConfig(name="x", lr="auto", batch_size="auto"))
    with pytest.raises(ImgtrainError, match="--batch-size must be at least 0, got -1; --lr 'fast' is not a number"):
        validate(TrainConfig(name="x", lr="fast", batch_size=-1))
