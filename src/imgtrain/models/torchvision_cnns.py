"""torchvision's convolutional classifiers (ResNets, MobileNets, EfficientNets, ConvNeXts, ...):
every model name no other family claims.

They take the small-image stem: the first convolution becomes 3x3 stride 1 and the max-pool goes,
so a 28x28 digit is not cut to 7x7 before the first block. ``resnet18`` with the standard stem,
the default, is imgtrain's own copy (``resnet18.py``): the same model without importing
torchvision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from imgtrain.models import torchvision_common as tv
from imgtrain.models.registry import Family, family_of, register

if TYPE_CHECKING:
    import torch.nn as nn


def build(name: str, channels: int, classes: int, stem: str, size: list[int],
          drop_path: float | None = None) -> nn.Module:
    if name == "resnet18" and stem == "standard":
        from imgtrain.models.resnet18 import build_resnet18

        if drop_path is not None:
            raise TypeError("ResNet has no stochastic depth")
        return build_resnet18(channels, classes)
    model = tv.get_model(name, classes, drop_path)
    return small_stem(model, channels) if stem == "small" else tv.take_channels(model, channels)


def small_stem(model: nn.Module, channels: int) -> nn.Module:
    """``model`` with a 3x3 stride-1 first convolution for ``channels`` and no max-pool after it."""
    import torch.nn as nn

    from imgtrain.models.parts import first_conv, replace_module

    path, conv = first_conv(model)
    replace_module(model, path, nn.Conv2d(channels, conv.out_channels, 3, stride=1, padding=1,
                                          bias=conv.bias is not None))
    if isinstance(getattr(model, "maxpool", None), nn.MaxPool2d):
        model.maxpool = nn.Identity()
    return model


def names() -> list[str]:
    return [name for name in tv.torchvision_names() if family_of(name) is CNNS]


CNNS = register(Family(
    source=tv.SOURCE, prefixes=("",), build=build, check=tv.check_known, small_stem=True,
    weights=tv.published_weights, names=names,
    listed=("resnet18", "resnet34", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0",
            "convnext_tiny"),  # named in the README and tested; any other works the same way
))
