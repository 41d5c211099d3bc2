"""A tracker is one module that declares itself and registers: the built-in ones are found by
name, an unknown one is refused in one line, and a tracker registered by this test alone receives
a real run's records (the tiny CNN on the local backend) with nothing else knowing about it."""

from __future__ import annotations

import json

import pytest

import imgtrain
from imgtrain.config import TrainConfig, by_name
from imgtrain.errors import ImgtrainError
from imgtrain.training import tracking
from imgtrain.training.tracking import registry
from imgtrain.training.tracking.base import Tracker, model_files
from imgtrain.training.tracking.mlflow_tracker import MLflowTracker
from imgtrain.training.tracking.tensorboard_tracker import TensorBoardTracker
from imgtrain.training.tracking.wandb_tracker import WandbTracker
from tests.conftest import quiet_display, tiny_config

PASSWORD = "s3cr3t-pa55"


class Recorder(Tracker):
    """A whole tracker in a few lines: it keeps what it is given (``seen``), as a backend would."""

    key, name = "recorder", "Recorder"  # no settings: on for every run while it is registered
    seen: list = []

    def __init__(self, cfg: TrainConfig, run_dir, manifest: dict):
        self.seen.append(("open", cfg.name, run_dir, tracking.params_of(cfg, manifest)["data_train_samples"]))
        self.opened = "Recorder: keeping the records"

    def log(self, record: dict) -> None:
        self.seen.append(("record", record))
        super().log(record)

    def log_metrics(self, values: dict[str, float], step: int, time: float | None) -> None:
        self.seen.append(("metrics", step, values))

    def log_model(self, checkpoint) -> None:
        with model_files(checkpoint) as files:
            self.seen.append(("model", checkpoint.name, json.loads(files["meta.json"].read_text())["config"]["data"]))

    def end(self, status: str) -> None:
        self.seen.append(("end", status))

    def close(self) -> None:
        self.seen.append(("close",))


@pytest.fixture
def recorder(monkeypatch):
    """The Recorder registered for one test, the registry put back afterwards."""
    monkeypatch.setattr(registry, "TRACKERS", dict(registry.TRACKERS))
    monkeypatch.setattr(Recorder, "seen", [])
    return registry.register(Recorder)


def test_each_tracker_is_found_by_name_and_an_unknown_one_is_refused_in_one_line():
    assert [registry.get(k) for k in ("mlflow", "tensorboard", "wandb")] == [MLflowTracker, TensorBoardTracker,
                                                                            WandbTracker]
    assert tracking.registered() == [MLflowTracker, TensorBoardTracker, WandbTracker]  # the order they open in
    assert [t.flag for t in tracking.registered()] == ["--mlflow", "--tensorboard", "--wandb"]  # config.py's
    with pytest.raises(ImgtrainError) as refused:
        registry.get("comet")
    assert str(refused.value) == "unknown tracker 'comet'; choose one of: mlflow, tensorboard, wandb"
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(MLflowTracker)
    stray = type("Stray", (Recorder,), {"key": "stray", "settings": ("comet_project",)})
    with pytest.raises(ValueError, match=r"reads settings TrainConfig does not have: \['comet_project'\]"):
        registry.register(stray)
    assert "stray" not in registry.TRACKERS
    # what may hold a credential is the setting's own declaration, whichever tracker reads it
    reader = type("Reader", (Recorder,), {"key": "reader", "settings": ("tensorboard", "mlflow")})
    assert reader.secrets == ("mlflow",)


def test_each_trackers_settings_may_change_on_resume_and_leave_a_sweep_as_it_is():
    """What a tracker reads is where a run is logged, not the experiment: a resumed run or a
    re-run sweep may log elsewhere."""
    from imgtrain.sweep.driver import SweepRequest

    base = SweepRequest(TrainConfig(name="s", data="/d"), {}).stored()
    values = {str: "elsewhere", bool: True}
    for tracker in tracking.registered():
        assert tracker.settings, tracker
        for name in tracker.settings:
            setting = by_name()[name]
            assert setting.resumable, f"{tracker.name}'s setting {name} must be resumable"
            changed = TrainConfig(name="s", data="/d", **{name: values[setting.type]})
            assert SweepRequest(changed, {}).stored() == base, f"{tracker.name}'s {name} changes a sweep's identity"


def test_a_secret_a_tracker_declares_never_leaves_in_the_config():
    uri = f"http://someone:{PASSWORD}@tracking.example:5000"
    secrets = [(tracker, name) for tracker in tracking.registered() for name in tracker.secrets]
    assert secrets == [(MLflowTracker, "mlflow")]
    for tracker, name in secrets:
        cfg = TrainConfig(name="s", data="/d", **{name: uri})
        for shown in (tracking.public_config(cfg), tracking.tracked_config(cfg.to_dict()),
                      tracking.params_of(cfg, {"splits": {"train": {"num_samples": 1}, "test": {"num_samples": 1}}})):
            assert PASSWORD not in json.dumps(shown) and shown[name] == "http://tracking.example:5000", tracker


@pytest.mark.usefixtures("tiny_cnn")
def test_a_tracker_registered_in_a_test_receives_a_runs_records(recorder, tiny_data, tmp_path):
    tracking.require(TrainConfig(name="s", data="/d"))  # nothing to install
    notes = []
    display = quiet_display()
    display.note = notes.append
    run = imgtrain.train(tiny_config(tiny_data, tmp_path, "tracked", backend="local", workers=1, epochs=1,
                                     model="tinycnn_8"), display=display)
    assert run.status == "finished" and "Recorder: keeping the records" in notes

    seen = Recorder.seen
    assert seen[0] == ("open", "tracked", run.path, 256)
    written = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [s[1] for s in seen if s[0] == "record"] == written  # every record of the run, in order
    assert {r["kind"] for r in written} >= {"start", "step", "epoch"}
    metrics = [(step, values) for kind, step, values in (s for s in seen if s[0] == "metrics")]
    last_epoch = [r for r in written if r["kind"] == "epoch"][-1]
    assert (last_epoch["step"], {"epoch/val_accuracy": last_epoch["val_accuracy"]}) == (
        metrics[-1][0], {k: v for k, v in metrics[-1][1].items() if k == "epoch/val_accuracy"})
    assert seen[-3:] == [("model", run.best_checkpoint.name, tiny_data.name), ("end", "finished"), ("close",)]
