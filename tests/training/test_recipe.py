"""The one-cycle schedule restored from a checkpoint continues exactly where it stopped."""

import torch

from imgtrain.config import TrainConfig
from imgtrain.training.recipe import one_cycle, optimizer_for


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
