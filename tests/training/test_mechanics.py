"""The mechanics of a training step (issue 36, part 4): gradient accumulation gives the whole
batch's gradient and exchanges gradients once per step (DDP and FSDP2), clipping bounds the norm
and records it, fp16's gradient scaler skips overflowing steps and is checkpointed (exact resume),
drop path and activation checkpointing reach the model or are refused with one line.

Everything runs in this process (the local backend, or a real gloo group of one for DDP and FSDP).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from imgtrain.config import TrainConfig, validate
from imgtrain.data.format import load_manifest, read_split
from imgtrain.data.order import ordered_batches, sort_by_id
from imgtrain.errors import ImgtrainError
from imgtrain.models.zoo import build_from_args, drop_path_rates
from imgtrain.training import loop
from imgtrain.training.backend import Backend, single_process_collectives
from tests.conftest import assert_one_line_error, cli_here, quiet_display, tiny_config

CPU = torch.device("cpu")
SMALL_TIMM = "timm:test_resnet"  # 0.4 M parameters, with drop path and activation checkpointing; BatchNorm


class _nothing_to_restore:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def ready_run(data, prepare=lambda m: m.to(CPU), **settings):
    """A Run set up by the real ``loop.setup`` on the tiny data, and its first batch and affines."""
    cfg = TrainConfig(**{"name": "mech", "data": str(data), "batch_size": 32, "ema_decay": 0.0, **settings})
    manifest = load_manifest(data)
    rows = sort_by_id(*map(torch.from_numpy, read_split(data, "train")))
    backend = Backend(
        rank=0, world_size=1, device=CPU, prepare_model=prepare,
        train_batches=ordered_batches(rows, cfg.seed, cfg.batch_size, 4, 1, 0, CPU, on_device=True),
        val_batches=lambda: iter(()), restored_checkpoint=_nothing_to_restore, report=lambda *a: None,
        send=lambda record: None, **single_process_collectives(),
    )
    run, _ = loop.setup(cfg, manifest, backend)
    return run, iter(backend.train_batches(0, 0)), loop.epoch_affines(run, 0)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return {n: full(p.grad).clone() for n, p in model.named_parameters()}


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def one_step(data, accumulate, batch_size=32, prepare=lambda m: m.to(CPU), **settings):
    """Gradients, returned loss and correct count, and weights after one SGD step with BatchNorm in
    evaluation mode (running statistics): then the pieces' BatchNorm sees what the whole batch's sees."""
    run, batches, affines = ready_run(data, prepare, accumulate=accumulate, batch_size=batch_size, optimizer="sgd",
                                      **settings)
    run.model.eval()
    loss, correct, norm = loop.train_step(run, next(batches), affines[0])
    return gradients(run.model), loss, correct, weights(run.model), norm


# Float tolerance: the pieces' gradients are float32 sums in another order than the whole
# batch's. Measured here: at most about 1e-7 absolute (largest gradients about 0.1).
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


@pytest.mark.parametrize("batch_size, settings", [
    (32, {}),
    (30, {}),  # pieces of 8, 8, 7 and 7
    (32, {"cutmix": 1.0, "label_smoothing": 0.1}),  # the share is mixed whole (soft targets), then cut
])
def test_four_accumulated_pieces_give_the_gradient_and_the_step_of_the_whole_batch(tiny_data, batch_size, settings):
    from imgtrain.training import mixing

    assert (mixing.draw(TrainConfig(name="x", **settings), 0, 0, 28, 28) is None) == (not settings)
    whole = one_step(tiny_data, 1, batch_size, **settings)
    pieces = one_step(tiny_data, 4, batch_size, **settings)
    for name, grad in whole[0].items():
        torch.testing.assert_close(pieces[0][name], grad, **TOLERANCE, msg=name)
    assert any(g.abs().max() > 1e-3 for g in whole[0].values())  # real gradients, not zeros
    torch.testing.assert_close(pieces[1], whole[1], rtol=1e-6, atol=0)  # the summed loss
    assert int(pieces[2]) == int(whole[2])  # correct predictions over the whole share
    for name, w in whole[3].items():
        torch.testing.assert_close(pieces[3][name], w, **TOLERANCE, msg=name)


def test_with_batchnorm_in_training_the_pieces_normalise_by_their_own_statistics(tiny_data):
    """What docs/training.md says: BatchNorm sees the smaller pieces, so the gradient differs."""
    def step(accumulate):
        run, batches, affines = ready_run(tiny_data, accumulate=accumulate, optimizer="sgd")
        loop.train_step(run, next(batches), affines[0])
        return gradients(run.model)

    whole, pieces = step(1), step(4)
    assert not torch.allclose(pieces["conv1.weight"], whole["conv1.weight"], **TOLERANCE)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_accumulates_without_exchanging_gradients_until_the_last_piece(tiny_data, world_of_one):
    """The all-reduce of every bucket happens once per optimizer step (``no_sync`` for the first
    pieces), counted with a DDP communication hook; the gradient is the whole batch's."""
    def step(accumulate):
        calls = []

        def prepare(model):
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(model.to(CPU))

            def counting_hook(state, bucket):
                calls.append(bucket.index())
                future = torch.futures.Future()
                future.set_result(bucket.buffer())
                return future

            ddp.register_comm_hook(None, counting_hook)
            return ddp

        grads = one_step(tiny_data, accumulate, prepare=prepare)[0]
        return grads, calls

    (whole, whole_calls), (pieces, piece_calls) = step(1), step(4)
    assert whole_calls and sorted(piece_calls) == sorted(whole_calls)
    for name, grad in whole.items():
        torch.testing.assert_close(pieces[name], grad, **TOLERANCE, msg=name)


def test_fsdp_accumulates_into_the_same_sharded_gradient(tiny_data, world_of_one):
    from imgtrain.training import fsdp

    def shard(model):
        return fsdp.shard(model, CPU, "fp32")

    whole, pieces = one_step(tiny_data, 1, prepare=shard), one_step(tiny_data, 4, prepare=shard)
    for name, grad in whole[0].items():
        torch.testing.assert_close(pieces[0][name], grad, **TOLERANCE, msg=name)
    for name, w in whole[3].items():
        torch.testing.assert_close(pieces[3][name], w, **TOLERANCE, msg=name)


def test_more_pieces_than_a_workers_share_is_refused_in_one_line(capsys, tiny_data, tmp_path):
    with pytest.raises(ImgtrainError, match=r"--accumulate 17 .* 16 samples"):
        validate(TrainConfig(name="x", batch_size=32, workers=2, accumulate=17))
    validate(TrainConfig(name="x", batch_size=32, workers=2, accumulate=16))
    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "x",
                    "--backend", "local", "--batch-size", "8", "--accumulate", "9")
    assert_one_line_error(proc, "--accumulate 9")


def test_clipping_bounds_the_norm_and_returns_the_norm_before_it(tiny_data):
    free, _, _, _, no_norm = one_step(tiny_data, 1)
    clipped, _, _, _, norm = one_step(tiny_data, 1, clip_grad_norm=0.05)
    assert no_norm is None
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in free.values()]))
    assert expected > 0.1  # the limit really clips
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    after = torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped.values()]))
    assert after == pytest.approx(0.05, rel=1e-4)
    for name, g in free.items():  # the same direction, scaled
        torch.testing.assert_close(clipped[name], g * (0.05 / expected), rtol=1e-4, atol=1e-8, msg=name)


def test_clipping_sharded_gradients_gives_what_plain_ones_give(tiny_data, world_of_one):
    from imgtrain.training import fsdp

    plain = one_step(tiny_data, 1, clip_grad_norm=0.05)
    sharded = one_step(tiny_data, 1, prepare=lambda m: fsdp.shard(m, CPU, "fp32"), clip_grad_norm=0.05)
    assert type(sharded[4]) is torch.Tensor  # a plain tensor on every rank, fit for a record
    torch.testing.assert_close(sharded[4], plain[4], rtol=1e-5, atol=0)
    for name, g in plain[0].items():
        torch.testing.assert_close(sharded[0][name], g, **TOLERANCE, msg=name)


@pytest.mark.parametrize("sharded", [False, True])
def test_an_overflowing_fp16_step_leaves_the_weights_and_lowers_the_scale(tiny_data, world_of_one, sharded):
    """Also on FSDP2's DTensor gradients, whose overflow check DTensor reduces over the ranks."""
    from imgtrain.training import fsdp

    prepare = (lambda m: fsdp.shard(m, CPU, "fp16")) if sharded else (lambda m: m.to(CPU))
    run, batches, affines = ready_run(tiny_data, prepare, model=SMALL_TIMM, precision="fp16")
    run.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)  # float16 activation gradients overflow
    before, lr_step = weights(run.model), run.scheduler.last_epoch
    loop.train_step(run, next(batches), affines[0])
    assert run.scaler.get_scale() == 2.0 ** 99
    assert all(torch.equal(w, weights(run.model)[n]) for n, w in before.items())
    assert not run.optimizer.state  # AdamW never stepped: no moments, no step count
    assert run.step == 1 and run.scheduler.last_epoch == lr_step + 1  # the schedule still advances
    run.scaler.update(2.0 ** 10)  # a scale that fits: the weights move
    loop.train_step(run, next(batches), affines[1])
    assert run.scaler.get_scale() == 2.0 ** 10
    assert run.optimizer.state and not torch.equal(before["fc.weight"], weights(run.model)["fc.weight"])


def run_records(result) -> list[dict]:
    return [json.loads(line) for line in (result.path / "metrics.jsonl").read_text().splitlines()]


def test_an_fp16_run_learns_on_the_cpu_and_records_its_scale_and_gradient_norm(tiny_data, tmp_path):
    import imgtrain

    cfg = tiny_config(tiny_data, tmp_path, "fp16", backend="local", workers=1, model=SMALL_TIMM, precision="fp16",
                      clip_grad_norm=5.0, accumulate=2, epochs=3, limit_train_batches=4, log_every_steps=1,
                      bn_calibration=0, ema_decay=0.0, lr=1e-2)
    result = imgtrain.train(cfg, display=quiet_display())
    assert result.status == "finished"
    losses = [e["train_loss"] for e in result.history]
    assert losses[-1] < losses[0] - 0.2, losses
    steps = [r for r in run_records(result) if r.get("kind") == "step"]
    assert steps and all(r["loss_scale"] > 0 for r in steps)
    assert all(r["grad_norm"] is None or r["grad_norm"] > 0 for r in steps)
    assert any(r["grad_norm"] for r in steps)


@pytest.mark.parametrize("options", [{}, {"accumulate": 3, "clip_grad_norm": 1.0, "grad_checkpointing": True}])
def test_an_fp16_run_resumed_from_a_step_checkpoint_ends_as_the_uninterrupted_one(tiny_data, tmp_path, monkeypatch,
                                                                                   options):
    """The scaler's state is in the checkpoint: the first steps of this run overflow at the
    initial scale, so a resume that started the scaler afresh would skip steps the
    uninterrupted run took. With every other option of this module on, exact resume holds too."""
    import imgtrain
    from imgtrain.storage import checkpoint as ckpt
    from imgtrain.training.faults import ENV_VAR

    def train(name):
        cfg = tiny_config(tiny_data, tmp_path, name, backend="local", workers=1, model=SMALL_TIMM, precision="fp16",
                          epochs=1, limit_train_batches=6, checkpoint_every_steps=3, deterministic=True,
                          bn_calibration=0, drop_path=0.1, **options)
        return imgtrain.train(cfg, display=quiet_display())

    reference = train("whole")
    monkeypatch.setenv(ENV_VAR, "raise:0:4")
    with pytest.raises(Exception, match="injected fault"):
        train("cut")
    monkeypatch.delenv(ENV_VAR)
    if not options:
        step3 = next((tmp_path / "cut").glob("*_step_0000003"))
        assert ckpt.load_train_state(step3)[ckpt.GRAD_SCALER_KEY]["scale"] < 2.0 ** 16  # it did overflow
    resumed = train("cut")
    assert resumed.status == "finished"
    final = [ckpt.load_model_state(r.path / r.history[-1]["checkpoint"]) for r in (reference, resumed)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    states = [ckpt.load_train_state(r.path / r.history[-1]["checkpoint"]) for r in (reference, resumed)]
    assert states[0][ckpt.GRAD_SCALER_KEY] == states[1][ckpt.GRAD_SCALER_KEY]


ARGS = {"in_channels": 1, "num_classes": 10}


@pytest.mark.parametrize("name, size", [(SMALL_TIMM, None), ("convnext_tiny", [32, 32])])
def test_drop_path_sets_the_models_stochastic_depth(name, size):
    args = {"architecture": name, **ARGS, **({"image_size": size} if size else {})}
    rates = drop_path_rates(build_from_args(args, drop_path=0.3))
    assert rates and max(rates) == pytest.approx(0.3)  # the deepest block; earlier ones less
    assert max(drop_path_rates(build_from_args(args)), default=0.0) != pytest.approx(0.3)  # unset: the model's own


def test_drop_path_leaves_what_evaluation_loads(tiny_data):
    """Not part of model_args: the weights of a model trained with it load into the model
    evaluation rebuilds, and it computes the same there."""
    args = {"architecture": SMALL_TIMM, **ARGS}
    trained, plain = build_from_args(args, drop_path=0.3).eval(), build_from_args(args).eval()
    plain.load_state_dict(trained.state_dict())  # strict: the same tensors
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(trained(x), plain(x))


@pytest.mark.parametrize("flag", [("--drop-path", "0.1"), ("--grad-checkpointing",)])
def test_a_model_without_it_is_refused_in_one_line(capsys, tiny_data, tmp_path, flag):
    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "x",
                    "--backend", "local", *flag)  # the default model, imgtrain's resnet18
    assert_one_line_error(proc, "resnet18", flag[0])
    with pytest.raises(ValueError, match="dla34 .*" + flag[0]):  # a timm model without it
        build_from_args({"architecture": "timm:dla34", **ARGS}, drop_path=0.1 if len(flag) > 1 else None,
                        grad_checkpointing=len(flag) == 1)


def test_grad_checkpointing_is_enabled_and_a_step_trains(tiny_data, monkeypatch):
    import torch.utils.checkpoint

    run, batches, affines = ready_run(tiny_data, model=SMALL_TIMM, grad_checkpointing=True)
    assert run.model.grad_checkpointing
    calls, checkpoint = [], torch.utils.checkpoint.checkpoint
    before = weights(run.model)

    def counting(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)  # timm calls it through the module
    loss, _, _ = loop.train_step(run, next(batches), affines[0])
    assert calls and not any(calls)  # the blocks ran checkpointed, non-reentrant (fine with DDP and FSDP)  # the blocks ran checkpointed
    assert torch.isfinite(loss) and not torch.equal(before["fc.weight"], weights(run.model)["fc.weight"])
