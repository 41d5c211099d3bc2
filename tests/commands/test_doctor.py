"""imgtrain doctor without a cluster of its own: versions, storage, an address where nothing answers."""

import json
import time

import pytest
import ray
import torch

import imgtrain

from tests.conftest import run_cli


@pytest.mark.integration  # the real CLI in a process of its own
def test_doctor_reports_versions_and_storage_and_a_clear_verdict(tmp_path):
    done = run_cli("doctor", "--storage", str(tmp_path / "runs"), "--json")
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert f"torch {torch.__version__}" in checks["versions"]["detail"]
    assert f"ray {ray.__version__}" in checks["versions"]["detail"]
    assert report["version"] == imgtrain.__version__ and checks["versions"]["detail"].startswith(
        f"imgtrain {imgtrain.__version__}, Python")
    assert checks["CUDA"]["status"] in ("ok", "info")
    assert checks["storage"]["status"] == "ok" and "writable" in checks["storage"]["detail"]
    assert not (tmp_path / "runs").exists()  # checked, and nothing left behind
    assert done.returncode == (0 if report["ready"] else 1)


def test_version_is_an_option_of_the_command():
    import importlib.metadata

    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout == f"imgtrain {importlib.metadata.version('imgtrain')}\n", done
    assert imgtrain.__version__ == importlib.metadata.version("imgtrain")


@pytest.mark.integration  # the real CLI in a process of its own
def test_doctor_fails_in_seconds_on_bad_storage_and_an_unreachable_cluster(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    start = time.monotonic()
    done = run_cli("doctor", "--storage", str(blocker / "runs"), "--address", "127.0.0.1:1", timeout=30)
    assert time.monotonic() - start < 30
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert any(line.startswith("FAIL  storage:") and "not writable (Not a directory)" in line for line in lines)
    assert any(line.startswith("FAIL  cluster: cannot reach the Ray cluster at 127.0.0.1:1") for line in lines)
    assert lines[-1] == "verdict: not ready: 2 problem(s) (storage, cluster)"
