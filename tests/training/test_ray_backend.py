"""The driver side of Ray Train: the worker-group start timeout an elastic run gives Ray Train (a
user's own wins), and where Ray's record of the checkpoints lies between fits."""

import os

from imgtrain.training.ray_backend import (
    ELASTIC_START_TIMEOUT_S,
    START_TIMEOUT_ENV,
    _start_timeout,
)


def test_an_elastic_fit_waits_less_for_its_workers_and_leaves_the_environment_as_it_was(monkeypatch):
    monkeypatch.delenv(START_TIMEOUT_ENV, raising=False)
    with _start_timeout(elastic=True):
        assert os.environ[START_TIMEOUT_ENV] == str(ELASTIC_START_TIMEOUT_S)
    assert START_TIMEOUT_ENV not in os.environ
    with _start_timeout(elastic=False):  # a fixed-size run keeps Ray's default
        assert START_TIMEOUT_ENV not in os.environ


def test_a_timeout_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(START_TIMEOUT_ENV, "300")
    with _start_timeout(elastic=True):
        assert os.environ[START_TIMEOUT_ENV] == "300"
    assert os.environ[START_TIMEOUT_ENV] == "300"


def test_rays_snapshot_is_where_ray_reads_it_during_a_fit_and_hidden_between_fits(tmp_path):
    from imgtrain.checkpoint_policy import RAY_SNAPSHOT_FILE, RAY_SNAPSHOT_PARKED
    from imgtrain.training.ray_backend import _ray_snapshot_in_place

    ray_name, parked = tmp_path / RAY_SNAPSHOT_FILE, tmp_path / RAY_SNAPSHOT_PARKED
    with _ray_snapshot_in_place(tmp_path, in_store=False):  # a new run: Ray writes its record
        ray_name.write_text("first fit")
    assert parked.read_text() == "first fit" and not ray_name.exists()
    with _ray_snapshot_in_place(tmp_path, in_store=False):  # a resume: Ray reads it where it wrote it
        assert ray_name.read_text() == "first fit" and not parked.exists()
        ray_name.write_text("second fit")
    assert parked.read_text() == "second fit" and not ray_name.exists()

    ray_name.write_text("left by a killed driver")  # newer than the parked one: Ray's wins
    with _ray_snapshot_in_place(tmp_path, in_store=False):
        assert ray_name.read_text() == "left by a killed driver" and not parked.exists()
    with _ray_snapshot_in_place(tmp_path, in_store=True):  # a working copy's is left as it is
        ray_name.write_text("in the bucket")
    assert ray_name.is_file()
