"""imgtrain tune without a cluster: the search grammar, sweep files, concurrency arithmetic."""

from __future__ import annotations

import pytest
import torch
from ray import tune

from imgtrain.checkpoint_policy import POLICY
from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.sweep import space
from imgtrain.sweep.driver import check, request_from, trials_at_once


@pytest.mark.parametrize("text, name, func, args", [
    ("lr=loguniform(1e-4,1e-2)", "lr", "loguniform", (1e-4, 1e-2)),
    (" weight-decay = uniform( 0 , 0.1 ) ", "weight_decay", "uniform", (0.0, 0.1)),
    ("batch_size=randint(16,64)", "batch_size", "randint", (16, 64)),
    ("optimizer=choice(adamw, 'sgd')", "optimizer", "choice", ("adamw", "sgd")),
    ("augment=grid(true,false)", "augment", "grid", (True, False)),
    ("weight_decay=choice(0.01,0.05)", "weight_decay", "choice", (0.01, 0.05)),
    ("seed=grid(1, 2.0)", "seed", "grid", (1, 2)),
])
def test_expressions_parse_to_typed_dimensions(text, name, func, args):
    d = space.parse(text)
    assert (d.name, d.func, d.args) == (name, func, args)
    assert all(type(a) is type(b) for a, b in zip(d.args, args))


def test_dimensions_become_tune_domains_and_round_trip():
    lr = space.parse("lr=loguniform(1e-4,1e-2)")
    assert isinstance(lr.domain(), tune.search.sample.Float)
    assert (lr.domain().lower, lr.domain().upper) == (1e-4, 1e-2)
    # randint(a, b) includes b; Tune's upper bound does not
    assert space.parse("batch_size=randint(16,64)").domain().upper == 65
    assert space.parse("augment=grid(true,false)").domain() == {"grid_search": [True, False]}
    assert space.parse(lr.name + "=" + lr.text()) == lr


@pytest.mark.parametrize("text, fragment", [
    ("lr", "is not NAME=FUNC(ARGS)"),
    ("lr=loguniform(1e-4,1e-2", "is not NAME=FUNC(ARGS)"),
    ("learning_rate=uniform(0,1)", "'learning_rate' is not a training setting"),
    ("workers=choice(1,2)", "'workers' is not searched"),
    ("data=choice(a,b)", "'data' is not searched"),
    ("lr=normal(0,1)", "unknown function 'normal'"),
    ("lr=uniform(0.1)", "takes two bounds, got 1"),
    ("lr=uniform(0.2,0.1)", "lower bound must be below"),
    ("lr=loguniform(0,0.1)", "loguniform() needs bounds above 0"),
    ("lr=uniform(0.1,x)", "lr takes a finite number, got 'x'"),
    ("lr=uniform(0.1,inf)", "finite number"),
    ("lr=uniform(0.1,100)", "lr must be at most 10"),
    ("batch_size=uniform(8,64)", "use randint"),
    ("lr=randint(1,3)", "use choice"),
    ("batch_size=choice(8,1.5)", "batch_size takes an integer, got '1.5'"),
    ("optimizer=choice(adamw,adam)", "'adam' is not one of adamw, sgd"),
    ("augment=choice(yes,no)", "true or false"),
    ("lr=choice()", "needs at least one value"),
    ("lr=choice(0.1,0.1)", "lists a value twice"),
    ("lr=choice(0.1,,0.2)", "an argument is empty"),
    ("lr=choice(__import__('os'))", "plain values, not expressions"),
    ("model=choice('resnet18)", "quote is not closed"),
])
def test_bad_expressions_say_what_is_wrong(text, fragment):
    with pytest.raises(ImgtrainError) as e:
        space.parse(text)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_a_setting_searched_twice_is_refused():
    with pytest.raises(ImgtrainError, match="lr is searched twice"):
        space.parse_all(["lr=uniform(0.1,0.2)", "lr=choice(0.3)"])


def test_sweep_file_and_flags(tmp_path):
    f = tmp_path / "sweep.toml"
    f.write_text('data = "d"\nname = "s"\nepochs = 6\nworkers = 2\n'
                 '[search]\nlr = "loguniform(1e-4, 1e-2)"\nweight_decay = [0.01, 0.05]\n'
                 '[sweep]\ntrials = 8\nscheduler = "asha"\n')
    req = request_from(f, {"epochs": 3}, ["lr=uniform(0.001,0.002)"], {"trials": None, "metric": "val_loss"})
    assert (req.base.data, req.base.name, req.base.epochs, req.base.workers) == ("d", "s", 3, 2)  # flags win
    assert req.search["lr"] == space.Dimension("lr", "uniform", (0.001, 0.002))
    assert req.search["weight_decay"] == space.Dimension("weight_decay", "choice", (0.01, 0.05))
    assert (req.trials, req.scheduler, req.metric) == (8, "asha", "val_loss")
    assert check(req).mode == "min"  # a loss is minimised unless --mode says otherwise


def test_sweep_file_problems_are_named(tmp_path):
    f = tmp_path / "sweep.toml"
    f.write_text('epoch = 3\n[sweep]\ntrials = "8"\nwhen = 1\n')
    with pytest.raises(ImgtrainError) as e:
        request_from(f, {}, [], {})
    text = str(e.value)
    assert "unknown field 'epoch' (did you mean 'epochs'?)" in text
    assert "[sweep] trials must be an integer" in text and "unknown [sweep] key 'when'" in text


def test_request_checks_collect_every_problem():
    req = request_from(None, {"name": "s", "workers": 2, "min_workers": 1, "backend": "local", "epochs": 0},
                       [], {"trials": 0, "scheduler": "pbt", "metric": "accuracy"})
    with pytest.raises(ImgtrainError) as e:
        check(req)
    text = str(e.value)
    for fragment in ("nothing to search", "--trials must be at least 1", "--scheduler 'pbt'", "--metric 'accuracy'",
                     "drop --backend local", "not MIN-MAX", "--data is required", "--epochs must be at least 1"):
        assert fragment in text, fragment


def test_trials_at_once_fit_the_cluster():
    cfg = TrainConfig(workers=2)
    # 8 CPUs, one kept for Ray Data: 7 / 2.01 -> 3 trials of 2 workers
    assert trials_at_once(cfg, 8, 0, 2.01) == 3
    assert trials_at_once(cfg, 8, 0, 2.01, asked=2) == 2
    assert trials_at_once(TrainConfig(workers=2, ingest="torch"), 8, 0, 2.01) == 3  # 8 / 2.01
    assert trials_at_once(TrainConfig(workers=2, use_gpu=True), 64, 5, 2.01) == 2  # GPUs bind first
    with pytest.raises(ImgtrainError, match="one trial needs 2.01 CPUs .* the Ray cluster has 2 CPUs"):
        trials_at_once(cfg, 2, 0, 2.01)


def test_a_sweep_in_an_object_store_is_refused_in_one_message():
    from imgtrain.config import TrainConfig
    from imgtrain.errors import ImgtrainError
    from imgtrain.sweep.driver import SweepRequest, check
    from imgtrain.sweep.space import parse_all

    req = SweepRequest(base=TrainConfig(name="s", data="/tmp/d", storage="s3://bucket/runs"),
                       search=parse_all(["lr=loguniform(1e-4,1e-2)"]))
    with pytest.raises(ImgtrainError, match="local or shared storage"):
        check(req)


def test_a_stopped_trials_epochs_come_back_from_its_latest_whole_checkpoint(tmp_path):
    # Tune hears of an epoch once its checkpoint is reported; ASHA can stop the trial on that
    # result before rank 0's epoch record reaches the trial's metrics.jsonl (seen in CI).
    from types import SimpleNamespace

    from imgtrain.storage import checkpoint as ckpt
    from imgtrain.storage import ownership, runs
    from imgtrain.sweep import state as st
    from imgtrain.sweep.driver import _mark_stopped

    sweep_dir = tmp_path / "s"
    run_dir = sweep_dir / st.TRIALS_DIR / "trial-00001"
    run_dir.mkdir(parents=True)
    ownership.claim(run_dir)
    st.write(sweep_dir, {"trials": {"trial-00001": {"status": "stopped", "epochs_done": 1}}})
    runs.MetricsLog(run_dir).append({"kind": "start", "step": 0})
    epochs = [{"kind": "epoch", "epoch": e, "step": 4 * (e + 1), "val_accuracy": 0.1 + e,
               "checkpoint": POLICY.epoch_name(e)} for e in range(2)]
    for e, record in enumerate(epochs):
        ckpt.save(run_dir / record["checkpoint"], {"w": torch.zeros(2)}, {}, {
            "epoch": e, "step": record["step"], "metrics": record, ckpt.HISTORY_KEY: epochs[:e + 1]})
    with open(run_dir / epochs[1]["checkpoint"] / ckpt.MODEL_FILE, "ab") as f:
        f.write(b"torn")  # the newest is damaged: its record must not come back

    _mark_stopped(sweep_dir, SimpleNamespace(scheduler="asha", base=SimpleNamespace(epochs=2)))

    assert [(r["epoch"], r["recovered_from"]) for r in runs.epoch_history(run_dir)] == [(0, POLICY.epoch_name(0))]
    status = runs.read_status(run_dir)
    assert status["status"] == "stopped" and "ASHA after epoch 1 of 2" in status["reason"]
    _mark_stopped(sweep_dir, SimpleNamespace(scheduler="asha", base=SimpleNamespace(epochs=2)))
    assert len(runs.epoch_history(run_dir)) == 1  # once


def test_a_resumed_asha_sweep_judges_its_trials_against_the_epochs_recorded_before(tmp_path, monkeypatch):
    # Tune rebuilds the scheduler on a restore with empty rungs: a trial resumed after Ctrl-C was
    # trained to the end, its epoch-1 accuracy 0.07 against the finished trial's 0.95. Here the
    # restored scheduler is handed the trials as Tune hands them over: the finished one first.
    from ray.tune.schedulers import TrialScheduler

    from imgtrain.storage import ownership, runs
    from imgtrain.sweep.driver import Asha
    from imgtrain.sweep.trial import EPOCHS_DONE

    finished = tmp_path / "trial-00000"
    finished.mkdir()
    ownership.claim(finished)
    for e, accuracy in enumerate([0.95, 0.97]):
        runs.MetricsLog(finished).append({"kind": "epoch", "epoch": e, "step": 8 * (e + 1), "val_accuracy": accuracy})
    monkeypatch.setattr(Asha, "trials_dir", tmp_path)

    def restored() -> Asha:
        asha = Asha(2)
        asha.set_search_properties("val_accuracy", "max")
        for i in (0, 1):  # the resumed trial has no run yet, or one without an epoch: nothing to give
            asha.on_trial_add(None, _Trial(i))
        return asha

    weak = {EPOCHS_DONE: 1, "val_accuracy": 0.07}
    assert restored().on_trial_result(None, _Trial(1), weak) == TrialScheduler.STOP
    monkeypatch.setattr(Asha, "trials_dir", None)  # as before: nothing recorded reaches the rungs
    assert restored().on_trial_result(None, _Trial(1), weak) == TrialScheduler.CONTINUE


class _Trial:
    """What the scheduler reads of a Tune trial: its id, and its name (the run's folder)."""

    def __init__(self, i: int):
        self.trial_id, self.name = f"id{i}", f"trial-0000{i}"

    def __str__(self) -> str:
        return self.name
