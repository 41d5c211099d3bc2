"""A model family is one registration: the tiny CNN family below, declared as a module in
src/imgtrain/models/ would declare it, is checked, built, trained, evaluated and described
through imgtrain's own entry points with no other file knowing about it."""

from __future__ import annotations

import pytest
import torch.nn as nn

import imgtrain
from imgtrain import finetune
from imgtrain.errors import ImgtrainError
from imgtrain.models import registry, zoo
from imgtrain.models.registry import Family, unknown_name
from tests.conftest import quiet_display, tiny_config

WIDTHS = (8, 16)


def build(name: str, channels: int, classes: int, stem: str, size: list[int]) -> nn.Module:
    width = int(name.removeprefix("tinycnn_"))  # [B, C, H, W] -> [B, width, H/2, W/2] -> [B, classes]
    return nn.Sequential(nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


def check(name: str, stem: str) -> None:
    if name not in names():
        raise unknown_name(name, "tests")
    if stem == "small":
        raise ValueError(f"{name} has one small convolution already")


def names() -> list[str]:
    return [f"tinycnn_{w}" for w in WIDTHS]


TINY_CNNS = Family(source="tests", prefixes=("tinycnn_",), build=build, check=check, names=names)


@pytest.fixture
def tiny_family(monkeypatch):
    """The family registered for one test, the registry put back afterwards."""
    monkeypatch.setattr(registry, "_FAMILIES", list(registry._FAMILIES))
    return registry.register(TINY_CNNS)


def test_a_registered_family_is_checked_built_and_described_by_name(tiny_family):
    zoo.check_name("tinycnn_8", "standard")
    with pytest.raises(ValueError, match="no tests model 'tinycnn_9'; for example tinycnn_8"):
        zoo.check_name("tinycnn_9", "standard")
    with pytest.raises(ValueError, match="one small convolution"):
        zoo.check_name("tinycnn_8", "small")
    args = zoo.model_args({"channels": 1, "num_classes": 10, "image_shape": [8, 8, 1]}, "tinycnn_16", "auto")
    assert args == {"architecture": "tinycnn_16", "in_channels": 1, "num_classes": 10, "stem": "standard",
                    "image_size": [8, 8]}  # no small stem to choose for tiny images
    assert zoo.args_problems(args) == []
    model = zoo.build_from_args(args)
    assert model[0].in_channels == 1 and model[-1].out_features == 10
    assert zoo.describe(args, suggest=True) == "model tinycnn_16 (tests)"
    with pytest.raises(ImgtrainError, match="--pretrained: tests publishes no weights for 'tinycnn_16'"):
        finetune.published_weights_file("tinycnn_16", download=False)


def test_a_registered_family_trains_and_its_checkpoint_rebuilds_it(tiny_family, tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, tmp_path, "tiny-cnn", model="tinycnn_8", backend="local", workers=1, epochs=1)
    result = imgtrain.train(cfg, display=quiet_display())
    assert result.status == "finished"
    model, _ = imgtrain.load_model("tiny-cnn", storage=str(tmp_path))
    assert isinstance(model, nn.Sequential) and model[0].out_channels == 8


def test_a_prefix_has_one_family(tiny_family):
    with pytest.raises(ValueError, match="'tinycnn_' is already a registered family's"):
        registry.register(TINY_CNNS)
