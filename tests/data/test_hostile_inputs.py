"""Image paths that are not images to read: a 6 GiB sparse .png, a FIFO, a link to a
device. ``data prepare`` and ``predict`` skip each with its reason, unread, and go on."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from imgtrain.data import images
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.inference.inputs import list_inputs
from tests.conftest_data_helpers import read_inputs_whole, save_image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HOSTILE = {"huge.png": "over the limit of", "pipe.png": "not a regular file (a FIFO)",
           "zero.png": "not a regular file (a device)"}


def hostile_files(folder: Path) -> dict[str, Path]:
    """In ``folder``: a sparse 6 GiB file that starts as a PNG (no disk used), a FIFO nothing ever
    writes to (reading it blocks forever) and a link to /dev/zero (it never ends)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "huge.png", "wb") as f:
        f.write(PNG_SIGNATURE)
        f.truncate(6 << 30)
    os.mkfifo(folder / "pipe.png")
    (folder / "zero.png").symlink_to("/dev/zero")
    return {name: folder / name for name in HOSTILE}


def good_images(root: Path) -> list[str]:
    """Five real PNGs in each of the class folders a and b; their paths relative to ``root``."""
    return [save_image(root / c / f"{i}.png", 40 * i).relative_to(root).as_posix()
            for c in ("a", "b") for i in range(5)]


def prepared(source: str, source_path: Path, out: Path) -> tuple[dict, float]:
    start = time.monotonic()
    manifest = prepare(source, out, source_path, PrepareOptions(workers=1))
    return manifest, time.monotonic() - start


def assert_skipped_with_reasons(manifest: dict, names: dict[str, str]) -> None:
    skipped = dict(manifest["skipped"]["files"])
    assert manifest["skipped"]["count"] == len(names), skipped
    for name, reason in names.items():
        assert reason in skipped[name], (name, skipped[name])
    assert sum(s["num_samples"] for s in manifest["splits"].values()) == 10  # the rest is written


@pytest.mark.timeout(60)  # a FIFO that is read blocks forever: never the whole suite
def test_prepare_skips_a_huge_file_a_fifo_and_a_device_in_a_folder_unread(tmp_path):
    root = tmp_path / "folder"
    good_images(root)
    hostile_files(root / "a")
    manifest, seconds = prepared("folder", root, tmp_path / "out")
    assert seconds < 20
    assert_skipped_with_reasons(manifest, {f"a/{name}": why for name, why in HOSTILE.items()})


@pytest.mark.timeout(60)
def test_prepare_skips_a_huge_file_a_fifo_and_a_device_in_a_csv_list_unread(tmp_path):
    root = tmp_path / "list"
    rows = [f"{rel},{rel[0]}" for rel in good_images(root)]
    rows += [f"odd/{name},a" for name in hostile_files(root / "odd")]
    (root / "list.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    manifest, seconds = prepared("list", root / "list.csv", tmp_path / "out")
    assert seconds < 20
    assert_skipped_with_reasons(manifest, {f"odd/{name}": why for name, why in HOSTILE.items()})


@pytest.mark.timeout(60)
def test_predict_skips_a_huge_file_a_fifo_and_a_device_unread(tmp_path):
    folder = tmp_path / "in"
    save_image(folder / "ok.png", 9)
    odd = hostile_files(folder)
    start = time.monotonic()
    found = read_inputs_whole(str(folder), (8, 8, 1))
    assert time.monotonic() - start < 20
    reasons = dict(zip(found["path"], found["_error"]))
    assert reasons.pop(str(folder / "ok.png")) == ""
    assert sorted(Path(p).name for p in reasons) == sorted(HOSTILE)
    for path, why in reasons.items():
        assert why.startswith("cannot be used (") and HOSTILE[Path(path).name] in why, (path, why)
    assert list_inputs(str(odd["pipe.png"])).total == 1  # named alone: reported, not "does not exist"


def _reason(path: Path) -> str:
    with pytest.raises(images.ImageRejected) as rejected:
        images.read_image_file(path)
    return str(rejected.value)


def test_read_image_file_refuses_what_is_not_a_regular_file_or_too_large(tmp_path):
    odd = hostile_files(tmp_path)
    for name, why in HOSTILE.items():
        assert why in _reason(odd[name])
    assert "not a regular file (a folder)" in _reason(tmp_path)
    assert _reason(tmp_path / "missing.png") == "cannot be read (No such file or directory)"
    ok = save_image(tmp_path / "ok.png", 9)
    assert images.read_image_file(ok) == ok.read_bytes()


def damaged_photos(folder: Path) -> dict[str, str]:
    """A JPEG and a PNG cut in half (copies that stopped): their names and what the report must
    say about each."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)  # no run the coder squeezes
    for name in ("cut.jpg", "cut.png"):
        Image.fromarray(noise).save(folder / name)
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[:len(data) // 2])
    return {"cut.jpg": "truncated JPEG: image file is truncated", "cut.png": "truncated PNG: image file is truncated"}


def test_a_truncated_jpeg_is_reported_as_one_not_as_oserror(tmp_path):
    """prepare's skipped files and predict's reasons said only "OSError"."""
    root = tmp_path / "folder"
    good_images(root)
    said = damaged_photos(root / "a")
    manifest, _ = prepared("folder", root, tmp_path / "out")
    assert_skipped_with_reasons(manifest, {f"a/{name}": why for name, why in said.items()})
    found = read_inputs_whole(str(root / "a"), (8, 8, 1))
    reasons = {Path(p).name: why for p, why in zip(found["path"], found["_error"]) if why}
    assert set(reasons) == set(said)
    for name, why in said.items():
        assert why in reasons[name] and "OSError" not in reasons[name], reasons[name]
