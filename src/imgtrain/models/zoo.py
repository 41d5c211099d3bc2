"""Models by name, each built by its family (``registry.py``: torchvision's CNNs and vision
transformers, timm's as ``timm:NAME`` with the ``imgtrain[timm]`` extra); the default is the
tutorial's ResNet-18.

Every model is rebuilt from ``model_args`` (stored in each checkpoint's meta.json), so evaluate,
predict, report, serve and ``load_model`` need no flags. The first convolution takes the data
set's channels and the classifier its classes. ``stem="small"`` is the CIFAR-style stem for
small images: a 3x3 stride-1 first convolution and no max-pool, so a 28x28 digit is not cut to
7x7 before the first block. ``stem="auto"`` (the default) takes it for images of at most
``SMALL_STEM_MAX_SIDE`` px, where the standard stem would leave the first block 4x4 or less.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from imgtrain.models.registry import family_of, listed_models

if TYPE_CHECKING:  # torch is imported where a model is built: the driver decides the stem without it
    import torch.nn as nn

DEFAULT_MODEL = "resnet18"
STEMS = ("standard", "small")
# Images whose shorter side is at most this get the small stem under --stem auto. The standard
# stem divides the side by 4 before the first block: 16 px -> 4x4, 8 px -> 2x2. On scikit-learn's
# 8x8 digits the standard stem reached 96.3 % and the small one 98.9 % (test split, mean of three
# seeds; docs/NOTES.md), at the compute the standard stem spends on 32x32 images. 28x28 MNIST
# keeps the tutorial's model.
SMALL_STEM_MAX_SIDE = 16
LISTED_MODELS = listed_models()  # named in the README and tested, family by family


def model_args(manifest: dict, model: str = DEFAULT_MODEL, stem: str = "standard") -> dict:
    """What rebuilds the model, stored beside the weights in every checkpoint (``stem`` "auto"
    is stored as the stem it chose)."""
    stem = chosen_stem(model, manifest["image_shape"][:2]) if stem == "auto" else stem
    args = {"architecture": model, "in_channels": int(manifest["channels"]),
            "num_classes": int(manifest["num_classes"])}
    if model != DEFAULT_MODEL or stem != "standard":  # the default's args stay as the tutorial-era runs wrote them
        args.update(stem=stem, image_size=[int(s) for s in manifest["image_shape"][:2]])
    return args


def chosen_stem(model: str, size) -> str:
    """What ``--stem auto`` means for ``model`` on images of ``size`` [H, W]: the small stem for
    tiny images, where the model has a convolution stem imgtrain can change; else the standard one."""
    return "small" if family_of(model).small_stem and min(size) <= SMALL_STEM_MAX_SIDE else "standard"


def build_from_args(args: dict, drop_path: float | None = None, grad_checkpointing: bool = False) -> nn.Module:
    """The model ``args`` (from a checkpoint's meta.json: untrusted) describe, built by its
    family. Raises ValueError, before anything is built, for args out of their bounds
    (``args_problems``).

    Training's own options, not part of ``args`` (evaluation rebuilds the model without them):
    ``drop_path``, the stochastic depth rate (None: the model's own), and ``grad_checkpointing``.
    Both only change how the model trains: drop path is the identity in evaluation, and neither
    adds a parameter or buffer, so the weights load into a model built with or without them.
    ValueError for a model that has neither."""
    problems = args_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    name, channels, classes = args["architecture"], args["in_channels"], args["num_classes"]
    stem, size = args.get("stem", "standard"), args.get("image_size") or [224, 224]
    family = family_of(name)
    own = family.own_name(name)
    if drop_path is None:
        model = family.build(own, channels, classes, stem, size)
    else:
        try:
            model = family.build(own, channels, classes, stem, size, drop_path=drop_path)
        except TypeError:  # the family's build or the model's constructor takes no stochastic depth rate
            model = None
    if drop_path is not None and (model is None or not drop_path_rates(model)):
        raise ValueError(f"{own} has no stochastic depth, so --drop-path cannot apply; models that have it: "
                         "convnext_*, efficientnet_*, swin_*, maxvit_* and most timm: models")
    if grad_checkpointing:
        enable_grad_checkpointing(model, own)
    return model


def drop_path_rates(model: nn.Module) -> list[float]:
    """The drop rate of every stochastic depth module in ``model`` (timm's ``DropPath``,
    torchvision's ``StochasticDepth``), in order; empty for a model without any."""
    kinds = []
    try:
        from torchvision.ops import StochasticDepth

        kinds.append((StochasticDepth, "p"))
    except ImportError:
        pass
    try:
        from timm.layers import DropPath

        kinds.append((DropPath, "drop_prob"))
    except ImportError:
        pass
    return [float(getattr(m, attr)) for m in model.modules() for kind, attr in kinds if isinstance(m, kind)]


def enable_grad_checkpointing(model: nn.Module, name: str) -> None:
    """Turn on timm's activation checkpointing in ``model``; ValueError for a model without it
    (torchvision's, and timm's that refuse: their method asserts it is off)."""
    try:
        model.set_grad_checkpointing(True)  # timm's models, through checkpoint_seq: non-reentrant
    except (AssertionError, AttributeError):
        raise ValueError(f"{name} cannot checkpoint activations, so --grad-checkpointing cannot apply: only timm "
                         "models with set_grad_checkpointing() support (timm:resnet50, timm:convnext_tiny, "
                         "timm:vit_small_patch16_224, ...)") from None


def args_problems(args) -> list[str]:
    """Every way model ``args`` are malformed or out of their bounds, each naming the field, its
    value and the bound. They size what is built: the classifier by num_classes, a ViT's
    position embeddings by image_size squared (65,536 px: a 51-GB tensor). No torch
    needed: checkpoint.verify asks before any model is built."""
    from imgtrain.data.format import short_repr
    from imgtrain.data.limits import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE
    from imgtrain.data.limits import MAX_CLASSES

    if not isinstance(args, dict):
        return [f"model_args {short_repr(args)} is not an object"]
    name, channels, classes = args.get("architecture"), args.get("in_channels"), args.get("num_classes")
    stem, size = args.get("stem", "standard"), args.get("image_size") or None  # none: 224x224
    issues = []
    if not isinstance(name, str) or not name:
        issues.append(f"architecture {short_repr(name)} is not a model name")
    # a data set's channels (format.manifest_problems), what every model's first convolution takes
    if channels not in (1, 3) or not isinstance(channels, int) or isinstance(channels, bool):
        issues.append(f"in_channels {short_repr(channels)} out of range: 1 or 3")
    # a data set's classes, and a classifier needs two (10^9 classes: a 2-TB output layer)
    if not isinstance(classes, int) or isinstance(classes, bool) or not 2 <= classes <= MAX_CLASSES:
        issues.append(f"num_classes {short_repr(classes)} out of range: 2 to {MAX_CLASSES:,}")
    if stem not in STEMS:
        issues.append(f"stem {short_repr(stem)} not understood: {' or '.join(STEMS)}")
    if size is not None:  # a data set's image shape, held to the same bounds
        if not (isinstance(size, list) and len(size) == 2
                and all(isinstance(s, int) and not isinstance(s, bool) for s in size)):
            issues.append(f"image_size {short_repr(size)} not understood: [height, width]")
        elif not all(1 <= s <= MAX_IMAGE_SIDE for s in size) or size[0] * size[1] > MAX_IMAGE_PIXELS:
            issues.append(f"image_size {size} out of range: 1 to {MAX_IMAGE_SIDE} px a side and "
                          f"{MAX_IMAGE_PIXELS:,} pixels in all (the largest image imgtrain decodes)")
    return issues


def check_name(name: str, stem: str) -> None:
    """Fail in a second, on the driver, for a model name that does not exist (ValueError)."""
    family = family_of(name)
    family.check(family.own_name(name), stem)


def describe(args: dict, suggest: bool = False) -> str:
    """One line: which model, and the stem when it is not the standard one; ``suggest``: also
    the small stem where the images are small (the terminal at the start of a run)."""
    name = args["architecture"]
    family = family_of(name)
    text = f"model {family.own_name(name)} ({family.source}"
    size = args.get("image_size") or [224, 224]
    if args.get("stem") == "small":
        text += f", small-image stem for {size[0]}x{size[1]} images: 3x3 stride-1 first convolution, no max-pool"
    elif suggest and min(size) < 64 and family.small_stem:
        text += f"; for {size[0]}x{size[1]} images --stem small keeps more resolution, at more compute"
    return text + ")"
