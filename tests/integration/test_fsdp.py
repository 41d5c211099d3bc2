"""Sharded training (``--strategy fsdp``) on a real Ray cluster, 2 CPU workers: the checkpoint's
plain model.pt serves every other command, FSDP trains exactly what DDP trains, and an
interrupted run resumes exactly (at the same world size) or from the resharded state (at another).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import imgtrain
from imgtrain import checkpoint as ckpt
from imgtrain import runs
from imgtrain.config import TrainConfig
from imgtrain.inference.batch import InferenceOptions, evaluate
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.zoo import build_from_args
from tests.conftest import assert_one_line_error, quiet_display, run_cli
from tests.integration.test_resume import global_batches

pytestmark = pytest.mark.integration

QUIET = quiet_display()
# 256 rows / batch 16 = 16 steps per epoch, 32 in all; step checkpoints after global steps 8 and 24.
# Contiguous weights: FSDP2 shards no others, and validation's plain model then has the layout
# DDP's has (with --channels-last it is channels_last: the same weights, other rounding).
SETTINGS = dict(strategy="fsdp", channels_last=False, workers=2, epochs=2, batch_size=16, eval_batch_size=50, log_every_steps=4,
                checkpoint_every_steps=8, deterministic=True, ledger=True, max_failures=0)
HISTORY_KEYS = ("epoch", "step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr")


def config(data, storage, name, **overrides) -> TrainConfig:
    return TrainConfig(data=str(data), storage=str(storage), name=name, **{**SETTINGS, **overrides})


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_data, tmp_path_factory):
    """The uninterrupted FSDP run."""
    storage = tmp_path_factory.mktemp("fsdp")
    result = imgtrain.train(config(tiny_data, storage, "ref"), display=QUIET)
    assert result.status == "finished"
    return result, storage


def history(run_dir) -> list[dict]:
    return [{k: r[k] for k in HISTORY_KEYS} for r in runs.epoch_history(run_dir)]


def final_model(run_dir) -> dict:
    _, latest = ckpt.best_and_latest(run_dir)
    assert latest.name == "checkpoint_epoch_0001"
    return ckpt.load_model_state(latest)


def bit_equal(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_holds_a_plain_model_and_every_ranks_verified_shards(reference):
    result, storage = reference
    checkpoint = result.latest_checkpoint
    meta = ckpt.verify(checkpoint)
    shards = sorted(name for name in meta["sha256"] if name.startswith(ckpt.SHARDED_DIR + "/"))
    assert shards == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]  # both ranks' files
    state = ckpt.load_train_state(checkpoint)
    assert ckpt.OPTIMIZER_KEY not in state and ckpt.TRAIN_WEIGHTS_KEY not in state  # in the shards instead

    # The tutorial's own inference code loads model.pt into the unwrapped model.
    plain = build_from_args(meta["model_args"])
    plain.load_state_dict(torch.load(checkpoint / ckpt.MODEL_FILE, weights_only=True))
    ev = evaluate("ref", "latest", storage=str(storage), options=InferenceOptions(backend="local"))
    assert ev.num_samples == 100
    assert ev.accuracy == meta["metrics"]["val_accuracy"]  # what validation saw during training

    # A damaged shard fails the checkpoint's verification, naming the file.
    shard = checkpoint / "sharded" / "__1_0.distcp"
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(ckpt.CheckpointError, match="__1_0.distcp fails its sha256"):
            ckpt.verify(checkpoint)
    finally:
        shard.write_bytes(original)


def test_fsdp_trains_exactly_what_ddp_trains(reference, tiny_data, tmp_path):
    # Both with contiguous weights (SETTINGS). With two ranks FSDP's reduce-scatter and DDP's
    # all-reduce give the same mean gradient to the bit (the sum of two numbers, halved).
    result, _ = reference
    ddp = imgtrain.train(config(tiny_data, tmp_path, "ddp", strategy="ddp", ledger=False),
                         display=QUIET)
    assert history(ddp.path) == history(result.path)
    assert bit_equal(final_model(ddp.path), final_model(result.path))


def test_an_interrupted_fsdp_run_resumes_to_the_same_bits(reference, tiny_data, tmp_path, monkeypatch):
    # Rank 1 raises before global step 27; Ray Train restarts both workers from the step-24
    # checkpoint, whose sharded state they load.
    result, _ = reference
    monkeypatch.setenv(FAULT_ENV, "raise:1:27")
    retried = imgtrain.train(config(tiny_data, tmp_path, "retry", max_failures=1), display=QUIET)
    assert retried.status == "finished"
    assert (retried.path / ".faults" / "raise-1-27-1").is_file()  # the fault really fired
    starts = [(r["step"], r["epoch_step"]) for r in runs.read_metrics(retried.path) if r["kind"] == "start"]
    assert starts == [(0, 0), (24, 8)]
    assert global_batches(retried.path) == global_batches(result.path)
    assert history(retried.path) == history(result.path)
    assert bit_equal(final_model(retried.path), final_model(result.path))


def test_a_failed_fsdp_run_resumes_on_one_worker_from_the_resharded_state(reference, tiny_data, tmp_path, ray_cluster):
    result, _ = reference
    args = ["train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "grow", "--strategy", "fsdp",
            "--workers", "2", "--epochs", "2", "--batch-size", "16", "--checkpoint-every-steps", "8",
            "--no-channels-last", "--deterministic", "--ledger", "--log-every-steps", "4", "--eval-batch-size", "50",
            "--address", ray_cluster]
    failed = subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, FAULT_ENV: "raise:0:27", "COLUMNS": "200"})
    assert failed.returncode != 0
    assert "resumes from checkpoint_epoch_0001_step_0000024" in failed.stderr.strip().splitlines()[-1]

    again = run_cli(*args, "--workers", "1")  # the 2-rank shards loaded into 1 rank
    assert again.returncode == 0, again.stderr
    assert "resuming run 'grow' at epoch 2, step 24" in again.stdout
    assert global_batches(tmp_path / "grow") == global_batches(result.path)
    # Not the same numbers after the resume: BatchNorm now normalises over the 16 rows of a batch
    # on one rank, not 8 on each of two, so the forward pass itself differs (DDP alike). Epoch 0
    # comes back from the checkpoint unchanged, and epoch 1 continues the restored model: its
    # loss stays near the 2-worker run's (a model restarted from scratch would be near ln 10).
    grown, ref = history(tmp_path / "grow"), history(result.path)
    assert grown[0] == ref[0]
    print("train loss of epoch 1, resumed on 1 worker / 2 workers:", grown[1]["train_loss"], ref[1]["train_loss"])
    assert abs(grown[1]["train_loss"] - ref[1]["train_loss"]) < 0.3

    # A resumed run keeps its strategy.
    changed = run_cli("train", "--name", "grow", "--storage", str(tmp_path), "--strategy", "ddp", "--epochs", "3")
    assert_one_line_error(changed, "strategy: 'fsdp' -> 'ddp'")


def test_another_model_in_bfloat16(ray_cluster, tiny_data, tmp_path):
    # MobileNet-V3's blocks are the entries of its `features`; bf16 gathers them in bfloat16
    # and keeps BatchNorm in float32 (its own FSDP unit).
    result = imgtrain.train(config(tiny_data, tmp_path, "mn", model="mobilenet_v3_small", precision="bf16",
                                   channels_last=True, epochs=1, limit_train_batches=4, checkpoint_every_steps=0, ledger=False),
                            display=QUIET)
    assert result.status == "finished"
    meta = ckpt.verify(result.latest_checkpoint)
    assert meta["model_args"]["architecture"] == "mobilenet_v3_small"
    state = ckpt.load_model_state(result.latest_checkpoint)
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    ev = evaluate("mn", storage=str(tmp_path), options=InferenceOptions(backend="local"))
    assert ev.accuracy == meta["metrics"]["val_accuracy"]
