"""Another model end to end (MobileNetV3-small: exact resume, every command downstream
rebuilding it from the checkpoint alone), fine-tuning from a file, and the model mistakes
refused before anything trains.

Nothing here depends on Ray (what a model family changes is the model, not the workers):
everything trains on the local backend in this process. Ray Train's retry of a failed worker
group is tested once, in test_resume.py; MobileNet on Ray workers in test_fsdp.py.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest
import torch

import imgtrain
from imgtrain.checkpoint_policy import POLICY
from imgtrain.config import TrainConfig
from imgtrain.data.format import read_split
from imgtrain.inference.batch import InferenceOptions, evaluate
from imgtrain.inference.predictor import Predictor, load_model
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.faults import InjectedFault
from tests.conftest import assert_one_line_error, cli_here, quiet_display, run_cli

pytestmark = pytest.mark.integration

QUIET = quiet_display()
MODEL = "mobilenet_v3_small"
# 256 rows / batch 32 = 8 steps per epoch; a step checkpoint after global step 4.
SETTINGS = dict(model=MODEL, backend="local", epochs=2, batch_size=32, eval_batch_size=50, log_every_steps=2,
                checkpoint_every_steps=4, deterministic=True)


def config(data, storage, name, **overrides) -> TrainConfig:
    return TrainConfig(data=str(data), storage=str(storage), name=name, **{**SETTINGS, **overrides})


@pytest.fixture(scope="module")
def mobilenet(tiny_data, tmp_path_factory):
    """The uninterrupted run, read by every test here (the report test adds report/ to it)."""
    storage = tmp_path_factory.mktemp("models")
    result = imgtrain.train(config(tiny_data, storage, "mn"), display=QUIET)
    assert result.status == "finished"
    return result, storage


def weights(checkpoint) -> dict:
    return ckpt.load_model_state(checkpoint)


def ray_initialized() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def test_a_resumed_mobilenet_run_ends_with_the_uninterrupted_runs_weights(mobilenet, tiny_data, tmp_path, monkeypatch):
    # MobileNet has what ResNet-18 lacks (dropout, squeeze-excitation, hardswish): its dropout
    # draws from the RNG state the step checkpoint restores.
    reference, _ = mobilenet
    monkeypatch.setenv(FAULT_ENV, "raise:0:6")  # fails in epoch 0, after the step-4 checkpoint
    with pytest.raises(InjectedFault):  # the local backend: the driver's own process fails
        imgtrain.train(config(tiny_data, tmp_path, "mn-resume"), display=QUIET)
    result = imgtrain.train(config(tiny_data, tmp_path, "mn-resume"), display=QUIET)  # the same request again
    assert result.status == "finished"
    assert (result.path / ".faults" / "raise-0-6-1").is_file()
    starts = [(r["step"], r["epoch_step"]) for r in runs.read_metrics(result.path) if r["kind"] == "start"]
    assert starts == [(0, 0), (4, 4)]
    a, b = weights(result.latest_checkpoint), weights(reference.latest_checkpoint)
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-6
    assert list(result.metrics["val_accuracy"]) == list(reference.metrics["val_accuracy"])


def test_every_command_downstream_rebuilds_the_model_from_the_checkpoint(mobilenet, capsys):
    result, storage = mobilenet
    meta = ckpt.read_meta(result.best_checkpoint)
    assert meta["model_args"] == {"architecture": MODEL, "in_channels": 1, "num_classes": 10, "stem": "standard",
                                  "image_size": [28, 28]}
    ev = evaluate("mn", storage=str(storage), options=InferenceOptions(backend="local"))
    assert ev.accuracy == meta["metrics"]["val_accuracy"]  # what validation saw during training
    model, preprocess = load_model("mn", storage=str(storage))
    assert type(model).__name__ == "MobileNetV3"
    _, images, labels = read_split(result.config["data"], "test")
    with torch.inference_mode():
        preds = model(preprocess(images)).argmax(1).numpy()
    assert np.mean(preds == labels) == ev.accuracy
    served = Predictor(result.best_checkpoint)({"image": images[:4]})  # what serve and predict run
    assert list(served["pred_index"]) == list(preds[:4])
    proc = cli_here(capsys, "report", "mn", "--storage", str(storage))
    assert proc.returncode == 0, proc.stderr
    assert MODEL in (result.path / "report" / "report.html").read_text()


def test_bf16_trains_a_mobilenet_and_saves_float32_weights(tiny_data, tmp_path):
    # Eager: compiling MobileNet costs about three times ResNet-18's compilation, and --compile
    # (with and without bf16) is proved on ResNet-18 in test_speed_options.py.
    result = imgtrain.train(config(tiny_data, tmp_path, "mn-fast", epochs=1, precision="bf16", limit_train_batches=3,
                                   checkpoint_every_steps=0, deterministic=False), display=QUIET)
    assert result.status == "finished"
    assert np.isfinite(result.metrics["train_loss"]).all()
    assert all(v.dtype == torch.float32 for v in weights(result.latest_checkpoint).values() if v.is_floating_point())


def test_fine_tuning_from_a_run_freezes_the_backbone_then_trains_it(mobilenet, tiny_data, tmp_path, capsys,
                                                                      monkeypatch):
    source, _ = mobilenet
    start = weights(source.best_checkpoint)
    monkeypatch.chdir(source.path.parent.parent)
    relative = source.path.relative_to(source.path.parent.parent)  # as a user types it, from where they are
    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "ft",
                    "--model", MODEL, "--init-from", str(relative), "--freeze-backbone", "1",
                    "--backbone-lr-scale", "0.1", "--backend", "local", "--epochs", "2", "--batch-size", "32",
                    "--ema-decay", "0", "--num-to-keep", "2")
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "ft"
    epoch0 = weights(run_dir / POLICY.epoch_name(0))
    epoch1 = weights(run_dir / POLICY.epoch_name(1))
    conv = "features.1.block.0.0.weight"  # a backbone convolution
    assert torch.equal(epoch0[conv], start[conv])  # frozen in epoch 0
    assert not torch.equal(epoch1[conv], start[conv])  # trained in epoch 1
    assert not torch.equal(epoch0["classifier.3.weight"], start["classifier.3.weight"])  # the head trained
    assert f"initial weights from {source.path}: " in proc.stdout and "tensors loaded" in proc.stdout
    assert "model mobilenet_v3_small (torchvision; for 28x28 images --stem small keeps more resolution" in proc.stdout
    assert json.loads((run_dir / runs.CONFIG_FILE).read_text())["init_from"] == str(source.path)


def test_model_mistakes_fail_in_seconds_before_a_run_exists(mobilenet, tiny_data, tmp_path, capsys):
    source, _ = mobilenet
    base = ["train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "bad"]
    ray_before = ray_initialized()
    for extra, fragments in [
        (["--model", "resnet19"], ["no torchvision model 'resnet19'", "resnet18"]),
        (["--model", "vit_b_16"], ["multiple of 16", "--size 32x32"]),
        (["--init-from", str(source.path)], ["does not fit resnet18", "another architecture"]),
        (["--init-from", str(tmp_path / "nope.pt")], ["no such file"]),
    ]:
        started = time.monotonic()
        assert_one_line_error(cli_here(capsys, *base, *extra), *fragments)
        assert time.monotonic() - started < 30
        assert not (tmp_path / "bad").exists()
        assert ray_initialized() == ray_before  # refused before any cluster was started or joined


def test_pretrained_weights_offline_fail_in_seconds(tiny_data, tmp_path, monkeypatch):
    # A process of its own: urllib builds its proxy settings once per process, so only a new
    # process is sure to see these. No network: every HTTPS request goes to a proxy port nothing
    # listens on.
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # nothing cached
    started = time.monotonic()
    proc = run_cli("train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "pre", "--pretrained",
                   "--model", MODEL, timeout=60)
    assert_one_line_error(proc, f"could not download the weights of {MODEL}", "--init-from FILE")
    assert time.monotonic() - started < 30


def test_tiny_images_get_the_small_stem_by_default_and_keep_it_downstream(tmp_path, capsys):
    """scikit-learn's 8x8 digits (another origin and size than MNIST): the standard stem would
    leave the first block 2x2, so ``--stem auto`` takes the small one, says so, and records it."""
    import pandas as pd
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images[:300] * 255 / 16).astype(np.uint8)  # [300, 8, 8], 0-16 -> 0-255
    pd.DataFrame({"image": [p.tolist() for p in pixels], "label": digits.target[:300]}).to_parquet(tmp_path / "d.parquet")
    data = tmp_path / "digits8"
    prepared = cli_here(capsys, "data", "prepare", "parquet", str(data), "--source", str(tmp_path / "d.parquet"))
    assert prepared.returncode == 0, prepared.stderr
    proc = cli_here(capsys, "train", "--data", str(data), "--storage", str(tmp_path), "--name", "d8", "--backend",
                    "local", "--epochs", "1", "--batch-size", "32")  # the stem is chosen on the driver: no Ray needed
    assert proc.returncode == 0, proc.stderr
    assert "model resnet18 (torchvision, small-image stem for 8x8 images" in proc.stdout
    result = imgtrain.load_run(str(tmp_path), "d8")
    assert ckpt.read_meta(result.latest_checkpoint)["model_args"]["stem"] == "small"
    model, _ = load_model("d8", storage=str(tmp_path))
    assert model.conv1.stride == (1, 1)
    ev = evaluate("d8", storage=str(tmp_path), split="val", options=InferenceOptions(backend="local"))
    assert ev.accuracy == result.metrics["val_accuracy"].iloc[-1]  # prepare's default: a validation split
