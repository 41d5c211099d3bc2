"""The preparation pool from a user's script (issue 46): a script without
``if __name__ == "__main__":`` is imported again by every 'spawn' pool process, which ran its
``imgtrain.prepare`` again and broke the pool (BrokenProcessPool, a 20-line traceback). The
work is done in the script's own process then, with one warning that names the line and the
guard; and ``prepare`` takes the CLI's names (``source=``, ``val_fraction=``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import imgtrain
from imgtrain.errors import ImgtrainError
from tests.conftest_data_helpers import save_image

IMAGES = 3 * 64 + 8  # four chunks of the pool (listing.CHUNK_FILES = 64): more than it does in-process


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """One subfolder per class, 200 small PNGs."""
    root = tmp_path_factory.mktemp("photos")
    for i in range(IMAGES):
        save_image(root / f"c{i % 4}" / f"{i:04d}.png", i * 37 % 256)
    return root


def run_script(folder, text: str) -> subprocess.CompletedProcess:
    script = folder / "user_script.py"
    script.write_text(textwrap.dedent(text))
    return subprocess.run([sys.executable, script.name], cwd=folder, capture_output=True, text=True, timeout=240)


def test_a_script_without_the_main_guard_prepares_in_its_own_process_and_says_why(photos, tmp_path):
    proc = run_script(tmp_path, f"""\
        import imgtrain
        manifest = imgtrain.prepare("folder", "data/x", source={str(photos)!r}, val_fraction=0.1)
        print(sum(split["num_samples"] for split in manifest["splits"].values()))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(IMAGES)]
    assert "Traceback" not in proc.stderr and "BrokenProcessPool" not in proc.stderr
    warning = [line for line in proc.stderr.splitlines() if "ImgtrainWarning" in line]
    assert len(warning) == 1 and warning[0].startswith(f"{tmp_path / 'user_script.py'}:2: ImgtrainWarning: "), proc.stderr
    assert 'this line is outside `if __name__ == "__main__":`' in warning[0]
    assert set(json.loads((tmp_path / "data/x/manifest.json").read_text())["splits"]) == {"train", "val", "test"}


def test_the_guard_is_found_wherever_the_call_comes_from(tmp_path):
    """Top-level code outside the guard is a line a pool process would run again; the guard's
    body (either way round, through a function) is not; nor is ``python -c``."""
    proc = run_script(tmp_path, """\
        from imgtrain.data.pool import unguarded_main_line as where

        def nested():
            return where()

        print(where() and where()[1], nested() and nested()[1])
        if "__main__" == __name__:
            print(where(), nested())
        if __name__ != "__main__":
            pass
        else:
            print(where() and where()[1])
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["6 6", "None None", "12"]  # an else: branch is not the guard's body
    inline = subprocess.run([sys.executable, "-c", "from imgtrain.data.pool import unguarded_main_line as w; print(w())"],
                            capture_output=True, text=True, timeout=60)
    assert inline.stdout.strip() == "None", inline.stderr


def test_prepare_takes_the_clis_names_and_its_old_one(photos, tmp_path):
    manifest = imgtrain.prepare("folder", tmp_path / "new", source=str(photos), size="4x4", workers=1)
    assert manifest["image_shape"] == [4, 4, 1]
    old = imgtrain.prepare("folder", tmp_path / "old", source_path=str(photos), workers=1)
    assert old["splits"]["train"]["num_samples"] == manifest["splits"]["train"]["num_samples"]
    with pytest.raises(ImgtrainError, match="prepare\\(\\) has no option val_fractoin"):
        imgtrain.prepare("folder", tmp_path / "bad", source=str(photos), val_fractoin=0.1)
