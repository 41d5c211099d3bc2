"""timm's models, named ``timm:NAME`` (``pip install 'imgtrain[timm]'``): timm builds them with
the data set's channels and classes itself, and they keep the stem timm defines."""

from __future__ import annotations

from typing import TYPE_CHECKING

from imgtrain.models.registry import Family, PublishedWeights, register

if TYPE_CHECKING:
    import torch.nn as nn

PREFIX = "timm:"


def build(name: str, channels: int, classes: int, stem: str, size: list[int],
          drop_path: float | None = None) -> nn.Module:
    timm = _import_timm()
    if stem == "small":
        raise ValueError("--stem small is for torchvision models")
    if not timm.is_model(name):
        raise ValueError(f"timm has no model {name!r}")
    extra = {} if drop_path is None else {"drop_path_rate": drop_path}  # a model without it: TypeError
    return timm.create_model(name, pretrained=False, num_classes=classes, in_chans=channels, **extra)


def check(name: str, stem: str) -> None:
    timm = _import_timm()
    if not timm.is_model(name):
        raise ValueError(f"timm has no model {name!r} (timm.list_models() lists them)")
    if stem == "small":
        raise ValueError("--stem small is for torchvision models; timm models take the stem they define")


def published_weights(name: str) -> PublishedWeights:
    def fetch() -> dict:
        import timm

        return timm.create_model(name, pretrained=True).state_dict()

    return PublishedWeights(f"timm-{name.replace('/', '_')}.pt", f"timm's hub entry for {name}", fetch)


def _import_timm():
    try:
        import timm
    except ImportError:
        raise ValueError("timm models need timm: pip install 'imgtrain[timm]'") from None
    return timm


register(Family(
    source="timm", prefixes=(PREFIX,), namespaced=True, build=build, check=check, small_stem=False,
    weights=published_weights, hint=f"{PREFIX}NAME for timm's",
))
