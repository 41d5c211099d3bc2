"""Untrusted data sets and files, other people's folders, careless commands: each attack or
accident is reproduced with real files and must fail safely (one clear error, nothing of the
user's deleted, nothing executed). The server's share is in integration/test_serve.py."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import imgtrain
from imgtrain.commands.clean import plan_dataset, plan_runs, remove
from imgtrain.config import TrainConfig, validate
from imgtrain.data import format as parquet
from imgtrain.data import images
from imgtrain.data.dataset import ray_dataset
from imgtrain.data.idx import read_idx
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.data.sources.mnist import load_mnist_idx
from imgtrain.data.writer import write_dataset
from imgtrain.errors import ImgtrainError
from imgtrain.ops.files import atomic_write_text
from imgtrain.storage import ownership, runs
from imgtrain.training import tracking
from tests.conftest import assert_one_line_error, cli_here, copy_run, quiet_display
from tests.conftest_data_helpers import (
    read_back,
    read_inputs_whole,
    rehash,
    save_image,
    tiny_raw,
    write_idx,
)

QUIET = quiet_display()


class Payload:
    """Unpickling this creates ``path``: proof that code from a data file ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def pickled_column(n: int, proof: Path) -> pa.Array:
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray

    return ArrowPythonObjectArray.from_objects([Payload(proof)] * n)


@pytest.fixture
def poisoned(tmp_path) -> tuple[Path, Path]:
    """A prepared data set whose ``id`` column holds pickled objects (hashes updated to match,
    as an attacker would: the manifest's sha256 values are self-declared)."""
    data = tmp_path / "poisoned"
    write_dataset(tiny_raw(), data, name="poisoned", source="test")
    proof = tmp_path / "code-ran"
    path = data / "train" / "part-00000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(0, "id", pickled_column(table.num_rows, proof)), path)
    rehash(data)
    return data, proof


def test_a_pickled_column_in_a_data_set_is_refused_unread(poisoned):
    data, proof = poisoned
    with pytest.raises(ImgtrainError, match="part-00000.parquet has id extension<ray.data.arrow_pickled_object"):
        parquet.verify_dataset(data)
    with pytest.raises(ImgtrainError, match="not a file imgtrain wrote"):
        parquet.read_split(data, "train")  # the readers check again: verification may be skipped or raced
    with pytest.raises(ImgtrainError, match="not a file imgtrain wrote"):
        ray_dataset(data, "train")  # what every training worker would iterate over
    assert not proof.exists()


def test_a_data_set_with_an_extra_column_is_refused(tmp_path):
    data = tmp_path / "extra"
    write_dataset(tiny_raw(), data, name="extra", source="test")
    path = data / "test" / "part-00000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.append_column("note", pa.array(["x"] * table.num_rows)), path)
    rehash(data)
    with pytest.raises(ImgtrainError, match="has column\\(s\\) note besides id, image, label"):
        parquet.verify_dataset(data)


def test_user_parquet_with_a_pickled_column_is_refused_by_prepare_and_predict(tmp_path):
    proof = tmp_path / "code-ran"
    table = pa.table({
        "image": pa.array([[[0, 255], [255, 0]]] * 8, pa.list_(pa.list_(pa.uint8()))),
        "label": pickled_column(8, proof),
        "id": pickled_column(8, proof),
    })
    source = tmp_path / "table.parquet"
    pq.write_table(table, source)
    with pytest.raises(ImgtrainError, match="column 'label' has the Arrow extension type 'ray.data.arrow_pickled_object'"):
        prepare("parquet", tmp_path / "out", source)
    with pytest.raises(ImgtrainError, match="column 'id' has the Arrow extension type"):
        read_inputs_whole(str(source), (2, 2, 1))
    assert not proof.exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- other people's folders


def test_a_folder_that_is_not_a_run_is_never_written_into_listed_or_deleted(tiny_data, tmp_path):
    home = tmp_path / "home"
    model = home / "Documents"  # a Hugging Face model folder also has a config.json
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["ViT"], "name": "vit"}))
    (model / "notes.txt").write_text("mine")
    cfg = TrainConfig(data=str(tiny_data), storage=str(home), name="Documents", backend="local", epochs=1)
    with pytest.raises(ImgtrainError, match="is not an imgtrain run .*choose another --name or --storage"):
        imgtrain.train(cfg, display=QUIET)
    with pytest.raises(ImgtrainError, match="is not an imgtrain run"):
        imgtrain.train(cfg, display=QUIET, overwrite=True)
    assert runs.list_runs(str(home)) == []
    with pytest.raises(ImgtrainError, match="no run named 'Documents'"):
        plan_runs(str(home), ["Documents"])
    assert plan_runs(str(home), [], everything=True) == []
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "notes.txt"]


def config_of(run, storage, **overrides) -> TrainConfig:
    """The config ``run`` was trained with, for its copy in ``storage`` (what resumes it)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{**{k: v for k, v in run.config.items() if k in fields}, "storage": str(storage), **overrides})


def test_a_run_made_before_markers_is_still_a_run_and_gets_its_marker(local_run, tmp_path):
    copy_run(local_run, tmp_path)
    (tmp_path / local_run.name / ownership.MARKER_FILE).unlink()  # as an earlier imgtrain left it
    assert [r.name for r in runs.list_runs(str(tmp_path))] == [local_run.name]
    imgtrain.train(config_of(local_run, tmp_path), display=QUIET)  # "already complete": adopted all the same
    assert ownership.is_marked(tmp_path / local_run.name)


def test_overwrite_keeps_the_old_run_when_the_new_one_fails_before_its_first_checkpoint(local_run, tmp_path, monkeypatch):
    copy_run(local_run, tmp_path)
    cfg = config_of(local_run, tmp_path)
    first = runs.load_run(str(tmp_path), local_run.name)
    before = sorted(p.relative_to(tmp_path) for p in first.path.rglob("*"))
    # A tracker that cannot be reached fails the new run after the old one was moved aside.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    failing = TrainConfig(**{**cfg.to_dict(), "mlflow": "http://user:secret@127.0.0.1:9", "seed": 1})
    with pytest.raises(ImgtrainError, match="cannot log to MLflow at http://127.0.0.1:9"):
        imgtrain.train(failing, display=QUIET, overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in first.path.rglob("*")) == before
    assert runs.load_run(str(tmp_path), local_run.name).history == first.history
    assert [p.name for p in tmp_path.iterdir()] == [local_run.name]  # nothing left aside
    # The same with a good request (short: its first checkpoint is the point): the old run goes
    # once the new one has a checkpoint.
    good = TrainConfig(**{**cfg.to_dict(), "seed": 1, "epochs": 1, "limit_train_batches": 2})
    second = imgtrain.train(good, display=QUIET, overwrite=True)
    assert second.config["seed"] == 1 and [p.name for p in tmp_path.iterdir()] == [local_run.name]


def test_credentials_in_the_mlflow_uri_are_never_written_or_shown(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = TrainConfig(data=str(tiny_data), storage=str(tmp_path), name="cred", backend="local", epochs=1,
                      mlflow="http://alice:s3cret@127.0.0.1:9/mlflow")
    with pytest.raises(ImgtrainError) as failure:
        imgtrain.train(cfg, display=QUIET)
    assert "s3cret" not in str(failure.value) and "alice" not in str(failure.value)
    written = "".join(p.read_text() for p in (tmp_path / "cred").rglob("*.json"))
    assert "127.0.0.1:9/mlflow" in written and "s3cret" not in written and "alice" not in written
    assert tracking.public_uri("https://u:p@host:5000/x") == "https://host:5000/x"


# ---------------------------------------------------------------- data prepare --overwrite


def test_prepare_overwrite_replaces_only_its_own_files(tmp_path):
    out = tmp_path / "data"
    write_dataset(tiny_raw(), out, name="data", source="test")
    (out / "NOTES.md").write_text("my notes")
    (out / "raw").mkdir()
    (out / "raw" / "0.png").write_bytes(b"photo")
    with pytest.raises(ImgtrainError, match="holds 2 file\\(s\\) imgtrain did not write \\(NOTES.md, raw/0.png\\)"):
        write_dataset(tiny_raw(seed=1), out, name="data", source="test", overwrite=True)
    assert (out / "NOTES.md").read_text() == "my notes" and (out / "raw" / "0.png").read_bytes() == b"photo"
    parquet.verify_dataset(out)  # the old data set is untouched too


def test_prepare_refuses_a_source_inside_the_output(tmp_path):
    out = tmp_path / "data"
    write_dataset(tiny_raw(), out, name="data", source="test")
    photos = out / "photos"
    for c in ("a", "b"):
        for i in range(3):
            save_image(photos / c / f"{i}.png", 40 * i)
    with pytest.raises(ImgtrainError, match="overlap"):
        prepare("folder", out, photos, PrepareOptions(overwrite=True))
    with pytest.raises(ImgtrainError, match="overlap"):  # and an output inside the image folder
        prepare("folder", photos / "prepared", photos)
    assert len(list(photos.rglob("*.png"))) == 6


# ---------------------------------------------------------------- locks and atomic writes


def test_a_run_in_use_cannot_be_trained_or_deleted_by_another_process(local_run, tmp_path):
    copy_run(local_run, tmp_path)
    run_dir = tmp_path / local_run.name
    holder = subprocess.Popen(  # another process holds the run's lock, as a training driver does
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from imgtrain.storage import ownership\n"
         f"with ownership.locked(Path({str(run_dir)!r}), 'trained'):\n print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        more = config_of(local_run, tmp_path, epochs=3)
        with pytest.raises(ImgtrainError, match=f"'{local_run.name}' is being trained right now by process {holder.pid}"):
            imgtrain.train(more, display=QUIET)
        plan = plan_runs(str(tmp_path), [local_run.name])  # planned before the driver started...
        with pytest.raises(ImgtrainError, match="is being trained right now"):
            remove(plan[0])  # ...deleted after: the lock is checked again at the last moment
        assert (run_dir / "config.json").is_file()
    finally:
        holder.kill()
        holder.wait()
    remove(plan_runs(str(tmp_path), [local_run.name])[0])  # the lock died with its process
    assert not run_dir.exists()


def test_a_run_left_running_by_a_driver_on_another_host_needs_force(tmp_path, capsys):
    run_dir = tmp_path / "far"
    ownership.claim(run_dir)
    runs.write_config(run_dir, {"name": "far"})
    (run_dir / runs.STATUS_FILE).write_text(json.dumps({"status": "running", "pid": 1, "host": "elsewhere-7"}))
    with pytest.raises(ImgtrainError, match="on elsewhere-7; if that driver is gone, pass --force"):
        plan_runs(str(tmp_path), ["far"])
    proc = cli_here(capsys, "clean", "runs", "far", "--storage", str(tmp_path), "--yes", "--force")
    assert proc.returncode == 0, proc.stderr
    assert not run_dir.exists()


def test_concurrent_atomic_writes_never_collide_or_leave_temp_files(tmp_path):
    target, errors = tmp_path / "status.json", []

    def writer(k: int) -> None:
        try:
            for i in range(100):
                atomic_write_text(target, json.dumps({"writer": k, "i": i}))
        except OSError as e:  # a shared temp name: one writer's rename takes the other's file
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads(target.read_text())["i"] == 99
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_damaged_status_and_config_files_are_listed_and_cleanable(tmp_path, capsys):
    for name, damaged in (("a", "status.json"), ("b", "config.json")):
        ownership.claim(tmp_path / name)
        runs.write_config(tmp_path / name, {"name": name})
        (tmp_path / name / damaged).write_text("{not json")
    listed = {r.name: r.status for r in runs.list_runs(str(tmp_path))}
    assert listed == {"a": "damaged", "b": "damaged"}
    proc = cli_here(capsys, "runs", "list", "--storage", str(tmp_path))
    assert proc.returncode == 0 and "damaged" in proc.stdout, proc.stderr
    for removal in plan_runs(str(tmp_path), [], everything=True):
        remove(removal)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- untrusted input files


def test_idx_labels_must_be_integers_with_a_sane_class_count(tmp_path):
    images8 = np.zeros((4, 3, 3), np.uint8)
    for name, labels in (("big", np.array([0, 1, 2, 20_000_000], ">i4")), ("float", np.array([0, 1, np.nan, 1], ">f4"))):
        folder = tmp_path / name
        for split in ("train", "t10k"):
            write_idx(folder / f"{split}-images-idx3-ubyte", images8)
            path = folder / f"{split}-labels-idx1-ubyte"
            raw = bytes([0, 0, 0x0D if labels.dtype.kind == "f" else 0x0C, 1]) + np.asarray([4], ">u4").tobytes()
            path.write_bytes(raw + labels.tobytes())
    with pytest.raises(ImgtrainError, match="20,000,001 classes, more than the 100,000"):
        load_mnist_idx(tmp_path / "big")
    with pytest.raises(ImgtrainError, match="labels must be integers"):
        load_mnist_idx(tmp_path / "float")


def test_a_gzip_bomb_idx_header_is_refused_before_decompressing(tmp_path):
    # A header that declares 10^5 images of 1000x1000: 100 GB from a file of a few hundred bytes.
    header = bytes([0, 0, 0x08, 3]) + np.asarray([100_000, 1000, 1000], ">u4").tobytes()
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(header + bytes(10_000)))
    with pytest.raises(ImgtrainError, match="more than the file can hold"):
        read_idx(path)


def sixteen_bit_ramp(path: Path) -> Path:
    ramp = np.linspace(0, 65535, 64 * 64).astype(np.uint16).reshape(64, 64)
    Image.fromarray(ramp).save(path)  # mode I;16
    return path


def test_sixteen_bit_png_is_scaled_not_saturated_everywhere(tmp_path):
    folder = tmp_path / "photos"
    for c in ("a", "b"):
        folder.joinpath(c).mkdir(parents=True)
        for i in range(3):
            sixteen_bit_ramp(folder / c / f"{i}.png")
    prepare("folder", tmp_path / "data", folder)
    stored = read_back(tmp_path / "data")["train"][2]
    assert abs(stored.mean() - 127.5) < 2  # convert("L") alone gave ~254
    predicted = read_inputs_whole(str(folder), (64, 64, 1))
    assert abs(predicted["image"].mean() - 127.5) < 2
    with images.open_image(sixteen_bit_ramp(tmp_path / "one.png")) as im:
        assert abs(images.conform_image(im, (64, 64, 1))[0].mean() - 127.5) < 2  # what the server does


def test_only_png_and_jpeg_are_decoded_and_huge_images_are_refused(tmp_path):
    gif = tmp_path / "in" / "a" / "disguised.png"
    gif.parent.mkdir(parents=True)
    Image.new("L", (8, 8), 9).save(gif, format="GIF")
    save_image(tmp_path / "in" / "a" / "ok.png", 9)
    huge = tmp_path / "in" / "a" / "huge.png"
    Image.new("L", (8000, 8000)).save(huge)  # 64 MP, a few hundred KB
    found = read_inputs_whole(str(tmp_path / "in"), (8, 8, 1))
    reasons = dict(zip(found["path"], found["_error"]))
    assert [p for p, why in reasons.items() if not why] == [str(tmp_path / "in" / "a" / "ok.png")]
    assert "not a PNG or JPEG" in reasons[str(gif)] and "over the limit" in reasons[str(huge)]
    assert images.check_image(gif.read_bytes(), None).reason == "not a PNG or JPEG image"  # data prepare's check


def test_predict_glob_does_not_follow_a_symlink_loop(tmp_path):
    folder = tmp_path / "loop" / "a"
    save_image(folder / "x.png", 3)
    for i in range(4):  # several links to the parent: glob.glob(recursive=True) walked in circles
        (folder / f"back{i}").symlink_to("..", target_is_directory=True)
    code = f"from imgtrain.inference.inputs import list_inputs; print(list_inputs({str(tmp_path / 'loop' / '**' / '*.png')!r}).total)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr


def test_clean_data_never_deletes_through_a_linked_split_folder(tmp_path, capsys):
    data = tmp_path / "data"
    write_dataset(tiny_raw(), data, name="data", source="test")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(data / "train", elsewhere)
    (data / "train").symlink_to(elsewhere, target_is_directory=True)
    before = sorted(elsewhere.iterdir())
    with pytest.raises(ImgtrainError, match="lies outside the data set"):
        plan_dataset(data)
    proc = cli_here(capsys, "clean", "data", str(data), "--yes")
    assert proc.returncode == 2 and "lies outside the data set" in proc.stderr
    assert sorted(elsewhere.iterdir()) == before and before


# ---------------------------------------------------------------- configuration values


def test_every_float_must_be_finite_and_every_field_in_range_all_reported_at_once():
    cfg = TrainConfig(name="x", lr=float("inf"), weight_decay=float("nan"), stall_timeout_s=float("nan"),
                      cpus_per_worker=float("inf"), epochs=2**63 - 1, max_rotate_deg=400, max_shift=-0.1,
                      max_scale=1.0)
    with pytest.raises(ImgtrainError) as found:
        validate(cfg)
    message = str(found.value)
    for expected in ("--lr must be a finite number", "--weight-decay must be a finite number",
                     "--stall-timeout must be a finite number", "--cpus-per-worker must be a finite number",
                     "--epochs must be at most 100000", "--max-rotate-deg must be at most 180",
                     "--max-shift must be at least 0", "--max-scale must be below 1"):
        assert expected in message, (expected, message)


def test_logs_without_a_run_go_to_a_folder_of_this_users_own(tmp_path, monkeypatch):
    from imgtrain.cluster import user_log_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = user_log_dir()
    assert folder == tmp_path / "cache" / "imgtrain" / "logs" and folder.is_dir()
    assert folder.stat().st_uid == os.getuid()


def test_a_checkpoint_claiming_a_huge_model_is_refused_before_building_it(tmp_path):
    from imgtrain.storage import checkpoint as ckpt
    from imgtrain.inference.predictor import load_checkpoint

    args = {"architecture": "resnet18", "in_channels": 1, "num_classes": 10**9}  # a 2-TB output layer
    ckpt.save(tmp_path / "ck", {}, {}, {"model_args": args, "data": {"classes": ["a"]}})
    with pytest.raises(ImgtrainError, match="holds a model imgtrain cannot build"):
        load_checkpoint(tmp_path / "ck")


def test_text_from_a_runs_files_reaches_the_terminal_as_text(tmp_path, capsys):
    hostile = "\x1b[2J\x1b]0;owned\x07\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\\u202eevil"
    run = tmp_path / "r"
    ownership.claim(run)
    runs.write_config(run, {"name": "r", "data": hostile, "model": hostile, "epochs": 1})
    runs.write_status(run, "failed", error=hostile)
    good = {"kind": "epoch", "epoch": 0, "step": 1, "train_loss": 0.5, "train_accuracy": 0.5, "val_loss": 0.5,
            "val_accuracy": 0.5, "images_per_s": 10.0, "epoch_time_s": 1.0, "checkpoint": hostile}
    damaged = {"kind": "epoch", "epoch": "1", "val_accuracy": hostile}  # skipped, as a line cut short is
    (run / runs.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in (good, damaged, [hostile])))
    for args in (("runs", "show", "r"), ("runs", "list"), ("config", "show", "--run", "r")):
        shown = cli_here(capsys, *args, "--storage", str(tmp_path))
        assert shown.returncode == 0, shown.stderr
        printed = shown.stdout + shown.stderr
        assert "\x1b" not in printed and "\x07" not in printed and "\u202e" not in printed, (args, printed)
    shown = cli_here(capsys, "runs", "show", "r", "--storage", str(tmp_path)).stdout
    assert "\\x1b[2J" in shown and "epoch   1/1" in shown  # shown, escaped; the well-formed epoch only
    refused = cli_here(capsys, "runs", "show", "no\x1b[2Jsuch", "--storage", str(tmp_path))
    assert refused.returncode == 2 and "\x1b" not in refused.stderr


def test_an_s3_location_with_a_key_and_secret_is_refused_without_showing_them(tmp_path, capsys):
    proc = cli_here(capsys, "runs", "list", "--storage", "s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/runs?region=x")
    err = assert_one_line_error(proc, "s3://bucket/runs: write an S3 location as s3://bucket/prefix")
    assert "AKIAEXAMPLE" not in err and "wJalrXUtnFEMI" not in err
