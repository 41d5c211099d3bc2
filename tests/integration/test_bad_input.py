"""Bad input: one clear line on stderr, a non-zero exit, no traceback, no hang. Refusals that
come before anything trains run the real CLI in this process (``cli_here``); the two that must
fail in seconds from a cold start, Python's imports included, run it as a new process."""

from __future__ import annotations

import json
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import assert_one_line_error, cli_here, run_cli
from tests.conftest_data_helpers import rehash, rewrite_columns

@pytest.fixture
def data_copy(tiny_data, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(tiny_data, copy)
    return copy


def train_args(data, tmp_path, *extra):
    return ("train", "--data", str(data), "--name", "bad", "--storage", str(tmp_path / "runs"), *extra)


def first_file(data, split="train"):
    manifest = json.loads((data / "manifest.json").read_text())
    return data / manifest["splits"][split]["files"][0]


def test_directory_that_is_not_a_data_set(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    proc = cli_here(capsys, *train_args(tmp_path / "empty", tmp_path))
    assert_one_line_error(proc, "not a prepared data set", "imgtrain data prepare")


def test_a_folder_of_photos_given_as_data_is_told_how_to_prepare_it(tmp_path, capsys, monkeypatch):
    """It was told to prepare mnist-sample, whatever it held."""
    from PIL import Image

    for name in ("cat", "dog"):
        (tmp_path / "photos" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8), name == "cat" and "red" or "blue").save(tmp_path / "photos" / name / "1.jpg")
    monkeypatch.chdir(tmp_path)
    err = assert_one_line_error(cli_here(capsys, "train", "--data", "./photos", "--name", "x"),
                                "not a prepared data set",
                                f"imgtrain data prepare folder {tmp_path / 'photos-prepared'} --source "
                                f"{tmp_path / 'photos'}", f"--data {tmp_path / 'photos-prepared'}")
    assert "mnist" not in err
    err = assert_one_line_error(cli_here(capsys, "train", "--data", "./nope", "--name", "x"), "does not exist",
                                "imgtrain data prepare folder DIR --source PHOTOS")
    assert "mnist-sample, mnist, folder, parquet, list, webdataset, hf" in err


def test_corrupt_parquet_is_named(data_copy, tmp_path, capsys):
    path = first_file(data_copy)
    path.write_bytes(path.read_bytes()[:100])
    rehash(data_copy)  # a file damaged before hashing: the Parquet reader must catch it
    proc = cli_here(capsys, *train_args(data_copy, tmp_path))
    assert_one_line_error(proc, path.name)


def test_tampered_file_fails_its_checksum(data_copy, tmp_path, capsys):
    path = first_file(data_copy)
    with open(path, "r+b") as f:
        f.seek(50)
        f.write(b"\xff\xfe")
    assert_one_line_error(cli_here(capsys, *train_args(data_copy, tmp_path)), path.name, "sha256")


def test_missing_column(data_copy, tmp_path, capsys):
    path = first_file(data_copy)
    rewrite_columns(path, label=None)
    rehash(data_copy)
    assert_one_line_error(cli_here(capsys, *train_args(data_copy, tmp_path)), path.name, "label")


def test_label_outside_the_class_range(data_copy, tmp_path, capsys):
    path = first_file(data_copy, "test")
    labels = pq.read_table(path)["label"].to_numpy().copy()
    labels[0] = 10
    rewrite_columns(path, label=pa.array(labels))
    rehash(data_copy)
    assert_one_line_error(cli_here(capsys, *train_args(data_copy, tmp_path)), "label 10")


def test_empty_split(data_copy, tmp_path, capsys):
    manifest = json.loads((data_copy / "manifest.json").read_text())
    manifest["splits"]["test"] = {"num_samples": 0, "files": []}
    (data_copy / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(cli_here(capsys, *train_args(data_copy, tmp_path)), "empty")


def test_global_batch_smaller_than_workers(tiny_data, tmp_path, capsys):
    proc = cli_here(capsys, *train_args(tiny_data, tmp_path, "--batch-size", "1", "--workers", "2"))
    assert_one_line_error(proc, "--batch-size 1 is smaller than --workers 2")


def test_unknown_option(tiny_data, tmp_path, capsys):
    proc = cli_here(capsys, *train_args(tiny_data, tmp_path, "--frobnicate"))
    assert_one_line_error(proc, "no such option: --frobnicate", "imgtrain train --help")


def test_a_flag_typo_is_one_line_offering_the_closest_flag(capsys):
    """click printed its usage, a hint and the error on four lines, and listed three options."""
    proc = cli_here(capsys, "train", "--epoch", "3")
    assert_one_line_error(proc, "no such option: --epoch; did you mean --epochs?")
    assert_one_line_error(cli_here(capsys, "data", "prepare", "folder"), "missing argument 'out_dir'")


def test_a_group_named_alone_still_shows_its_help(capsys):
    proc = cli_here(capsys, "data")
    assert "prepare" in proc.stdout + proc.stderr and "error:" not in proc.stdout + proc.stderr


def test_unwritable_storage(tiny_data, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--name", "x", "--storage", str(blocker / "runs"))
    assert_one_line_error(proc, "cannot write to storage", "--storage")


@pytest.mark.parametrize("extra,fragments", [
    (("--gpu",), ("GPU worker(s)", "0 GPU(s)", "--cpu")),
    (("--workers", "8"), ("8 worker(s)", "the Ray cluster has 4", "fewer --workers")),
])
@pytest.mark.integration
def test_impossible_requests_fail_in_seconds_not_forever(ray_cluster, tiny_data, tmp_path, extra, fragments):
    # Plain Ray Train waits forever for these placements; imgtrain refuses them at once.
    # The guarantee is 15 s from the command's start, Python and torch imports included.
    start = time.monotonic()
    proc = run_cli(*train_args(tiny_data, tmp_path, "--address", ray_cluster, *extra), timeout=15)
    assert_one_line_error(proc, *fragments)
    assert time.monotonic() - start < 15


def test_unknown_run(tmp_path, capsys):
    proc = cli_here(capsys, "runs", "show", "nope", "--storage", str(tmp_path))
    assert_one_line_error(proc, "no run named 'nope'")


def test_a_cluster_address_where_nothing_answers_fails_in_seconds(tiny_data, tmp_path, capsys):
    # ray.init waits for minutes at such an address; imgtrain finds out with a TCP connect first.
    start = time.monotonic()
    proc = cli_here(capsys, *train_args(tiny_data, tmp_path, "--address", "127.0.0.1:1"))
    assert_one_line_error(proc, "cannot reach the Ray cluster at 127.0.0.1:1", "ray start --head")
    assert time.monotonic() - start < 20
    assert not (tmp_path / "runs").exists()  # no run directory left behind for nothing


def test_a_config_file_with_several_problems_names_them_all(tiny_data, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(f'data = "{tiny_data}"\nepoch = 3\nlr = "fast"\nworkers = 0\n')
    proc = cli_here(capsys, "train", "--config", str(config), "--name", "bad", "--storage", str(tmp_path / "runs"))
    assert_one_line_error(proc, "unknown field 'epoch' (did you mean 'epochs'?)", "lr must be a number, got 'fast'",
                          "--workers must be at least 1")
    assert not (tmp_path / "runs").exists()
    # A flag fixes what the file got wrong: the flag wins.
    fixed = tmp_path / "fixed.toml"
    fixed.write_text(f'data = "{tiny_data}"\nworkers = 0\n')
    proc = cli_here(capsys, "train", "--config", str(fixed), "--name", "bad", "--storage", str(tmp_path / "runs"),
                   "--workers", "1", "--batch-size", "-1")
    assert_one_line_error(proc, "--batch-size must be at least 0, got -1")
    assert "--workers" not in proc.stderr
