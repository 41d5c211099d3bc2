"""LR schedules (onecycle, cosine, step, constant, with warm-up in epochs), the optimizers for
large batches (timm's LAMB and LARS) and layer-wise LR decay: the curves users set, the groups'
LR ratios, exact resumption, and one-line refusals of what cannot work."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import imgtrain
from imgtrain import config
from imgtrain.config import TrainConfig, validate
from imgtrain.errors import ImgtrainError
from imgtrain.models import zoo
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.faults import InjectedFault
from imgtrain.training.recipe import freeze, optimizer_for, parameter_groups, schedule_for
from tests.conftest import assert_one_line_error, cli_here, quiet_display, tiny_config

STEPS_PER_EPOCH = 4


def lrs(cfg: TrainConfig, total_steps: int, model: nn.Module | None = None, start: int = 0, saved=None,
        optimizer=None) -> list[list[float]]:
    """Every group's LR at every step from ``start`` to ``total_steps`` (the last: after the last step)."""
    optimizer = optimizer or optimizer_for(model or nn.Linear(2, 2), cfg)
    scheduler = schedule_for(optimizer, cfg, start, total_steps, STEPS_PER_EPOCH, saved)
    seen = []
    for _ in range(start, total_steps):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen + [[g["lr"] for g in optimizer.param_groups]]


@pytest.mark.parametrize("schedule", ["cosine", "step", "constant"])
def test_the_warm_up_rises_linearly_and_reaches_the_peak_at_the_first_step_after_it(schedule):
    cfg = TrainConfig(name="x", schedule=schedule, lr=0.4, warmup_epochs=1.5, epochs=5)
    curve = [lr for lr, in lrs(cfg, 5 * STEPS_PER_EPOCH)]
    warmup = 6  # 1.5 epochs of 4 steps
    assert curve[:warmup] == pytest.approx([0.4 * (s + 1) / (warmup + 1) for s in range(warmup)])
    assert curve[warmup] == 0.4
    assert max(curve) == 0.4


def test_cosine_falls_from_the_peak_to_the_floor_at_the_end_of_training():
    cfg = TrainConfig(name="x", schedule="cosine", lr=0.1, min_lr=1e-4, warmup_epochs=1, epochs=3)
    curve = [lr for lr, in lrs(cfg, 12)]
    after = curve[STEPS_PER_EPOCH:]  # from the peak at step 4 to the end (step 12)
    assert after[0] == 0.1 and after[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(after, after[1:]))
    assert after[4] == pytest.approx((0.1 + 1e-4) / 2)  # half-way: the middle of the cosine


def test_step_decays_by_the_rate_at_every_decay_epochs_boundary():
    cfg = TrainConfig(name="x", schedule="step", lr=1.0, decay_epochs=2, decay_rate=0.5, epochs=6)
    curve = [lr for lr, in lrs(cfg, 6 * STEPS_PER_EPOCH)]
    expected = [0.5 ** (step // (2 * STEPS_PER_EPOCH)) for step in range(6 * STEPS_PER_EPOCH + 1)]
    assert curve == pytest.approx(expected)
    assert curve[7] == 1.0 and curve[8] == 0.5  # the first step of epoch 2 is the first decayed


def test_constant_stays_at_the_peak_and_onecycle_stays_torchs_by_default():
    assert {lr for lr, in lrs(TrainConfig(name="x", schedule="constant", lr=0.3), 10)} == {0.3}
    # the default (onecycle, --warmup-fraction 0.15) is OneCycleLR exactly as before the other schedules
    cfg = TrainConfig(name="x", lr=0.01)
    optimizer = optimizer_for(nn.Linear(2, 2), cfg)
    reference = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[0.01], total_steps=20, pct_start=0.15)
    expected = []
    for _ in range(20):
        expected.append([optimizer.param_groups[0]["lr"]])
        optimizer.step()
        reference.step()
    assert lrs(cfg, 20)[:20] == expected


def test_warmup_epochs_replaces_the_one_cycle_warm_up_fraction():
    cfg = TrainConfig(name="x", lr=0.01, warmup_epochs=2, epochs=5)  # 8 of 20 steps, not 15 %
    curve = [lr for lr, in lrs(cfg, 20)]
    assert curve.index(max(curve)) == 8 and max(curve) == pytest.approx(0.01)  # as the other schedules
    assert all(a < b for a, b in zip(curve[:8], curve[1:9]))
    for warmup_epochs, total in [(0.25, 20), (0.1, 20), (2, 3), (2, 2)]:  # 1 step, none; fresh cycles after resuming
        curve = [lr for lr, in lrs(TrainConfig(name="x", lr=0.01, warmup_epochs=warmup_epochs, epochs=5), total)]
        assert 0 < max(curve) <= 0.01 * (1 + 1e-9)


@pytest.mark.parametrize("schedule", ["cosine", "step", "constant", "onecycle"])
def test_a_schedule_rebuilt_at_a_checkpointed_step_gives_the_uninterrupted_lrs_to_the_bit(schedule):
    # fine-tuning groups (the backbone at 0.1, frozen for the first epoch) and layer decay too
    cfg = TrainConfig(name="x", schedule=schedule, lr=0.02, warmup_epochs=1, min_lr=1e-4 * (schedule == "cosine"),
                      decay_epochs=1, epochs=5, backbone_lr_scale=0.1, freeze_backbone=1, layer_decay=0.5)
    torch.manual_seed(0)
    model = zoo.build_from_args(zoo.model_args({"channels": 1, "num_classes": 3, "image_shape": [8, 8, 1]},
                                               "resnet18", "standard"))
    optimizer = optimizer_for(model, cfg)
    scheduler = schedule_for(optimizer, cfg, 0, 20, STEPS_PER_EPOCH, None)

    def train(optimizer, scheduler, first, last):
        seen = []
        for step in range(first, last):
            freeze(optimizer, step < cfg.freeze_backbone * STEPS_PER_EPOCH)
            seen.append([g["lr"] for g in optimizer.param_groups])
            optimizer.step()
            scheduler.step()
        return seen

    train(optimizer, scheduler, 0, 7)
    saved_optimizer, saved_scheduler = optimizer.state_dict(), scheduler.state_dict()
    expected = train(optimizer, scheduler, 7, 20)

    again = optimizer_for(model, cfg)
    again.load_state_dict(saved_optimizer)
    resumed = schedule_for(again, cfg, 7, 20, STEPS_PER_EPOCH, saved_scheduler)
    assert train(again, resumed, 7, 20) == expected
    assert len(expected[0]) == 10  # the classifier, 8 blocks and the stem: each its own LR


def test_a_cosine_run_resumed_with_more_epochs_follows_the_longer_curve():
    cfg = TrainConfig(name="x", schedule="cosine", lr=0.1, warmup_epochs=1, epochs=4)
    longer = [lr for lr, in lrs(cfg, 24)]  # 6 epochs from the start
    assert [lr for lr, in lrs(cfg, 24, start=16)] == longer[16:]  # 4 epochs trained, then --epochs 6


def test_layer_decay_gives_each_block_a_factor_of_the_one_above_and_composes_with_the_backbone_scale():
    net = zoo.build_from_args(zoo.model_args({"channels": 1, "num_classes": 10, "image_shape": [28, 28, 1]},
                                             "resnet18", "standard"))
    cfg = TrainConfig(name="x", layer_decay=0.5, backbone_lr_scale=0.1, freeze_backbone=1)
    scale = {id(p): g["lr_scale"] for g in parameter_groups(net, cfg) for p in g["params"]}
    named = dict(net.named_parameters())
    assert scale[id(named["fc.weight"])] == scale[id(named["fc.bias"])] == 1.0
    blocks = [f"layer{stage}.{block}.conv1.weight" for stage in (4, 3, 2, 1) for block in (1, 0)]  # from the top
    assert [scale[id(named[n])] for n in blocks] == pytest.approx([0.1 * 0.5 ** k for k in range(1, 9)])
    assert scale[id(named["layer2.0.downsample.1.bias"])] == scale[id(named["layer2.0.conv1.weight"])]
    assert scale[id(named["conv1.weight"])] == scale[id(named["bn1.bias"])] == pytest.approx(0.1 * 0.5 ** 9)

    optimizer = optimizer_for(net, cfg)
    assert [g["lr_scale"] for g in optimizer.param_groups][0] == 1.0  # group 0, the LR logged: the classifier's
    schedule_for(optimizer, cfg, 0, 10, STEPS_PER_EPOCH, None)
    freeze(optimizer, True)  # every group but the classifier's holds still
    assert [g["lr"] > 0 for g in optimizer.param_groups] == [True] + [False] * 9


def test_layer_decay_on_a_timm_model_is_timms_own_grouping():
    timm_optim = pytest.importorskip("timm.optim")
    net = zoo.build_from_args(zoo.model_args({"channels": 3, "num_classes": 10, "image_shape": [32, 32, 3]},
                                             "timm:resnet18", "standard"))
    ours = {id(p): g["lr_scale"] for g in parameter_groups(net, TrainConfig(name="x", layer_decay=0.75))
            for p in g["params"]}
    theirs = {id(p): g["lr_scale"] for g in timm_optim.param_groups_layer_decay(net, layer_decay=0.75)
              for p in g["params"]}
    assert ours == pytest.approx(theirs) and len(set(theirs.values())) == 10


def test_layer_decay_is_refused_in_one_line_for_a_model_without_a_known_layer_order():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    with pytest.raises(ImgtrainError, match=r"^--layer-decay: tiny: Sequential has none of the block containers") as e:
        parameter_groups(net, TrainConfig(name="x", model="tiny", layer_decay=0.75))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_and_lars_are_timms_take_a_step_and_leave_biases_and_norms_undecayed(name):
    timm_optim = pytest.importorskip("timm.optim")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    cfg = TrainConfig(name="x", optimizer=name, lr=0.01, weight_decay=0.05, schedule="cosine", warmup_epochs=1)
    optimizer = optimizer_for(model, cfg)
    assert type(optimizer) is getattr(timm_optim, name.capitalize())
    decay = {id(p): g.get("weight_decay", optimizer.defaults["weight_decay"]) for g in optimizer.param_groups
             for p in g["params"]}
    assert [decay[id(p)] for p in model.parameters()] == [0.05, 0.0, 0.0, 0.05, 0.0]  # conv, bn w/b, fc w/b
    before = [p.detach().clone() for p in model.parameters()]
    scheduler = schedule_for(optimizer, cfg, 0, 8, STEPS_PER_EPOCH, None)
    model(torch.randn(8, 1, 8, 8)).logsumexp(1).mean().backward()
    optimizer.step()
    scheduler.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_and_lars_step_a_sharded_model_as_a_plain_one_and_resume_from_its_shards(world_of_one, tmp_path, name):
    # --strategy fsdp: the parameters are DTensors (here one process's shards); timm's global
    # gradient norm and trust ratios must work on them, with layer decay's groups, and their
    # state (LAMB keeps its step count in the groups) must come back from DCP's shards
    import copy

    from imgtrain.models.resnet18 import build_resnet18
    from imgtrain.training import fsdp

    pytest.importorskip("timm.optim")
    torch.manual_seed(0)
    plain = build_resnet18(1, 10)
    sharded = fsdp.shard(copy.deepcopy(plain), torch.device("cpu"), "fp32")
    cfg = TrainConfig(name="x", optimizer=name, layer_decay=0.7, schedule="cosine", warmup_epochs=1, lr=0.01)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([1, 2, 3, 4])

    def train(model, optimizer, scheduler, n):
        for _ in range(n):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    for model in (plain, sharded):
        optimizer = optimizer_for(model, cfg)
        scheduler = schedule_for(optimizer, cfg, 0, 10, 2, None)
        train(model, optimizer, scheduler, 3)
    got, expected = fsdp.full_state(sharded), plain.state_dict()
    assert not torch.equal(expected["conv1.weight"], build_resnet18(1, 10).conv1.weight)
    assert all(torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-7) for k in expected)

    fsdp.save_sharded(tmp_path / "sharded", sharded, optimizer, None)
    train(sharded, optimizer, scheduler, 2)
    expected = fsdp.full_state(sharded)
    again = fsdp.shard(build_resnet18(1, 10), torch.device("cpu"), "fp32")
    optimizer = optimizer_for(again, cfg)
    fsdp.load_sharded(tmp_path / "sharded", again, optimizer, None)
    train(again, optimizer, schedule_for(optimizer, cfg, 3, 10, 2, None), 2)
    got = fsdp.full_state(again)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_and_lars_state_survives_a_weights_only_checkpoint(tmp_path, name):
    pytest.importorskip("timm.optim")
    cfg = TrainConfig(name="x", optimizer=name, lr=0.01, schedule="constant")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def steps(optimizer, n):
        for _ in range(n):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    optimizer = optimizer_for(model, cfg)
    steps(optimizer, 2)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "state.pt")
    steps(optimizer, 3)
    expected = [p.detach().clone() for p in model.parameters()]
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    again = optimizer_for(model, cfg)
    again.load_state_dict(saved["optimizer"])
    steps(again, 3)
    assert all(torch.equal(a, b) for a, b in zip(expected, model.parameters()))


def test_lamb_without_timm_is_refused_with_the_extra_to_install(monkeypatch):
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImgtrainError, match=r"--optimizer lamb is timm's: pip install 'imgtrain\[timm\]'"):
        validate(TrainConfig(name="x", optimizer="lamb"))
    monkeypatch.setitem(__import__("sys").modules, "timm.optim", None)  # on a worker: the same line
    with pytest.raises(ImgtrainError, match=r"^--optimizer lars is timm's: pip install 'imgtrain\[timm\]'$"):
        optimizer_for(nn.Linear(2, 2), TrainConfig(name="x", optimizer="lars"))


def test_sgd_takes_the_momentum_setting_and_plain_sgd_without_it():
    sgd = optimizer_for(nn.Linear(2, 2), TrainConfig(name="x", optimizer="sgd"))
    assert (sgd.defaults["momentum"], sgd.defaults["nesterov"]) == (0.9, True)  # as before the setting
    plain = optimizer_for(nn.Linear(2, 2), TrainConfig(name="x", optimizer="sgd", momentum=0))
    assert (plain.defaults["momentum"], plain.defaults["nesterov"]) == (0, False)


@pytest.mark.parametrize("args, fragment", [
    (["--schedule", "step", "--min-lr", "1e-5"], "--min-lr is the cosine schedule's floor"),
    (["--schedule", "cosine", "--min-lr", "0.1", "--lr", "0.01"], "--min-lr 0.1 must be below --lr 0.01"),
    (["--warmup-epochs", "3", "--epochs", "3"], "--warmup-epochs 3 would warm up for all 3 epochs"),
    (["--schedule", "linear"], "--schedule 'linear' is not one of onecycle, cosine, step, constant"),
    (["--layer-decay", "1.5"], "--layer-decay must be at most 1"),
    (["--warmup-fraction", "0.3", "--warmup-epochs", "1"], "--warmup-fraction and --warmup-epochs both set"),
    (["--schedule", "cosine", "--warmup-fraction", "0.3"], "--warmup-fraction is the one-cycle schedule's"),
    (["--decay-rate", "0.5"], "--decay-rate is the step schedule's: use --schedule step"),
    (["--momentum", "0.8"], "--momentum is for --optimizer sgd or lars; adamw has betas"),
])
def test_bad_schedule_settings_are_refused_in_one_line(capsys, tmp_path, args, fragment):
    proc = cli_here(capsys, "train", "--name", "x", "--storage", str(tmp_path), "--backend", "local", *args)
    assert_one_line_error(proc, fragment)


def test_a_cosine_run_resumed_inside_an_epoch_trains_as_the_uninterrupted_one(tiny_data, tmp_path, monkeypatch):
    # 2 epochs of 4 steps; a step checkpoint after step 6 (epoch 1), the run fails before step 7.
    # MobileNet-V3: a fifth of ResNet-18's time here (its checkpoints are small), layer decay over
    # its ``features`` and classifier.
    settings = dict(model="mobilenet_v3_small", backend="local", workers=1, epochs=2, limit_train_batches=4, checkpoint_every_steps=3,
                    log_every_steps=1, deterministic=True, threads_per_worker=1, bn_calibration=0,
                    lr=0.01, schedule="cosine", warmup_epochs=0.5, min_lr=1e-4, layer_decay=0.8)
    reference = imgtrain.train(tiny_config(tiny_data, tmp_path, "ref", **settings), display=quiet_display())
    cut = tiny_config(tiny_data, tmp_path, "cut", **settings)
    monkeypatch.setenv(FAULT_ENV, "raise:0:7")
    with pytest.raises(InjectedFault):
        imgtrain.train(cut, display=quiet_display())
    monkeypatch.delenv(FAULT_ENV)
    resumed = imgtrain.train(cut, display=quiet_display())

    assert [r["step"] for r in runs.read_metrics(resumed.path) if r["kind"] == "start"] == [0, 6]

    def record(run_dir):
        steps = {r["step"]: (r["loss"], r["lr"]) for r in runs.read_metrics(run_dir) if r["kind"] == "step"}
        epochs = [(r["train_loss"], r["val_loss"], r["val_accuracy"], r["lr"]) for r in runs.epoch_history(run_dir)]
        return steps, epochs

    assert record(resumed.path) == record(reference.path)  # every step's loss and LR, every epoch's, to the bit
    steps, _ = record(reference.path)
    assert steps[2][1] == 0.01 * 0.8 ** 0 and math.isclose(steps[8][1], 1e-4)  # peak after warm-up, floor at the end
    final = [ckpt.load_model_state(ckpt.best_and_latest(path)[1]) for path in (reference.path, resumed.path)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


@pytest.mark.filterwarnings("ignore:The default weight initialization of GoogleNet:FutureWarning")
def test_layer_decay_for_a_torchvision_model_without_blocks_is_refused_before_training(capsys, tmp_path, tiny_data):
    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--name", "g", "--storage", str(tmp_path),
                    "--backend", "local", "--model", "googlenet", "--layer-decay", "0.75")
    assert_one_line_error(proc, "--layer-decay: googlenet: GoogLeNet has none of the block containers",
                          "drop --layer-decay or choose another model")
    assert not (tmp_path / "g").exists()
