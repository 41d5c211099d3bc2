"""An export folder is untrusted input, as a checkpoint is: a shared one is anyone's to edit, and
the sha256 table its ``imgtrain.json`` holds is that file's own word. ``imgtrain.json`` is held
to meta.json's size cap and bounds before anything is sized by it, and every file the ONNX model
reads must lie inside the folder, whichever ONNX Runtime is installed. Each refusal is one line,
in well under a second; a real export, and one whose weights lie beside it, still load.

The hostile folders are copies of one real export (the session's digits run), edited as someone
who can write to the folder would: with the sha256 table rewritten to match."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from imgtrain.errors import ImgtrainError
from imgtrain.inference.export import export
from imgtrain.inference.export_record import EXPORT_META
from imgtrain.inference.export_formats.onnx import ONNX_FILE
from imgtrain.inference.predictor import Predictor, load_checkpoint
from imgtrain.ops.files import sha256_file as file_sha256
from tests.conftest import assert_one_line_error, cli_here

QUICK_S = 0.5  # the refusals read imgtrain.json (and parse model.onnx) and compare numbers


@pytest.fixture(scope="module")
def real_export(local_run, tmp_path_factory) -> Path:
    return export(local_run.path, "onnx", tmp_path_factory.mktemp("export") / "onnx").out


def load(folder):
    return load_checkpoint(folder, engine="onnxruntime")


def refused(call, *args) -> tuple[str, float]:
    """The one-line message of the ImgtrainError ``call(*args)`` raises, and how long it took."""
    start = time.perf_counter()
    with pytest.raises(ImgtrainError) as found:
        call(*args)
    seconds = time.perf_counter() - start
    message = str(found.value)
    assert len(message.splitlines()) == 1, message
    return message, seconds


def assert_names(message: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def hostile(real: Path, target: Path, change=None) -> Path:
    """A copy of the export whose imgtrain.json ``change`` edits."""
    shutil.copytree(real, target, symlinks=True)
    if change is not None:
        record = json.loads((target / EXPORT_META).read_text())
        change(record)
        (target / EXPORT_META).write_text(json.dumps(record))
    return target


def rehash(folder: Path, *names: str) -> None:
    """The sha256 table rewritten for the files named, as whoever edited them would."""
    record = json.loads((folder / EXPORT_META).read_text())
    record["sha256"].update({name: file_sha256(folder / name) for name in names})
    (folder / EXPORT_META).write_text(json.dumps(record))


def external_weights(folder: Path, location: str, data_file: Path, where: str = "initializer") -> None:
    """Rewrite ``folder``'s model.onnx so that one tensor's data is read from ``location``,
    whose bytes are written to ``data_file``: the largest initializer's, or (``where="constant"``)
    those of a Constant node added in front of the graph's output."""
    import onnx
    from onnx import helper

    model = onnx.load(folder / ONNX_FILE)
    if where == "initializer":
        tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    else:  # a Constant whose value is added to the probabilities: the tensor is read, its data used
        output = model.graph.output[0].name
        tensor = onnx.numpy_helper.from_array(np.zeros((1, 10), np.float32), "zeros")
        node = next(n for n in model.graph.node if output in n.output)
        node.output[list(node.output).index(output)] = "before_zeros"
        model.graph.node.extend([helper.make_node("Constant", [], ["zeros_value"], value=tensor),
                                 helper.make_node("Add", ["before_zeros", "zeros_value"], [output])])
        tensor = model.graph.node[-2].attribute[0].t
    data_file.parent.mkdir(parents=True, exist_ok=True)
    data_file.write_bytes(tensor.raw_data)
    onnx.external_data_helper.set_external_data(tensor, location=location, offset=0, length=len(tensor.raw_data))
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save(model, folder / ONNX_FILE)
    rehash(folder, ONNX_FILE)


def probabilities(folder: Path, images) -> np.ndarray:
    return Predictor(load(folder)).predict_proba(images)


# ---------------------------------------------------------------- the files an ONNX model reads


def test_weights_in_a_subfolder_of_the_export_load_and_are_checked_by_their_sha256(real_export, tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (4, 28, 28, 1), dtype=np.uint8)
    beside = hostile(real_export, tmp_path / "beside")
    external_weights(beside, "weights/model.onnx.data", beside / "weights" / "model.onnx.data")
    np.testing.assert_allclose(probabilities(beside, images), probabilities(real_export, images), atol=1e-6)
    rehash(beside, "weights/model.onnx.data")  # as an export of a large model records it
    with open(beside / "weights" / "model.onnx.data", "r+b") as f:  # one weight changed since
        f.seek(8)
        byte = f.read(1)
        f.seek(8)
        f.write(bytes([byte[0] ^ 1]))
    message, _ = refused(load, beside)
    assert_names(message, "weights/model.onnx.data", "does not match the sha256 its export recorded")


def test_an_export_whose_weights_lie_beside_its_model_records_their_sha256(local_run, tmp_path, monkeypatch):
    """A model over ONNX_ONE_FILE_MAX (1.5 GB of weights) is written with its weights beside
    model.onnx: the record holds their sha256 too, checked at every load as the model file's."""
    from imgtrain.inference.export_formats import onnx

    monkeypatch.setattr(onnx, "ONNX_ONE_FILE_MAX", 0)  # this 45-MB ResNet-18 written as a large one
    out = export(local_run.path, "onnx", tmp_path / "large").out
    recorded = json.loads((out / EXPORT_META).read_text())["sha256"]
    (data_file,) = set(recorded) - {ONNX_FILE}
    assert (out / data_file).stat().st_size > (out / ONNX_FILE).stat().st_size
    assert load(out).preprocess.image_shape == (28, 28, 1)
    with open(out / data_file, "r+b") as f:
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 1]))
    message, _ = refused(load, out)
    assert_names(message, f"{out / data_file} does not match the sha256 its export recorded")


@pytest.mark.parametrize("case, fragments", [
    ("parent", ["'../outside.bin'", "a path with '..'", "only files inside its folder"]),
    ("absolute", ["an absolute path", "only files inside its folder"]),
    ("link", ["'link.bin'", "a link that leads out of the export folder", "outside.bin"]),
    ("missing", ["'missing.bin'", "is missing"]),
    ("constant", ["'../outside.bin'", "a path with '..'"]),  # a node's tensor, not an initializer
])
def test_external_data_outside_the_export_folder_is_refused_before_onnx_runtime_opens_it(
        real_export, tmp_path, case, fragments):
    """ONNX Runtime 1.32 refuses some of these itself, with an error of its own; older versions
    read the file. imgtrain refuses every one, in its own words, whatever the version."""
    outside = tmp_path / "outside.bin"  # the data the tensor needs, so that a lax reader would load it
    folder = tmp_path / "export"
    hostile(real_export, folder)
    location = {"parent": "../outside.bin", "absolute": str(outside), "link": "link.bin", "missing": "missing.bin",
                "constant": "../outside.bin"}[case]
    external_weights(folder, location, outside if case != "missing" else tmp_path / "elsewhere.bin",
                     where="constant" if case == "constant" else "initializer")
    if case == "link":
        (folder / "link.bin").symlink_to(outside)
    message, seconds = refused(load, folder)
    assert_names(message, *fragments, "model.onnx's tensor")
    assert seconds < QUICK_S


def test_a_model_file_or_record_that_links_out_of_the_folder_is_refused(real_export, tmp_path, tiny_data, capsys):
    """A link in a shared folder to someone's own model elsewhere: its sha256 matches the table, and
    before, it loaded."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in (ONNX_FILE, EXPORT_META):
        folder = hostile(real_export, tmp_path / f"link-{name}")
        shutil.move(folder / name, elsewhere / name)
        (folder / name).symlink_to(elsewhere / name)
        message, _ = refused(load, folder)
        assert_names(message, f"{folder / name} is a link that leads out of the export folder", str(elsewhere / name))
    proc = cli_here(capsys, "predict", str(folder), str(tiny_data), "--engine", "onnxruntime", "--backend", "local",
                    "--out", str(tmp_path / "p.csv"))
    assert_one_line_error(proc, "a link that leads out of the export folder")
    inside = hostile(real_export, tmp_path / "inside")  # a link within the folder is the folder's own file
    shutil.move(inside / ONNX_FILE, inside / "model-v1.onnx")
    (inside / ONNX_FILE).symlink_to("model-v1.onnx")
    assert load(inside).preprocess.image_shape == (28, 28, 1)


def test_a_model_file_that_is_no_onnx_model_is_refused_in_one_line(real_export, tmp_path):
    folder = hostile(real_export, tmp_path / "garbage")
    (folder / ONNX_FILE).write_bytes(b"\xff" * 64)
    rehash(folder, ONNX_FILE)
    message, _ = refused(load, folder)
    assert_names(message, f"{folder / ONNX_FILE} is not an ONNX model")


# ---------------------------------------------------------------- imgtrain.json, held to meta.json's bounds


@pytest.mark.parametrize("change, fragments", [
    (lambda r: r["model_args"].pop("in_channels"), ["model_args: in_channels null out of range: 1 or 3"]),
    (lambda r: (r["model_args"].update(num_classes=100_001), r["data"].update(classes=["c"] * 100_001)),
     ["model_args: num_classes 100001 out of range: 2 to 100,000"]),
    (lambda r: r["data"].update(image_shape=[8000, 8000, 1]), ["data.image_shape [8000, 8000, 1]", "50,000,000"]),
    (lambda r: r.update(config="x"), ["config is not an object"]),
    (lambda r: r["config"].update(data=["s3://a", "s3://b"]), ['config.data ["s3://a", "s3://b"] is not a path']),
    (lambda r: r["config"].update(preset="sepia"), ["preset 'sepia' is not one of digits, photos"]),
], ids=["no-in_channels", "100001-classes", "8000x8000-images", "config-text", "config-data-list", "preset"])
def test_an_export_record_out_of_bounds_is_refused_in_one_line(real_export, tmp_path, change, fragments):
    folder = hostile(real_export, tmp_path / "export", change)
    message, seconds = refused(load, folder)
    assert_names(message, f"export {folder}: imgtrain.json", *fragments, "export the model again")
    assert seconds < QUICK_S
    assert load(real_export).preprocess.classes == tuple(str(d) for d in range(10))  # the real one loads


def test_a_record_too_large_to_be_one_is_refused_unread(real_export, tmp_path):
    folder = hostile(real_export, tmp_path / "big")
    with open(folder / EXPORT_META, "r+b") as f:
        f.truncate(65 << 20)  # sparse
    message, seconds = refused(load, folder)
    assert_names(message, str(folder / EXPORT_META), "68,157,440 bytes, over the 67,108,864 an imgtrain.json can be")
    assert seconds < QUICK_S


LOAD_UNDER_A_LIMIT = """
import json, resource, sys, time
limit = 6 << 30  # two billion class names would take some 100 GB: refused by the limit, not the machine
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import onnx, onnxruntime, torch, torchvision, imgtrain.models.zoo  # imported first: the refusal itself is timed
from imgtrain.inference.predictor import load_checkpoint
start = time.perf_counter()
try:
    load_checkpoint(sys.argv[1], engine="onnxruntime")
    out = {"type": None}
except BaseException as e:
    out = {"type": type(e).__name__, "imgtrain": isinstance(e, __import__("imgtrain.errors").errors.ImgtrainError),
           "message": str(e)}
out["seconds"] = time.perf_counter() - start
# VmHWM, this program's own peak (ru_maxrss would start at the pytest process's it was forked from)
out["peak_rss_mb"] = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024
print(json.dumps(out))
"""


def test_two_billion_classes_without_names_are_refused_before_any_name_is_made(real_export, tmp_path):
    """Before, preprocessing made one name per class ("0", "1", ...) ahead of every check: two
    billion of them, in a process held to 6 GiB here, a MemoryError after a minute."""
    folder = hostile(real_export, tmp_path / "evil",
                     lambda r: (r["model_args"].update(num_classes=2_000_000_000), r["data"].pop("classes")))
    proc = subprocess.run([sys.executable, "-c", LOAD_UNDER_A_LIMIT, str(folder)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["imgtrain"], out
    assert len(out["message"].splitlines()) == 1
    assert_names(out["message"], str(folder), "imgtrain.json model_args: num_classes 2000000000 out of range")
    assert out["seconds"] < QUICK_S, out


def test_serve_and_evaluate_hold_an_export_record_to_its_bounds(real_export, tmp_path, capsys):
    """serve reads the record for its preset before Ray starts: a config that is not an object
    was an AttributeError there. A recorded accuracy that is no number: evaluate shows none
    (it was a format error)."""
    folder = hostile(real_export, tmp_path / "config", lambda r: r.update(config="x"))
    assert_one_line_error(cli_here(capsys, "serve", str(folder), "--engine", "onnxruntime"),
                          "imgtrain.json config is not an object")
    folder = hostile(real_export, tmp_path / "metrics", lambda r: r["metrics"].update(val_accuracy="100%"))
    proc = cli_here(capsys, "evaluate", str(folder), "--engine", "onnxruntime", "--backend", "local")
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy" in proc.stdout and "recorded in training" not in proc.stdout
