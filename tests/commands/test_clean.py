"""imgtrain clean, on real files: only what imgtrain made goes, links are never followed."""

import io
import json
import os
import socket
import sys

import pytest

from imgtrain.checkpoint_policy import POLICY
from imgtrain.commands.clean import plan_dataset, plan_runs, remove
from imgtrain.errors import ImgtrainError
from imgtrain.storage import ownership, runs
from tests.conftest import cli_here


def make_run(storage, name, status="finished", pid=None, host=None):
    run_dir = storage / name
    ownership.claim(run_dir)
    (run_dir / "logs").mkdir()
    runs.write_config(run_dir, {"name": name})
    (run_dir / runs.STATUS_FILE).write_text(json.dumps(
        {"status": status, "pid": pid or os.getpid(), "host": host or socket.gethostname()}))
    (run_dir / POLICY.epoch_name(0)).mkdir()
    (run_dir / POLICY.epoch_name(0) / "model.pt").write_bytes(b"x" * 1000)
    return run_dir


@pytest.fixture
def outside(tmp_path):
    """A folder of the user's that runs link to (as logs/ray links to Ray's session logs)."""
    folder = tmp_path / "ray-session-logs"
    folder.mkdir()
    (folder / "raylet.out").write_text("keep me")
    return folder


def test_deleting_a_run_removes_it_but_never_what_its_links_point_to(tmp_path, outside):
    storage = tmp_path / "runs"
    a, b = make_run(storage, "a"), make_run(storage, "b")
    (a / "logs" / "ray").symlink_to(outside, target_is_directory=True)
    plan = plan_runs(str(storage), ["a"])
    assert [r.path for r in plan] == [a] and plan[0].size >= 1000
    remove(plan[0])
    assert not a.exists() and b.is_dir()
    assert (outside / "raylet.out").read_text() == "keep me"


def test_all_takes_only_run_directories_not_links_or_other_folders(tmp_path, outside):
    storage = tmp_path / "runs"
    make_run(storage, "a")
    (storage / "notes").mkdir()  # no config.json: not a run
    (storage / "linked").symlink_to(make_run(tmp_path / "elsewhere", "linked"), target_is_directory=True)
    plan = plan_runs(str(storage), [], everything=True)
    assert [r.path.name for r in plan] == ["a"]


def test_runs_that_cannot_be_deleted_are_refused_before_anything_is(tmp_path):
    storage = tmp_path / "runs"
    make_run(storage, "done")
    live = make_run(storage, "live", status="running", pid=os.getpid())  # this process is alive...
    with ownership.locked(live, "trained"), \
            pytest.raises(ImgtrainError, match="'live' is being trained right now"):  # ...and trains it
        plan_runs(str(storage), ["done", "live"])
    with pytest.raises(ImgtrainError, match=r"no run named 'nope' .*runs there: done, live"):
        plan_runs(str(storage), ["done", "nope"])
    for bad in ("../runs", ".", "a/b"):
        with pytest.raises(ImgtrainError, match="is not a run name"):
            plan_runs(str(storage), [bad])
    assert (storage / "done").is_dir()


def test_a_status_naming_a_live_process_that_holds_no_lock_blocks_nothing(tmp_path):
    # A status.json from a bucket or a copied folder that names this host and pid 1 (or a pid
    # reused since): alive, but not training the run, whose lock nobody holds.
    storage = tmp_path / "runs"
    make_run(storage, "planted", status="running", pid=1)
    assert runs.read_status(storage / "planted")["status"] == "interrupted"
    remove(plan_runs(str(storage), ["planted"])[0])
    assert not (storage / "planted").exists()


def test_a_data_set_loses_only_the_files_its_manifest_lists(tmp_path, tiny_data_copy):
    (tiny_data_copy / "README.txt").write_text("mine")
    (tiny_data_copy / "train" / "extra.parquet").write_text("mine too")
    (tiny_data_copy / ".teacher-logits").mkdir()  # distillation's cache of a teacher's logits: imgtrain's
    for name in ("0a00-6b85.npz", "0a00-6b85.ids.npy", "0a00-6b85.logits.npy", ".0a00-6b85.logits.npy.k2x.tmp"):
        (tiny_data_copy / ".teacher-logits" / name).write_bytes(b"logits")  # older, today's, a writer cut short
    plan = plan_dataset(tiny_data_copy)
    assert {p.name for p in plan.kept} == {"README.txt", "extra.parquet"}
    remove(plan)
    left = sorted(p.relative_to(tiny_data_copy).as_posix() for p in tiny_data_copy.rglob("*"))
    assert left == ["README.txt", "train", "train/extra.parquet"]  # test/ and .teacher-logits/ emptied and removed


def test_a_folder_imgtrain_did_not_prepare_is_refused(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.png").write_bytes(b"png")
    with pytest.raises(ImgtrainError, match="manifest.json"):
        plan_dataset(tmp_path / "photos")
    assert (tmp_path / "photos" / "cat.png").is_file()


@pytest.fixture
def tiny_data_copy(tiny_data, tmp_path):
    import shutil

    return shutil.copytree(tiny_data, tmp_path / "data")


def test_cli_asks_first_and_deletes_nothing_without_a_yes(tmp_path, tiny_data_copy, capsys, monkeypatch):
    def clean_cli(*args: str, answer: str = ""):
        """The real command (in this process) with ``answer`` on its stdin (empty: end of input, as in a script)."""
        monkeypatch.setattr(sys, "stdin", io.StringIO(answer))
        return cli_here(capsys, "clean", *args)

    storage = tmp_path / "runs"
    run_dir = make_run(storage, "old")
    listed = clean_cli("runs", "old", "--storage", str(storage), "--dry-run")
    assert listed.returncode == 0 and f"would delete run {run_dir}" in listed.stdout

    no_answer = clean_cli("runs", "old", "--storage", str(storage))
    assert no_answer.returncode == 2 and "nothing deleted (pass --yes" in no_answer.stderr
    said_no = clean_cli("runs", "old", "--storage", str(storage), answer="n\n")
    assert said_no.returncode == 1 and "nothing deleted" in said_no.stdout
    assert run_dir.is_dir()

    said_yes = clean_cli("data", str(tiny_data_copy), answer="y\n")
    assert said_yes.returncode == 0 and f"deleted {tiny_data_copy}" in said_yes.stdout
    assert not tiny_data_copy.exists()
    done = clean_cli("runs", "--all", "--storage", str(storage), "--yes")
    assert done.returncode == 0 and not run_dir.exists()
