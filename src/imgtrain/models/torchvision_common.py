"""What torchvision's families share: its classification models' names, a model by name with
the data set's channels, and the published weights torchvision names for it.

Imported when the families register, on the driver too: torch and torchvision only inside
the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from imgtrain.models.registry import PublishedWeights, unknown_name

if TYPE_CHECKING:
    import torch.nn as nn

SOURCE = "torchvision"


def torchvision_names() -> list[str]:
    from torchvision import models

    return models.list_models(module=models)


def check_known(name: str, stem: str) -> None:
    """A family's ``check``: the name is torchvision's; the stem is left to building."""
    if name not in torchvision_names():
        raise unknown_name(name, SOURCE)


def require_known(name: str) -> None:
    if name not in torchvision_names():
        raise ValueError(f"no torchvision classification model {name!r}")


def get_model(name: str, classes: int, drop_path: float | None = None, **kwargs) -> nn.Module:
    """torchvision's ``name``, randomly initialised, with ``classes`` outputs; ``drop_path``: its
    ``stochastic_depth_prob`` (ConvNeXt, EfficientNet, Swin, MaxViT; other models: TypeError)."""
    from torchvision import models

    require_known(name)
    if drop_path is not None:
        kwargs["stochastic_depth_prob"] = drop_path
    return models.get_model(name, weights=None, num_classes=classes, **kwargs)


def take_channels(model: nn.Module, channels: int) -> nn.Module:
    """``model`` with a first convolution for ``channels`` (1 or 3), its shape kept otherwise."""
    import torch.nn as nn

    from imgtrain.models.parts import first_conv, replace_module

    path, conv = first_conv(model)
    if conv.in_channels != channels:
        replace_module(model, path, nn.Conv2d(channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                                              padding=conv.padding, dilation=conv.dilation, groups=1,
                                              bias=conv.bias is not None))
    return model


def published_weights(name: str) -> PublishedWeights | None:
    """The default weights torchvision publishes for ``name``, None where it publishes none."""
    from torchvision import models

    try:
        weights = models.get_model_weights(name).DEFAULT
    except ValueError:
        return None
    return PublishedWeights(Path(weights.url).name, weights.url, lambda: weights.get_state_dict(progress=False))
