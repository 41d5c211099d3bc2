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


def _cleaners(private: bool) -> list:
    import ray.train
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from imgtrain.training.ray_backend import _lighter

    trainer = _lighter(TorchTrainer, private)(
        lambda config: None, scaling_config=ray.train.ScalingConfig(num_workers=1),
        run_config=ray.train.RunConfig(name="lighter", storage_path="/nonexistent"))
    callbacks = trainer._create_default_callbacks()
    assert callbacks, "Ray Train's other default callbacks are kept"
    return [c for c in callbacks if isinstance(c, PlacementGroupCleanerCallback)]


def test_a_private_cluster_runs_no_placement_group_cleaner_and_a_joined_one_keeps_rays():
    # issue 51: the cleaner asks the GCS every second, for the whole run, whether the controller
    # lives; a private cluster, its placement groups with it, ends with the command
    assert _cleaners(private=True) == []
    (joined,) = _cleaners(private=False)
    assert joined._check_interval_s == 1.0  # Ray's own: its stop waits out one interval at a run's end


def test_the_driver_polls_the_monitor_no_faster_than_the_ranks_heartbeat():
    # records and heartbeats leave the ranks once a heartbeat: a faster poll found nothing new
    from imgtrain.training.health import HEARTBEAT_S
    from imgtrain.training.ray_backend import POLL_S

    assert POLL_S >= HEARTBEAT_S
