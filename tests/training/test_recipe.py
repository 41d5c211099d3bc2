"""The one-cycle schedule restored from a checkpoint continues exactly where it stopped."""

import torch

from imgtrain.config import TrainConfig
from imgtrain.training.recipe import (
    one_cycle,
    optimizer_for,
    set_batchnorm_momentum,
    weight_average,
)


def trained_steps(optimizer, scheduler, n):
    lrs = []
    for _ in range(n):
        optimizer.step()
        scheduler.step()
        lrs.append((scheduler.get_last_lr()[0], optimizer.param_groups[0]["betas"]))
    return lrs


def test_a_restored_schedule_continues_the_lr_and_momentum_of_the_uninterrupted_one():
    cfg = TrainConfig(name="x", lr=0.01)
    model = torch.nn.Linear(3, 2)
    optimizer = optimizer_for(model, cfg)
    scheduler = one_cycle(optimizer, cfg, 20, None)
    trained_steps(optimizer, scheduler, 8)
    saved_sched, saved_opt = scheduler.state_dict(), optimizer.state_dict()
    expected = trained_steps(optimizer, scheduler, 12)

    again = optimizer_for(model, cfg)
    again.load_state_dict(saved_opt)
    resumed = one_cycle(again, cfg, 12, saved_sched)  # 12 steps left: the same cycle
    # Constructing OneCycleLR resets LR and betas to the cycle's start; the restored values win.
    assert again.param_groups[0]["betas"] == saved_opt["param_groups"][0]["betas"]
    assert again.param_groups[0]["lr"] == saved_opt["param_groups"][0]["lr"]
    assert trained_steps(again, resumed, 12) == expected


def test_more_epochs_than_the_saved_cycle_gets_a_fresh_cycle_over_the_steps_left():
    cfg = TrainConfig(name="x", lr=0.01)
    optimizer = optimizer_for(torch.nn.Linear(3, 2), cfg)
    scheduler = one_cycle(optimizer, cfg, 10, None)
    trained_steps(optimizer, scheduler, 10)
    longer = one_cycle(optimizer, cfg, 15, scheduler.state_dict())  # the run was extended
    assert longer.total_steps == 15


def _averaged_model_reference(model, decay):
    """The moving average as torch's AveragedModel computes it (what imgtrain used before
    issue 19): the replacement must give the same weights to the bit, so that runs and
    their resumption are unchanged."""
    from torch.optim.swa_utils import AveragedModel

    def update(averaged, current, num_averaged):
        if not torch.is_floating_point(averaged[0]):
            torch._foreach_copy_(averaged, current)
            return
        n = float(num_averaged)
        torch._foreach_lerp_(averaged, current, 1.0 - min(decay, (1.0 + n) / (10.0 + n)))

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def test_the_weight_average_equals_torchs_averaged_model_to_the_bit_and_keeps_no_tensor_count():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ours, reference = weight_average(model, 0.9), _averaged_model_reference(model, 0.9)
    for _ in range(25):  # past the warm-up: (1 + n) / (10 + n) reaches 0.9 at n = 80, so both regimes
        model(torch.randn(8, 1, 8, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ours.update()
        reference.update_parameters(model)
    assert ours.steps == 25
    expected = reference.module.state_dict()
    for name, value in ours.module.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert type(ours.steps) is int  # a host integer: reading it never waits for a GPU


def test_a_short_decay_reaches_its_configured_value_after_the_warm_up():
    model = torch.nn.Linear(1, 1, bias=False)
    ema = weight_average(model, 0.5)
    with torch.no_grad():
        model.weight.fill_(0.0)
        ema.update()  # the first update copies
        for _ in range(20):  # (1 + n) / (10 + n) > 0.5 from n = 9: plain halving from there
            ema.update()
        model.weight.fill_(1.0)
        ema.update()
    assert ema.module.weight.item() == 0.5


def test_batchnorm_momentum_is_the_runs_for_every_layer_and_0_keeps_the_models_own():
    from torchvision.models import mobilenet_v3_small

    net = mobilenet_v3_small(num_classes=10)
    assert {m.momentum for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.01}  # torchvision's
    set_batchnorm_momentum(net, 0)
    assert {m.momentum for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.01}
    set_batchnorm_momentum(net, TrainConfig(name="x").bn_momentum)
    assert {m.momentum for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.1}
