"""The checkpoint policy: names and their parsing, ranking, and one retention for both backends
(the local backend's ``checkpoint.retain`` and the ``CheckpointConfig`` Ray Train is given)."""

from __future__ import annotations

import pytest

from imgtrain.checkpoint_policy import POLICY, RAY_SNAPSHOT_FILE, CheckpointName
from imgtrain.config import TrainConfig
from imgtrain.storage import checkpoint as ckpt


def test_names_as_they_appear_in_a_run_folder_and_back():
    assert POLICY.epoch_name(3) == "checkpoint_epoch_0003"
    assert POLICY.step_name(3, 120) == "checkpoint_epoch_0003_step_0000120"
    # a damaged checkpoint still holding the name: Ray would delete the replacement with it
    taken = ["checkpoint_epoch_0003", "checkpoint_epoch_0003-2"]
    assert POLICY.epoch_name(3, taken) == "checkpoint_epoch_0003-3"
    assert POLICY.parse(POLICY.epoch_name(3, taken)) == CheckpointName(3, None, 3)
    assert POLICY.parse(POLICY.step_name(12345, 10**8)) == CheckpointName(12345, 10**8)
    assert POLICY.parse("checkpoint_2026-01-01_00-00-00.000000") is None  # Ray's own default name


def test_ray_snapshot_file_is_never_a_checkpoint(tmp_path):
    assert not POLICY.is_checkpoint(RAY_SNAPSHOT_FILE) and POLICY.parse(RAY_SNAPSHOT_FILE) is None
    assert POLICY.is_checkpoint(POLICY.epoch_name(0))
    (tmp_path / RAY_SNAPSHOT_FILE).write_text('{"checkpoints": []}')
    assert ckpt.listing(tmp_path) == [] and ckpt.remove_incomplete(tmp_path) == []
    assert (tmp_path / RAY_SNAPSHOT_FILE).is_file()


def test_a_checkpoint_inside_an_epoch_ranks_below_every_evaluated_one_and_ties_go_to_the_later():
    inside = {"metrics": {"epoch": 0, "step": 30, **POLICY.unevaluated_metrics()}, "step": 30}
    worst = {"metrics": {"val_accuracy": 0.0}, "step": 10}
    assert POLICY.rank_key(inside) < POLICY.rank_key(worst)
    assert POLICY.rank_key({"step": 5}) == POLICY.rank_key({"metrics": POLICY.unevaluated_metrics(), "step": 5})
    assert POLICY.rank_key({"metrics": {"val_accuracy": 0.5}, "step": 20}) > \
        POLICY.rank_key({"metrics": {"val_accuracy": 0.5}, "step": 10})


@pytest.mark.parametrize("settings", [{}, {"num_to_keep": 3}, {"num_to_keep": 1000, "checkpoint_every_steps": 5}])
def test_ray_is_given_the_checkpoint_config_it_always_was(settings):
    import ray.train

    cfg = TrainConfig(**settings)
    config = POLICY.keeping(cfg.num_to_keep).ray_config()  # as ray_backend._trainer builds it
    assert (config.num_to_keep, config.checkpoint_score_attribute, config.checkpoint_score_order) == \
        (cfg.num_to_keep, "val_accuracy", "max")
    assert config == ray.train.CheckpointConfig(num_to_keep=cfg.num_to_keep, checkpoint_score_attribute="val_accuracy",
                                                checkpoint_score_order="max")


# (epoch, step, val_accuracy or None for a checkpoint inside the epoch), in the order reported
REPORTS = [(0, 5, None), (0, 10, 0.5), (1, 15, None), (1, 20, 0.9), (2, 25, None), (2, 30, 0.7), (3, 40, 0.6),
           (4, 45, None)]


@pytest.mark.parametrize("num_to_keep", [1, 2, 3])
def test_both_retentions_keep_the_same_checkpoints(tmp_path, num_to_keep):
    """The local backend's retention after each checkpoint, and Ray Train's own checkpoint
    manager given ``ray_config()`` and the metrics the loop reports, keep the same folders."""
    from ray.train import Checkpoint
    from ray.train._internal.checkpoint_manager import _CheckpointManager
    from ray.train._internal.session import _TrainingResult

    policy = POLICY.keeping(num_to_keep)
    local, by_ray = tmp_path / "local", tmp_path / "ray"
    manager = _CheckpointManager(policy.ray_config())
    for epoch, step, acc in REPORTS:
        name = POLICY.epoch_name(epoch) if acc is not None else POLICY.step_name(epoch, step)
        metrics = {"epoch": epoch, "step": step, **({"val_accuracy": acc} if acc is not None
                                                    else POLICY.unevaluated_metrics())}
        ckpt.save(local / name, {}, {}, {"step": step, "metrics": metrics})
        ckpt.retain(local, policy)
        ckpt.save(by_ray / name, {}, {}, {"step": step, "metrics": metrics})
        manager.register_checkpoint(_TrainingResult(Checkpoint(str(by_ray / name)), metrics))
    kept = sorted(p.name for p in local.iterdir())
    assert kept == sorted(p.name for p in by_ray.iterdir())
    assert POLICY.step_name(4, 45) in kept and POLICY.epoch_name(1) in kept  # the latest, the best


def test_damaged_checkpoints_are_neither_counted_nor_deleted(tmp_path):
    for epoch, acc in enumerate([0.9, 0.5, 0.6]):
        ckpt.save(tmp_path / POLICY.epoch_name(epoch), {}, {}, {"step": epoch, "metrics": {"val_accuracy": acc}})
    ckpt.retain(tmp_path, POLICY.keeping(1), ignore=[POLICY.epoch_name(0)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [POLICY.epoch_name(0), POLICY.epoch_name(2)]


# ---------------------------------------------------------------- the selection metric


def test_a_run_selecting_by_loss_ranks_the_lowest_best_and_an_unevaluated_one_below_all():
    policy = POLICY.for_metric("val_loss")
    inside = {"metrics": policy.unevaluated_metrics(), "step": 30}
    awful, good = {"metrics": {"val_loss": 1e30}, "step": 10}, {"metrics": {"val_loss": 0.1}, "step": 5}
    diverged = {"metrics": {"val_loss": float("nan")}, "step": 40}
    assert policy.rank_key(good) > policy.rank_key(awful) > policy.rank_key(inside) > policy.rank_key(diverged)
    assert policy.rank_key({"step": 5}) == policy.rank_key({"metrics": {"val_loss": "0.1"}, "step": 5})  # not a number
    config = policy.keeping(2).ray_config()
    assert (config.checkpoint_score_attribute, config.checkpoint_score_order, config.num_to_keep) == \
        ("val_loss", "min", 2)
    assert POLICY.for_metric("val_f1_macro").mode == "max"


def test_readers_rank_by_the_metric_the_runs_config_names():
    assert POLICY.for_config({"select_metric": "val_loss"}) == POLICY.for_metric("val_loss")
    for old_or_odd in (None, {}, {"select_metric": "val_top5"}, {"select_metric": ["x"]}, []):
        assert POLICY.for_config(old_or_odd) == POLICY


def test_best_and_latest_of_a_run_rank_by_its_own_metric(tmp_path):
    for epoch, (loss, acc) in enumerate([(0.3, 0.9), (0.2, 0.8), (0.4, 0.7)]):
        ckpt.save(tmp_path / POLICY.epoch_name(epoch), {}, {}, {"step": epoch, "config": {"select_metric": "val_loss"},
                                                                "metrics": {"val_loss": loss, "val_accuracy": acc}})
    assert ckpt.best_and_latest(tmp_path) == (tmp_path / POLICY.epoch_name(1), tmp_path / POLICY.epoch_name(2))
    assert ckpt.choose(tmp_path, "best", "r") == tmp_path / POLICY.epoch_name(1)


# (epoch, step, val_loss or None for a checkpoint inside the epoch), in the order reported
LOSS_REPORTS = [(0, 5, None), (0, 10, 0.9), (1, 15, None), (1, 20, 0.3), (2, 25, None), (2, 30, float("nan")),
                (3, 40, 0.5), (4, 45, None)]


@pytest.mark.parametrize("num_to_keep", [1, 2, 3])
def test_both_retentions_keep_the_same_checkpoints_by_loss(tmp_path, num_to_keep):
    from ray.train import Checkpoint
    from ray.train._internal.checkpoint_manager import _CheckpointManager
    from ray.train._internal.session import _TrainingResult

    policy = POLICY.for_metric("val_loss").keeping(num_to_keep)
    local, by_ray = tmp_path / "local", tmp_path / "ray"
    manager = _CheckpointManager(policy.ray_config())
    for epoch, step, loss in LOSS_REPORTS:
        name = POLICY.epoch_name(epoch) if loss is not None else POLICY.step_name(epoch, step)
        metrics = {"epoch": epoch, "step": step, **({"val_loss": loss} if loss is not None
                                                    else policy.unevaluated_metrics())}
        ckpt.save(local / name, {}, {}, {"step": step, "metrics": metrics})
        ckpt.retain(local, policy)
        ckpt.save(by_ray / name, {}, {}, {"step": step, "metrics": metrics})
        manager.register_checkpoint(_TrainingResult(Checkpoint(str(by_ray / name)), metrics))
    kept = sorted(p.name for p in local.iterdir())
    assert kept == sorted(p.name for p in by_ray.iterdir())
    assert POLICY.step_name(4, 45) in kept and POLICY.epoch_name(1) in kept  # the latest, the lowest loss


def test_the_average_checkpoints_name_sorts_after_its_epochs_own():
    name = POLICY.average_name(11)
    assert name == "checkpoint_epoch_0011_average" and name > POLICY.epoch_name(11)
    assert POLICY.parse(name) == CheckpointName(11, None, average=True)
    assert POLICY.parse(POLICY.average_name(11, [name])) == CheckpointName(11, None, 2, average=True)


# ---------------------------------------------------------------- early stopping


def history(*values, metric="val_loss"):
    return [{"kind": "epoch", "epoch": e, metric: v} for e, v in enumerate(values)]


@pytest.mark.parametrize("metric, values, patience, delta, expected", [
    ("val_loss", (1.0, 0.9, 0.95, 0.97), 2, 0.0, (3, 1)),  # two epochs above the best: stop
    ("val_loss", (1.0, 0.9, 0.95), 2, 0.0, None),  # one: go on
    ("val_loss", (1.0, 0.9, 0.89, 0.88), 2, 0.05, (3, 1)),  # improvements smaller than the delta do not count
    ("val_accuracy", (0.5, 0.7, 0.7, 0.6), 2, 0.0, (3, 1)),  # max: a tie is no improvement
    ("val_accuracy", (0.5, 0.7, 0.8), 1, 0.0, None),
    ("val_loss", (float("nan"), float("nan")), 2, 0.0, (1, None)),  # a diverged run never improves
    ("val_loss", (), 1, 0.0, None),
    ("val_loss", (1.0, 2.0, 3.0), 0, 0.0, None),  # off
])
def test_early_stopping_is_a_function_of_the_epoch_history(metric, values, patience, delta, expected):
    stop = POLICY.for_metric(metric).stopped_early(history(*values, metric=metric), patience, delta)
    assert (stop and (stop.epoch, stop.best_epoch)) == expected or (stop is None and expected is None)
