"""Models by name: torchvision's classification models, timm's (``timm:NAME``, with the
``imgtrain[timm]`` extra), and the default, the tutorial's ResNet-18.

Every model is rebuilt from ``model_args`` (stored in each checkpoint's meta.json), so evaluate,
predict, report, serve and ``load_model`` need no flags. The first convolution takes the data
set's channels and the classifier its classes. ``stem="small"`` is the CIFAR-style stem for
small images: a 3x3 stride-1 first convolution and no max-pool, so a 28x28 digit is not cut to
7x7 before the first block. ``stem="auto"`` (the default) takes it for images of at most
``SMALL_STEM_MAX_SIDE`` px, where the standard stem would leave the first block 4x4 or less.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
TIMM_PREFIX = "timm:"
# Named in the README and tested; any other torchvision classification model works the same way.
LISTED_MODELS = ("resnet18", "resnet34", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0",
                 "convnext_tiny", "vit_b_16")


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
    changeable = not model.startswith((TIMM_PREFIX, "vit_", "swin_", "maxvit_"))
    return "small" if changeable and min(size) <= SMALL_STEM_MAX_SIDE else "standard"


def build_from_args(args: dict) -> nn.Module:
    """The model ``args`` (from a checkpoint's meta.json: untrusted) describe. Raises ValueError,
    before anything is built, for args out of their bounds (``args_problems``)."""
    problems = args_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    name, channels, classes = args["architecture"], args["in_channels"], args["num_classes"]
    stem, size = args.get("stem", "standard"), args.get("image_size") or [224, 224]
    if name == DEFAULT_MODEL and stem == "standard":
        from imgtrain.model import build_resnet18

        return build_resnet18(channels, classes)
    if name.startswith(TIMM_PREFIX):
        return _timm(name.removeprefix(TIMM_PREFIX), channels, classes, stem)
    return _torchvision(name, channels, classes, stem, size)


def args_problems(args) -> list[str]:
    """Every way model ``args`` are malformed or out of their bounds, each naming the field, its
    value and the bound. They size what is built: the classifier by num_classes, a ViT's
    position embeddings by image_size squared (65,536 px: a 51-GB tensor). No torch
    needed: checkpoint.verify asks before any model is built."""
    from imgtrain.data.format import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, short_repr
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
    if name.startswith(TIMM_PREFIX):
        timm = _import_timm()
        if not timm.is_model(name.removeprefix(TIMM_PREFIX)):
            raise ValueError(f"timm has no model {name.removeprefix(TIMM_PREFIX)!r} (timm.list_models() lists them)")
        if stem == "small":
            raise ValueError("--stem small is for torchvision models; timm models take the stem they define")
    elif name not in torchvision_names():
        import difflib

        close = difflib.get_close_matches(name, torchvision_names(), n=5, cutoff=0.6) or list(LISTED_MODELS)
        raise ValueError(f"no torchvision model {name!r}; for example {', '.join(close)}; or timm:NAME for timm's")


def torchvision_names() -> list[str]:
    from torchvision import models

    return models.list_models(module=models)


def _torchvision(name: str, channels: int, classes: int, stem: str, size: list[int]) -> nn.Module:
    import torch.nn as nn
    from torchvision import models

    if name not in torchvision_names():
        raise ValueError(f"no torchvision classification model {name!r}")
    kwargs = {"num_classes": classes}
    if name.startswith(("vit_", "swin_", "maxvit_")):
        if stem == "small":
            raise ValueError(f"{name} cuts the image into patches; it has no convolution stem to make small")
    if name.startswith("vit_"):
        patch = int(name.rsplit("_", 1)[1])
        if size[0] != size[1] or size[0] % patch:
            side = -(-max(size) // patch) * patch  # the next multiple up
            raise ValueError(f"{name} needs square images whose side is a multiple of {patch} (these are "
                             f"{size[0]}x{size[1]}): prepare the data with --size {side}x{side}")
        kwargs["image_size"] = size[0]
    model = models.get_model(name, weights=None, **kwargs)
    path, conv = first_conv(model)
    if stem == "small":
        small = nn.Conv2d(channels, conv.out_channels, 3, stride=1, padding=1, bias=conv.bias is not None)
        _replace(model, path, small)
        if isinstance(getattr(model, "maxpool", None), nn.MaxPool2d):
            model.maxpool = nn.Identity()
    elif conv.in_channels != channels:
        _replace(model, path, nn.Conv2d(channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                                        padding=conv.padding, dilation=conv.dilation, groups=1,
                                        bias=conv.bias is not None))
    return model


def _timm(name: str, channels: int, classes: int, stem: str) -> nn.Module:
    timm = _import_timm()
    if stem == "small":
        raise ValueError("--stem small is for torchvision models")
    if not timm.is_model(name):
        raise ValueError(f"timm has no model {name!r}")
    return timm.create_model(name, pretrained=False, num_classes=classes, in_chans=channels)


def _import_timm():
    try:
        import timm
    except ImportError:
        raise ValueError("timm models need timm: pip install 'imgtrain[timm]'") from None
    return timm


def first_conv(model: nn.Module) -> tuple[str, nn.Conv2d]:
    """The first convolution (the one that sees the image) and its dotted name."""
    import torch.nn as nn

    return next((name, m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d))


def head_name(model: nn.Module) -> str:
    """The classifier's dotted name: timm says it; for torchvision's models it is the last
    Linear layer (fc, classifier.3, heads.head, ...)."""
    if hasattr(model, "get_classifier"):
        head = model.get_classifier()
        return next(name for name, m in model.named_modules() if m is head)
    import torch.nn as nn

    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)][-1]


def describe(args: dict, suggest: bool = False) -> str:
    """One line: which model, and the stem when it is not the standard one; ``suggest``: also
    the small stem where the images are small (the terminal at the start of a run)."""
    name = args["architecture"]
    where = "timm" if name.startswith(TIMM_PREFIX) else "torchvision"
    text = f"model {name.removeprefix(TIMM_PREFIX)} ({where}"
    size = args.get("image_size") or [224, 224]
    if args.get("stem") == "small":
        text += f", small-image stem for {size[0]}x{size[1]} images: 3x3 stride-1 first convolution, no max-pool"
    elif suggest and min(size) < 64 and where == "torchvision" and not name.startswith(("vit_", "swin_", "maxvit_")):
        text += f"; for {size[0]}x{size[1]} images --stem small keeps more resolution, at more compute"
    return text + ")"


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
