"""Sharded training (``--strategy fsdp``) on a real Ray cluster, 2 CPU workers: the checkpoint's
plain model.pt serves every other command, FSDP trains exactly what DDP trains, and a failed
run resumes exactly (at the same world size) or from the resharded state (at another).

Four runs of one config serve every test: the DDP run, the FSDP run that fails inside its
second epoch, and that failed run resumed on 2 workers and on 1. The resumed FSDP run is
compared with the uninterrupted DDP run bit for bit: its epoch 0 was trained before the failure,
so that one comparison proves FSDP trains what DDP trains and that the resume lost nothing.
Ray Train's own retry of a failed worker group (the same restore, started by Ray) is proved in
test_resume.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import imgtrain
from imgtrain.checkpoint_policy import POLICY
from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.inference.batch import InferenceOptions, evaluate
from imgtrain.models.zoo import build_from_args
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.progress import TrainingDisplay
from tests.conftest import assert_one_line_error, cli_here, quiet_display
from tests.integration.ledger import global_batches
from tests.integration.test_train import assert_a_two_worker_run

pytestmark = pytest.mark.integration

QUIET = quiet_display()
# 256 rows / batch 32 = 8 steps per epoch, 16 in all; step checkpoints after global steps 4 and 12.
# Two epochs: a resume inside the second one has a whole epoch to restore and one to finish.
# Contiguous weights: FSDP2 shards no others, and validation's plain model then has the layout
# DDP's has (with --channels-last it is channels_last: the same weights, other rounding).
# The torch DataLoader's ingest: what is proved is the sharding, and Ray Data's start-up costs
# each of the five fits seconds (Ray Data ingest is proved in test_train, test_resume, test_streamed).
# timm's test ResNet (0.4 M parameters, BatchNorm, blocks in stages as ResNet-18's): what is proved
# is the sharding and its checkpoints, and ResNet-18's 135 MB checkpoints cost the four fits 40 s.
SETTINGS = dict(strategy="fsdp", channels_last=False, workers=2, epochs=2, batch_size=32, eval_batch_size=50, ingest="torch",
                log_every_steps=4, checkpoint_every_steps=4, deterministic=True, ledger=True, max_failures=0,
                model="timm:test_resnet", threads_per_worker=1)
HISTORY_KEYS = ("epoch", "step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr")


def config(data, storage, name, **overrides) -> TrainConfig:
    return TrainConfig(data=str(data), storage=str(storage), name=name, **{**SETTINGS, **overrides})


@pytest.fixture(scope="module")
def ddp(ray_cluster, tiny_data, tmp_path_factory):
    """The uninterrupted run, with DDP: what every FSDP run here must reproduce. Its epochs'
    checkpoints only: saving one changes nothing of the training."""
    result = imgtrain.train(config(tiny_data, tmp_path_factory.mktemp("ddp"), "ddp", strategy="ddp",
                                   checkpoint_every_steps=0), display=QUIET)
    assert result.status == "finished"
    return result


@pytest.fixture(scope="module")
def failed(ray_cluster, tiny_data, tmp_path_factory):
    """The FSDP run failed by rank 0 raising before global step 13, no retries left: its latest
    checkpoint is the step-12 one, both ranks' shards. ``(storage, what the failure said)``;
    each resume works on a copy (``resumable_copy``)."""
    storage = tmp_path_factory.mktemp("fsdp-failed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULT_ENV, "raise:0:13")
        with pytest.raises(ImgtrainError) as failure:
            imgtrain.train(config(tiny_data, storage, "cut"), display=QUIET)
    assert (storage / "cut" / ".faults" / "raise-0-13-1").is_file()  # the fault really fired
    return storage, str(failure.value)


def resumable_copy(failed, dest):
    """A copy of the failed run in ``dest``; returns ``dest``, its storage."""
    shutil.copytree(failed[0] / "cut", dest / "cut", symlinks=True)
    return dest


@pytest.fixture(scope="module")
def resumed(failed, tiny_data, tmp_path_factory):
    """The failed run resumed as it was, 2 workers: finished, its checkpoints those of an FSDP run."""
    storage = resumable_copy(failed, tmp_path_factory.mktemp("fsdp-resumed"))
    result = imgtrain.train(config(tiny_data, storage, "cut"), display=QUIET)
    assert result.status == "finished"
    return result, storage


def history(run_dir) -> list[dict]:
    return [{k: r[k] for k in HISTORY_KEYS} for r in runs.epoch_history(run_dir)]


def final_model(run_dir) -> dict:
    _, latest = ckpt.best_and_latest(run_dir)
    assert latest.name == POLICY.epoch_name(1)
    return ckpt.load_model_state(latest)


def bit_equal(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_ddp_reference_is_a_whole_two_worker_run_fed_by_the_torch_dataloader(ddp):
    # The suite's 2-worker run with the torch DataLoader's ingest (test_train's ``ray_run`` has Ray Data's)
    assert ddp.config["ingest"] == "torch" and ddp.config["workers"] == 2
    assert_a_two_worker_run(ddp, ddp.path, architecture="timm:test_resnet")


def test_the_checkpoint_holds_a_plain_model_and_every_ranks_verified_shards(resumed):
    result, storage = resumed
    checkpoint = result.latest_checkpoint
    meta = ckpt.verify(checkpoint)
    shards = sorted(name for name in meta["sha256"] if name.startswith(ckpt.SHARDED_DIR + "/"))
    assert shards == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]  # both ranks' files
    state = ckpt.load_train_state(checkpoint)
    assert ckpt.OPTIMIZER_KEY not in state and ckpt.TRAIN_WEIGHTS_KEY not in state  # in the shards instead

    # The tutorial's own inference code loads model.pt into the unwrapped model.
    plain = build_from_args(meta["model_args"])
    plain.load_state_dict(torch.load(checkpoint / ckpt.MODEL_FILE, weights_only=True))
    ev = evaluate("cut", "latest", storage=str(storage), options=InferenceOptions(backend="local"))
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


def test_fsdp_trains_exactly_what_ddp_trains_and_a_failed_run_resumes_to_the_same_bits(ddp, failed, resumed):
    # Both with contiguous weights (SETTINGS). With two ranks FSDP's reduce-scatter and DDP's
    # all-reduce give the same mean gradient to the bit (the sum of two numbers, halved). The
    # resume loaded both ranks' sharded state at the same world size. What the failure says is
    # the library's (the CLI prints any ImgtrainError as its one "error:" line).
    result, _ = resumed
    assert "rank 0: InjectedFault" in failed[1] and "resumes from checkpoint_epoch_0001_step_0000012 " in failed[1]
    starts = [(r["step"], r["epoch_step"]) for r in runs.read_metrics(result.path) if r["kind"] == "start"]
    assert starts == [(0, 0), (12, 4)]
    assert global_batches(result.path) == global_batches(ddp.path)
    assert history(result.path) == history(ddp.path)
    assert bit_equal(final_model(result.path), final_model(ddp.path))


def test_a_failed_fsdp_run_resumes_on_one_worker_from_the_resharded_state(ddp, failed, tiny_data, tmp_path, capsys):
    storage = resumable_copy(failed, tmp_path)
    # the 2 ranks' shards loaded into 1 rank; a display that prints, to read what it says
    again = imgtrain.train(config(tiny_data, storage, "cut", workers=1), display=TrainingDisplay())
    assert again.status == "finished"
    assert "resuming run 'cut' at epoch 2, step 12" in capsys.readouterr().out
    assert global_batches(again.path) == global_batches(ddp.path)
    # Not the same numbers after the resume: BatchNorm now normalises over the 32 rows of a batch
    # on one rank, not 16 on each of two, so the forward pass itself differs (DDP alike). Epoch 0
    # comes back from the checkpoint unchanged, and epoch 1 continues the restored model: its
    # loss stays near the 2-worker run's (a model restarted from scratch would be near epoch 0's).
    grown, ref = history(again.path), history(ddp.path)
    assert grown[0] == ref[0]
    print("train loss of epoch 1, resumed on 1 worker / 2 workers:", grown[1]["train_loss"], ref[1]["train_loss"])
    assert abs(grown[1]["train_loss"] - ref[1]["train_loss"]) < 0.1  # 0.009 measured; epoch 0's 2.14 is 0.3 off

    # A resumed run keeps its strategy.
    changed = cli_here(capsys, "train", "--name", "cut", "--storage", str(storage), "--strategy", "ddp",
                       "--epochs", "3")
    assert_one_line_error(changed, "strategy: 'fsdp' -> 'ddp'")
