"""The parts of a model imgtrain reaches into, found the same way in every family: the first
convolution (it sees the image: its channels follow the data set's, the small stem replaces it)
and the classifier (its classes follow the data set's; fine-tuning gives it its own LR), and the
order of the layers in between (``--layer-decay``)."""

from __future__ import annotations

import re

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


# The containers whose elements are a torchvision model's blocks, in depth order: ResNets'
# layer1-4, ShuffleNet's stage2-4, ``features`` (MobileNet, EfficientNet, ConvNeXt, Swin, VGG,
# DenseNet, ...), RegNet's trunk_output, ViT's encoder.layers, MaxViT's blocks, MNASNet's layers.
_BLOCKS = re.compile(r"layer\d+|stage\d+|features|trunk_output|encoder\.layers|blocks|layers")


def layer_ids(model: nn.Module) -> dict[str, int]:
    """Every parameter's depth for layer-wise LR decay: 0 for the first layers, the largest for
    the classifier. timm's models: timm's own grouping (``group_matcher(coarse=False)``, as its
    ``param_groups_layer_decay``). torchvision's: the stem (whatever comes before the first
    block) 0, each block (an element of a container ``_BLOCKS`` names) the next, and what
    follows the last block (final norm, pre-logits, classifier) the top. ValueError when the
    model has no such order."""
    if hasattr(model, "pretrained_cfg"):  # a timm model
        if hasattr(model, "group_matcher"):
            from timm.models import group_parameters

            return group_parameters(model, model.group_matcher(coarse=False), reverse=True)
        # as param_groups_layer_decay does: chunks of parameters in order, then the head
        # (``auto_group_layers`` in newer timm, ``_layer_map`` in timm 1.0's first releases)
        from timm.optim import _param_groups

        auto_group_layers = getattr(_param_groups, "auto_group_layers", None) or _param_groups._layer_map
        return auto_group_layers(model)
    containers = [name for name, m in model.named_modules()
                  if isinstance(m, (nn.Sequential, nn.ModuleList)) and _BLOCKS.fullmatch(name)]
    blocks, order = {}, []  # (container, element) -> its position; the parameters' blocks, in order
    for name, _ in model.named_parameters():
        within = next((c for c in containers if name.startswith(c + ".")), None)
        block = None if within is None else (within, name[len(within) + 1:].split(".")[0])
        if block is not None:
            blocks.setdefault(block, len(blocks) + 1)
        order.append((name, blocks.get(block)))
    if not blocks:
        raise ValueError(f"{type(model).__name__} has none of the block containers imgtrain orders layers by "
                         "(layerN, stageN, features, trunk_output, encoder.layers, blocks, layers)")
    last = max(i for i, (_, block) in enumerate(order) if block is not None)
    ids, current = {}, 0
    for i, (name, block) in enumerate(order):
        current = block if block is not None else (len(blocks) + 1 if i > last else current)
        ids[name] = current
    return ids
