"""The parts of a model imgtrain reaches into, found the same way in every family: the first
convolution (it sees the image: its channels follow the data set's, the small stem replaces it)
and the classifier (its classes follow the data set's; fine-tuning gives it its own LR)."""

from __future__ import annotations

import torch.nn as nn


def first_conv(model: nn.Module) -> tuple[str, nn.Conv2d]:
    """The first convolution (the one that sees the image) and its dotted name."""
    return next((name, m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d))


def head_name(model: nn.Module) -> str:
    """The classifier's dotted name: timm says it; for torchvision's models it is the last
    Linear layer (fc, classifier.3, heads.head, ...)."""
    if hasattr(model, "get_classifier"):
        head = model.get_classifier()
        return next(name for name, m in model.named_modules() if m is head)
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)][-1]


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule at dotted ``path`` is."""
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
