import pytest

from imgtrain.config import (
    TrainConfig,
    by_name,
    changed_fields,
    per_worker_batch_sizes,
    settings,
    validate,
)
from imgtrain.errors import ImgtrainError


@pytest.mark.parametrize("batch,world", [(128, 1), (128, 2), (128, 3), (7, 7), (100, 6)])
def test_batch_split_is_exact_and_balanced(batch, world):
    sizes = per_worker_batch_sizes(batch, world)
    assert sum(sizes) == batch and len(sizes) == world
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the remainder goes to the first ranks


def test_validate_reports_every_problem_at_once():
    cfg = TrainConfig(name="", epochs=0, batch_size=1, workers=2, lr=-1, ingest="tfrecord")
    with pytest.raises(ImgtrainError) as e:
        validate(cfg)
    msg = str(e.value)
    for fragment in ("--name is required", "--epochs", "--batch-size 1 is smaller than --workers 2",
                     "--lr", "--ingest 'tfrecord'"):
        assert fragment in msg
    assert "\n" not in msg


def test_defaults_are_valid_and_every_setting_is_documented_and_bounded():
    validate(TrainConfig(name="ok"))
    found = settings()
    assert all(s.doc and s.summary for s in found), [s.name for s in found if not s.doc]
    numbers = [s.name for s in found if s.type in (int, float)]
    assert [n for n in numbers if not by_name()[n].range] == []  # every number has a stated range
    assert by_name()["stall_timeout_s"].flag == "--stall-timeout" and by_name()["use_gpu"].resumable


def test_every_setting_is_a_train_option_generated_from_the_dataclass():
    from typer.testing import CliRunner

    from imgtrain.cli import app

    shown = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "250"}).output
    for s in settings():
        if s.cli:
            assert s.flag.split("/")[0] in shown, s.flag
    assert "--min-workers" not in shown  # set through --workers MIN-MAX


def test_resumable_fields_do_not_count_as_a_different_experiment():
    old = TrainConfig(name="a", epochs=5).to_dict()
    assert changed_fields(old, TrainConfig(name="a", epochs=9, workers=1).to_dict()) == []
    assert changed_fields(old, TrainConfig(name="a", lr=0.1).to_dict()) == ["lr"]


def test_the_versions_a_config_json_records_are_not_settings():
    from imgtrain.config import resolve
    from imgtrain.storage.runs import versions

    now = TrainConfig(name="a", epochs=5)
    by_another_version = {**now.to_dict(), "imgtrain_version": "0.0.1", "torch_version": "2.0.0", "ray_version": None}
    older = now.to_dict()  # written before versions were recorded
    assert set(versions()) == {"imgtrain_version", "torch_version", "ray_version"} and all(versions().values())
    for stored in (by_another_version, older):
        assert changed_fields(stored, now.to_dict()) == []  # the run resumes
        assert resolve({}, stored) == now


def test_resolve_layers_defaults_stored_config_and_given_options():
    from imgtrain.config import resolve

    stored = TrainConfig(name="a", lr=0.01, epochs=5).to_dict()
    cfg = resolve({"name": "a", "epochs": 9, "lr": None}, stored)
    assert (cfg.lr, cfg.epochs, cfg.batch_size) == (0.01, 9, TrainConfig.batch_size)
    assert resolve({"name": "b"}).lr == TrainConfig.lr
    with pytest.raises(ImgtrainError, match="unknown config field"):
        resolve({"name": "c", "lrr": 1})


@pytest.mark.parametrize("n,batch,limit,expected", [
    (4000, 128, 0, 31),   # the demo: 31 whole global batches, whatever the world size
    (4000, 64, 0, 62),
    (4000, 64, 5, 5),     # smoke mode stops after 5 steps
    (100, 128, 0, 0),     # a batch larger than the data: no whole step
])
def test_steps_per_epoch_are_whole_global_batches(n, batch, limit, expected):
    from imgtrain.config import steps_per_epoch

    assert steps_per_epoch(n, batch, limit) == expected


def test_fsdp_needs_ray_workers_and_is_kept_when_resumed():
    with pytest.raises(ImgtrainError) as e:
        validate(TrainConfig(name="a", strategy="fsdp", backend="local", compile=True))
    assert "--strategy fsdp shards the model over Ray Train workers; --backend local" in str(e.value)
    assert "--compile is not supported with --strategy fsdp" in str(e.value)
    with pytest.raises(ImgtrainError, match="--strategy 'zero' is not one of ddp, fsdp"):
        validate(TrainConfig(name="a", strategy="zero"))
    validate(TrainConfig(name="a", strategy="fsdp"))
    old = TrainConfig(name="a").to_dict()
    assert changed_fields(old, TrainConfig(name="a", strategy="fsdp").to_dict()) == ["strategy"]
    from imgtrain.configfile import check_values

    assert check_values({"strategy": "fsdp"}) == ({"strategy": "fsdp"}, [])  # from a config file too
