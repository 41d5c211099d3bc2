"""Sizes read from untrusted metadata: a data set's manifest.json and a
checkpoint's meta.json (which no sha256 table covers) declare the numbers readers size their
allocations and loops by. Each one beyond its bound is refused where the file is read, in well
under a second, with one line naming the file, the field, the value and the bound; a real data
set and a real checkpoint still load. Nothing here allocates what the files claim: the one
reader that would (a ViT of 65,536 px) runs in a subprocess under a memory limit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from imgtrain.checkpoint_policy import POLICY
from imgtrain.commands import doctor
from imgtrain.data import format as fmt
from imgtrain.data import stream
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.errors import ImgtrainError
from imgtrain.models import zoo
from imgtrain.storage import checkpoint as ckpt
from tests.conftest_data_helpers import save_image

QUICK_S = 0.5  # "well under a second": the refusals read one small file and compare numbers


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


# ---------------------------------------------------------------------------- data sets


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """A real prepared data set of encoded 16x16 RGB photos (2 classes, 32 train / 8 test rows):
    the storage whose image_shape (the training resolution) no file's schema can contradict."""
    root = tmp_path_factory.mktemp("photos")
    for c, base in (("a", 0), ("b", 100)):
        for i in range(20):
            save_image(root / "src" / c / f"{i}.png", base + 5 * i, size=(16, 16), mode="RGB")
    prepare("folder", root / "data", root / "src", PrepareOptions(seed=3, val_fraction=0))  # train and test only
    return root / "data"


@pytest.fixture
def data(photos, tmp_path) -> Path:
    """A copy of the real data set, verified as it is, for one test to damage."""
    copy = tmp_path / "data"
    shutil.copytree(photos, copy)
    assert fmt.verify_dataset(copy)["image_shape"] == [16, 16, 3]
    return copy


def edit_manifest(data_dir: Path, change) -> None:
    path = data_dir / fmt.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def readers(data_dir: Path):
    """Every way a manifest is read: the structural check, ``verify_dataset`` (train, evaluate,
    sweep) and ``doctor``'s data check, which must report the data set as bad too."""
    def doctor_check():
        check = doctor._data(str(data_dir))
        if check.status == doctor.FAIL:
            raise ImgtrainError(check.detail)

    return [(fmt.load_manifest, data_dir), (fmt.verify_dataset, data_dir), (doctor_check,)]


@pytest.mark.parametrize("change, fragments", [
    # a training resolution of 50,000 px: `train` tried to allocate 224 GiB for one row group
    (lambda m: m.update(image_shape=[50000, 50000, 3]), ["image_shape [50000, 50000, 3]", "8192 px a side"]),
    # sides within the bound, pixels not: 67 MP, more than any image imgtrain decodes
    (lambda m: m.update(image_shape=[8192, 8192, 3]), ["image_shape [8192, 8192, 3]", "50,000,000 pixels"]),
    # listed row groups of 10^9 rows: `train` tried 7.5 GiB for the epoch's permutation alone
    (lambda m: m["splits"]["train"].update(row_groups=[[10**9]]),
     ["splits.train.row_groups", "1000000000 rows", "outside 1 to 1,024"]),
    (lambda m: m.update(num_classes=10**9), ["num_classes 1000000000", "1 and 100,000"]),
    (lambda m: m.update(channels=5, image_shape=[16, 16, 5]), ["channels 5 is not 1 or 3"]),
    (lambda m: m["normalize"].update(std=[0, 0.5, 0.5]), ["normalize", "std in (0, 1]"]),
], ids=["huge-side", "too-many-pixels", "huge-row-group", "huge-class-count", "channels", "zero-std"])
def test_a_manifest_size_beyond_its_bound_is_refused_at_once_by_every_reader(data, change, fragments):
    edit_manifest(data, change)
    for call, *args in readers(data):
        message, seconds = refused(call, *args)
        assert_names(message, str(data / fmt.MANIFEST), *fragments, "prepare the data set again")
        assert seconds < QUICK_S, (call, seconds)


def test_every_problem_of_a_manifest_is_reported_together(data):
    def damage(m):
        m.update(image_shape=[65536, 16, 3], num_classes=200_000)
        m["splits"]["test"]["row_groups"] = [[0]]

    edit_manifest(data, damage)
    message, _ = refused(fmt.load_manifest, data)
    assert_names(message, "image_shape [65536, 16, 3]", "num_classes 200000", "splits.test.row_groups")


def test_row_counts_must_agree_with_the_parquet_footers(data):
    groups = fmt.load_manifest(data)["splits"]["train"]["row_groups"]
    assert groups == [[32]]  # the footer's: one row group
    edit_manifest(data, lambda m: m["splits"]["train"].update(row_groups=[[31, 1]]))  # same total
    fmt.load_manifest(data)  # within every bound: only the files can tell
    message, seconds = refused(fmt.verify_dataset, data)
    assert_names(message, str(data / fmt.MANIFEST), "splits.train.row_groups", "[31, 1]", "footer says [32]")
    assert seconds < QUICK_S
    # predict and report plan a data set's row groups without verifying it first
    message, _ = refused(stream.blocks, data, fmt.load_manifest(data), "train")
    assert_names(message, "splits.train.row_groups", "footer says [32]")


def test_a_manifest_too_large_to_be_one_is_refused_unread(data):
    with open(data / fmt.MANIFEST, "r+b") as f:
        f.truncate(65 << 20)  # sparse: nothing written, nothing to read
    message, seconds = refused(fmt.load_manifest, data)
    assert_names(message, str(data / fmt.MANIFEST), "68,157,440 bytes, over the 67,108,864 a manifest can be")
    assert seconds < QUICK_S


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint as training writes it: a ResNet-18 with the small stem for 8x8 digits
    (so model_args carries an image_size), its weights, and meta.json's data summary."""
    import torch

    manifest = {"channels": 1, "num_classes": 4, "image_shape": [8, 8, 1], "classes": ["a", "b", "c", "d"],
                "normalize": {"mean": [0.5], "std": [0.5]}, "preset": "digits"}
    args = zoo.model_args(manifest, "resnet18", "small")
    assert args["image_size"] == [8, 8]
    model = zoo.build_from_args(args)
    path = tmp_path_factory.mktemp("run") / POLICY.epoch_name(0)
    state = {ckpt.EPOCH_KEY: 0, ckpt.STEP_KEY: 1, ckpt.RNG_KEY: {"torch": torch.get_rng_state()}}
    ckpt.save(path, model.state_dict(), state, {"model_args": args, "data": manifest, "config": {}, "epoch": 0,
                                                "step": 1, "metrics": {"val_accuracy": 0.5}})
    return path


def tampered(real: Path, target: Path, change) -> Path:
    """A copy of ``real`` whose meta.json ``change`` edits (its sha256 table still matches)."""
    shutil.copytree(real, target)
    meta = json.loads((target / ckpt.META_FILE).read_text())
    change(meta)
    (target / ckpt.META_FILE).write_text(json.dumps(meta))
    return target


VIT_65536 = {"architecture": "vit_b_16", "in_channels": 1, "num_classes": 4, "stem": "standard",
             "image_size": [65536, 65536]}  # position embeddings of 4096^2 x 768 floats: 51.5 GB

LOAD_UNDER_A_LIMIT = """
import json, resource, sys, time
limit = 8 << 30  # a 51-GB allocation fails at once instead of thrashing the machine
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import torch, torchvision, imgtrain.models.zoo  # imported first: the refusal itself is timed
from imgtrain.inference.predictor import load_checkpoint
start = time.perf_counter()
try:
    load_checkpoint(sys.argv[1])
    out = {"type": None}
except BaseException as e:
    out = {"type": type(e).__name__, "imgtrain": isinstance(e, __import__("imgtrain.errors").errors.ImgtrainError),
           "message": str(e)}
out["seconds"] = time.perf_counter() - start
print(json.dumps(out))
"""


def test_a_vit_checkpoint_claiming_65536_px_images_is_refused_before_any_model_is_built(real_checkpoint, tmp_path):
    from imgtrain.inference.predictor import load_checkpoint

    assert load_checkpoint(real_checkpoint).preprocess.image_shape == (8, 8, 1)  # the real one loads
    evil = tampered(real_checkpoint, tmp_path / "evil", lambda m: m.update(model_args=VIT_65536))
    proc = subprocess.run([sys.executable, "-c", LOAD_UNDER_A_LIMIT, str(evil)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["imgtrain"], out  # before: RuntimeError "you tried to allocate 51539610624 bytes"
    assert len(out["message"].splitlines()) == 1
    assert_names(out["message"], str(evil / ckpt.META_FILE), "model_args", "image_size [65536, 65536]",
                 "8192 px a side", "use another checkpoint")
    assert out["seconds"] < QUICK_S, out


def test_a_checkpoint_with_model_args_out_of_bounds_is_passed_over_like_a_damaged_one(real_checkpoint, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(real_checkpoint, run / real_checkpoint.name)
    evil = tampered(real_checkpoint, run / POLICY.epoch_name(1),
                    lambda m: m.update(model_args=VIT_65536, epoch=1, step=2, metrics={"val_accuracy": 0.9}))
    message, seconds = refused(ckpt.verify, evil)
    assert_names(message, str(evil / ckpt.META_FILE), "image_size [65536, 65536]", "8192")
    assert seconds < QUICK_S
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.choose(run, "best", "run") == run / real_checkpoint.name
    assert any(issubclass(w.category, ckpt.DamagedCheckpointWarning) and "image_size" in str(w.message)
               for w in caught)


@pytest.mark.parametrize("change, fragments", [
    # a ResNet ignores image_size, so these built before: bounded all the same, as a data set's shape
    ({"stem": "small", "image_size": [65536, 65536]}, ["image_size [65536, 65536]", "8192 px a side"]),
    ({"stem": "small", "image_size": [8192, 8192]}, ["image_size [8192, 8192]", "50,000,000 pixels"]),
    ({"in_channels": True}, ["in_channels true", "1 or 3"]),
    ({"num_classes": 100_001}, ["num_classes 100001", "2 to 100,000"]),
    ({"num_classes": 10**9, "stem": "tiny", "image_size": [0, 8]},  # every problem at once
     ["num_classes 1000000000", "stem 'tiny'", "image_size [0, 8]"]),
])
def test_model_args_beyond_their_bounds_are_refused_before_building(change, fragments):
    args = {"architecture": "resnet18", "in_channels": 1, "num_classes": 4, "stem": "standard", **change}
    start = time.perf_counter()
    with pytest.raises(ValueError) as found:
        zoo.build_from_args(args)
    assert time.perf_counter() - start < QUICK_S
    assert_names(str(found.value), *fragments)
    assert zoo.args_problems({**VIT_65536, "image_size": [224, 224]}) == []  # a real ViT's are fine
    assert zoo.args_problems({**VIT_65536, "image_size": [8192, 6096]}) == []  # the largest a side can be


def test_a_meta_json_too_large_to_be_one_is_refused_unread(real_checkpoint, tmp_path):
    copy = tampered(real_checkpoint, tmp_path / "big", lambda m: None)
    with open(copy / ckpt.META_FILE, "r+b") as f:
        f.truncate(65 << 20)  # sparse
    message, seconds = refused(ckpt.read_meta, copy)
    assert_names(message, str(copy / ckpt.META_FILE), "68,157,440 bytes, over the 67,108,864 a meta.json can be")
    assert seconds < QUICK_S


def test_the_image_shape_meta_json_records_is_held_to_a_data_sets_bounds(real_checkpoint, tmp_path):
    from imgtrain.inference.predictor import load_checkpoint

    # 8000 px a side passed the old per-side check; 64 MP is over the pixel bound (the server
    # sizes its image cap and batches by this shape)
    copy = tampered(real_checkpoint, tmp_path / "wide", lambda m: m["data"].update(image_shape=[8000, 8000, 1]))
    message, _ = refused(load_checkpoint, copy)
    assert_names(message, str(copy), "meta.json data.image_shape [8000, 8000, 1]", "50,000,000 pixels")
