"""``--batch-size auto`` (issue 50): on a CPU, the largest power of two whose step the memory
free to the process holds, estimated from one measured step; never one that then fails, and a
clear refusal when even one image does not fit. The memory limit is a real one: the child
process's address space (``ulimit -v``), which the estimator reads as free memory would be."""

from __future__ import annotations

import contextlib
import json
import resource

import pytest

from imgtrain.training import batch_fit

SMALL = "timm:test_resnet"
MODEL, STEM = "resnet18", "small"  # activations of about 1 MiB an image at 28x28: the memory binds before the data

@contextlib.contextmanager
def address_space(more_mib: float):
    """This process's address space limited (soft ``ulimit -v``) to what it maps now plus
    ``more_mib``, then put back. One torch thread meanwhile: a new thread's stack is address space."""
    import torch

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    resource.setrlimit(resource.RLIMIT_AS, (batch_fit._status_bytes("VmSize") + int(more_mib * 2**20), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        torch.set_num_threads(threads)


def fit_here(data, more_mib: float | None) -> dict:
    """The batch auto picks (under the limit), and one training step at it under the same limit."""
    import torch

    from imgtrain.config import TrainConfig
    from imgtrain.data.format import verify_dataset
    from imgtrain.errors import ImgtrainError

    manifest = verify_dataset(data)
    cfg = TrainConfig(data=str(data), name="fit", backend="local", workers=1, model=MODEL, stem=STEM, batch_size="auto")
    batch_fit._one_step(cfg, manifest, torch.device("cpu"), 2)  # torch's first-use mappings, made before the limit
    with address_space(more_mib) if more_mib is not None else contextlib.nullcontext():
        try:
            fit = batch_fit.fit(cfg, manifest)
        except ImgtrainError as e:
            return {"error": str(e)}
        batch_fit._one_step(cfg, manifest, torch.device("cpu"), fit.per_piece)  # the chosen size trains
    return {"batch": fit.batch_size, "limit": fit.limit, "detail": fit.detail}


def test_the_caps_are_powers_of_two_within_the_data_and_the_cap():
    from imgtrain.config import TrainConfig

    assert [batch_fit.power_below(n) for n in (0, 1, 3, 4, 1000)] == [0, 1, 2, 4, 512]
    local = TrainConfig(backend="local", workers=1)
    assert batch_fit.piece_cap(local, 256) == (32, "data")  # 8 steps an epoch at most 32
    assert batch_fit.piece_cap(local, 10**6) == (batch_fit.CAP, "cap")
    assert batch_fit.piece_cap(TrainConfig(workers=3, accumulate=2), 10**6) == (128, "cap")  # 128 x 6 <= 1024


@pytest.mark.integration
def test_auto_picks_what_the_memory_allows_that_size_trains_and_one_image_too_many_is_refused(tiny_data):
    tight = fit_here(tiny_data, 500)  # 500 MiB more address space (the model's fixed part is 213): fewer fit
    assert 1 <= tight.get("batch", 0) < 32 and tight.get("limit") == "memory", tight  # 32: the data's limit
    assert "address-space limit" in tight["detail"]
    refused = fit_here(tiny_data, 300)  # less than the model's fixed part and one image's share
    assert "error" in refused and "--batch-size auto: even a batch of 1 does not fit" in refused["error"], refused
    assert "\n" not in refused["error"]


@pytest.mark.integration
def test_a_run_with_batch_size_auto_records_the_batch_and_scales_the_lr(tiny_data, tmp_path):
    import imgtrain
    from imgtrain.config import TrainConfig
    from tests.conftest import quiet_display, tiny_config

    imgtrain.train(tiny_config(tiny_data, tmp_path, "fit", backend="local", workers=1, model=SMALL, epochs=1,
                               batch_size="auto", limit_train_batches=1, bn_calibration=0),
                   display=quiet_display())
    chosen = json.loads((tmp_path / "fit" / "config.json").read_text())
    assert chosen["batch_size"] == 32 and "MiB free" in chosen["batch_source"]
    assert chosen["lr"] == pytest.approx(TrainConfig.lr * (32 / 128) ** 0.5, rel=0.02)  # AdamW: square root
    assert chosen["lr_source"].startswith("scaled")


@pytest.mark.integration
def test_an_lr_given_with_batch_size_auto_is_kept_even_at_the_default_value(tiny_data, tmp_path, capsys):
    from imgtrain.config import TrainConfig
    from tests.conftest import cli_here

    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "given",
                    "--backend", "local", "--workers", "1", "--model", SMALL, "--epochs", "1", "--batch-size", "auto",
                    "--lr", str(TrainConfig.lr), "--limit-train-batches", "1", "--bn-calibration", "0")
    assert proc.returncode == 0, proc.stderr
    chosen = json.loads((tmp_path / "given" / "config.json").read_text())
    assert chosen["batch_size"] == 32  # not the recipe's 128: scaling would have changed the LR
    assert (chosen["lr"], chosen["lr_source"]) == (TrainConfig.lr, "given")


@pytest.mark.integration
def test_the_batch_is_fitted_before_lr_auto_has_found_the_lr(tiny_data):
    # --lr auto --batch-size auto: the batch is fitted first, while the LR is still "auto"
    from imgtrain.config import AUTO_LR, TrainConfig
    from imgtrain.data.format import verify_dataset

    cfg = TrainConfig(data=str(tiny_data), name="x", backend="local", workers=1, model="timm:test_resnet",
                      lr=AUTO_LR, threads_per_worker=1)
    assert batch_fit.fit(cfg, verify_dataset(tiny_data)).batch_size >= 1
