"""What training selected on, said where it matters: `train` says which split picks the best
checkpoint (one line, and a warning when that is the test split), its last line names the
checkpoint and the split of its figure, and `evaluate` and the report show the figure training
recorded for the checkpoint (on its validation split) beside the test split's."""

from __future__ import annotations

import json

import pytest

from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from tests.conftest import cli_here, run_cli

pytestmark = pytest.mark.integration  # trains runs with and without a validation split

NO_VAL_NOTE = ("note: this data set has no val split, so training validates on, and picks the best checkpoint by, the "
               "test split: its test figure is optimistic; prepare the data set again with --val-fraction 0.1 to fix")


@pytest.fixture(scope="module")
def val_run(sample_raw, tmp_path_factory):
    """(the finished `train` command, the run): 2 epochs of 64 digits on the local backend, with a
    validation split of 50 beside the 50 test digits."""
    from imgtrain.data.raw import RawDataset, Split
    from imgtrain.data.writer import write_dataset

    def rows(split, start, stop):
        return Split(split.images[start:stop], split.labels[start:stop], split.ids[start:stop])

    root = tmp_path_factory.mktemp("val-run")
    train, test = sample_raw.train, sample_raw.test
    raw = RawDataset(sample_raw.classes, train=rows(train, 0, 64), val=rows(train, 64, 114), test=rows(test, 0, 50))
    write_dataset(raw, root / "data", name="with-val", source="mnist-sample")
    proc = run_cli("train", "--data", str(root / "data"), "--name", "withval", "--storage", str(root / "runs"),
                   "--backend", "local", "--epochs", "2", "--batch-size", "32", "--eval-batch-size", "50")
    assert proc.returncode == 0, proc.stderr
    return proc, runs.load_run(str(root / "runs"), "withval")


def best_meta(run) -> dict:
    return ckpt.read_meta(run.best_checkpoint)


def test_training_on_a_val_split_says_so_and_its_last_figure_is_the_best_checkpoints_on_it(val_run):
    proc, run = val_run
    out = proc.stdout
    assert "selecting the best checkpoint by val_accuracy on the val split (50 images); the test split is left for " \
           "`imgtrain evaluate`" in out
    meta = best_meta(run)
    assert meta["metrics"]["val_split"] == "val"
    assert (f"finished withval: best checkpoint epoch {meta['epoch'] + 1}, validation accuracy "
            f"{meta['metrics']['val_accuracy']:.2%}; run `imgtrain evaluate withval --storage {run.path.parent}` for "
            "the test split") in out
    assert "test accuracy" not in out and "no val split" not in out
    # calibration (issue 49): fitted on the val split when training ended, stored with the best checkpoint
    assert f"calibration of {run.best_checkpoint.name}: temperature T = " in out and "fitted on 50 val images" in out
    assert ckpt.CALIBRATION_FILE in ckpt.verify(run.best_checkpoint)["sha256"]


def test_training_without_a_val_split_says_so_in_one_line_and_calls_its_figure_no_test_result(tiny_data, tmp_path,
                                                                                              capsys):
    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--name", "noval", "--storage", str(tmp_path),
                    "--backend", "local", "--epochs", "1", "--limit-train-batches", "1", "--batch-size", "32")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines.count(NO_VAL_NOTE) == 1
    run = runs.load_run(str(tmp_path), "noval")
    accuracy = best_meta(run)["metrics"]["val_accuracy"]
    assert (f"finished noval: best checkpoint epoch 1, accuracy {accuracy:.2%} on the test split that chose it "
            "(no val split): optimistic, not a test result") in lines
    assert "test accuracy" not in proc.stdout


def test_evaluate_shows_the_validation_figure_recorded_for_the_checkpoint(val_run, capsys):
    _, run = val_run
    storage = str(run.path.parent)
    proc = cli_here(capsys, "evaluate", "withval", "--storage", storage, "--backend", "local", "--json")
    assert proc.returncode == 0, proc.stderr
    ev = json.loads(proc.stdout)
    recorded = best_meta(run)["metrics"]["val_accuracy"]
    assert ev["split"] == "test" and ev["num_samples"] == 50
    assert ev["recorded_val_accuracy"] == recorded and ev["recorded_split"] == "val"
    text = cli_here(capsys, "evaluate", "withval", "--storage", storage, "--backend", "local")
    assert f"on 50 samples (recorded in training on the val split: {recorded:.2%})" in text.stdout
    # evaluated on the split it was recorded on, it is that figure again
    again = json.loads(cli_here(capsys, "evaluate", "withval", "--storage", storage, "--backend", "local", "--split",
                                "val", "--json").stdout)
    assert again["accuracy"] == pytest.approx(recorded, abs=1e-9) and again["recorded_split"] == "val"


def test_evaluate_shows_the_recorded_figure_whichever_split_it_evaluates(local_run, capsys):
    proc = cli_here(capsys, "evaluate", str(local_run.path), "--split", "train", "--backend", "local", "--json")
    assert proc.returncode == 0, proc.stderr
    ev = json.loads(proc.stdout)
    assert ev["recorded_val_accuracy"] == best_meta(local_run)["metrics"]["val_accuracy"]
    assert ev["recorded_split"] == "test"  # the tiny data set has no validation split


def test_the_report_shows_the_validation_figure_recorded_for_the_checkpoint(val_run):
    from imgtrain.inference import report

    _, run = val_run
    page = report.write_report(str(run.path)).read_text()
    recorded = best_meta(run)["metrics"]["val_accuracy"]
    assert (f'<td class="text">accuracy recorded in training (val split)</td><td class="text">{recorded:.2%}</td>'
            in page)
