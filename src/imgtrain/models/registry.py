"""Model families by name, each registered by its own module (timm's ``@register_model`` in
``timm/models/_registry.py``, one level up: a family owns names by how they start, since
torchvision and timm are asked for the names themselves).

A family says which names are its own, how to build one for a data set (channels, classes,
stem, image size) and which stems and sizes it takes, whether ``--stem auto`` may give it the
small-image stem, and where its published weights come from. ``zoo`` (model_args, building,
checking and describing a model) and ``finetune`` (``--pretrained``) ask the family of a name
here, so a new family is one new module in this package, imported in ``__init__.py``.

Nothing here imports torch: the driver picks the stem before torch is imported.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch.nn as nn


@dataclass(frozen=True)
class PublishedWeights:
    """A model's published (ImageNet) weights, fetched at most once into torch's hub cache."""

    file: str
    """The cached state-dict file's name."""
    source: str
    """Where they come from, as an error message names it (a URL, or timm's hub entry)."""
    fetch: Callable[[], dict]
    """Downloads them: name -> tensor."""


@dataclass(frozen=True)
class Family:
    """One family of models, as every part of imgtrain that builds or names a model needs it."""

    source: str
    """Where its models come from, as ``describe`` and the unknown-name error say it ("torchvision")."""
    prefixes: tuple[str, ...]
    """How its model names start. A name belongs to the family with the longest prefix it starts
    with; "" claims every name no other family claims (torchvision's CNNs)."""
    build: Callable[..., nn.Module]
    """(name, in_channels, num_classes, stem, image_size [H, W]) -> the model, randomly
    initialised; ValueError naming the rule for a stem or a size it does not take. With
    ``--drop-path`` also ``drop_path=RATE``, the stochastic depth rate for the model's
    constructor: a family or constructor without one raises TypeError, which ``zoo`` turns
    into the refusal."""
    check: Callable[[str, str], None]
    """(name, stem): ValueError, in a second and without building anything, for a name the
    family does not have (``unknown_name`` for the usual message) or a stem it refuses."""
    small_stem: bool = False
    """Whether imgtrain can give its models the small-image stem (a 3x3 stride-1 first
    convolution): what ``--stem auto`` picks for tiny images and ``describe`` suggests."""
    weights: Callable[[str], PublishedWeights | None] | None = None
    """name -> its published weights, None where it has none (``--pretrained`` then says so)."""
    names: Callable[[], list[str]] = list
    """Every model it has, for the suggestions of ``unknown_name`` (empty: too many to suggest)."""
    listed: tuple[str, ...] = ()
    """Its models named in the docs and built by the tests."""
    namespaced: bool = False
    """The prefix only routes a name to the family (``timm:resnet18`` is timm's ``resnet18``):
    its functions and ``describe`` see the name without it."""
    hint: str = ""
    """How the unknown-name error of other families points to this one ("timm:NAME for timm's")."""

    def own_name(self, name: str) -> str:
        """``name`` as the family's functions take it: without a namespace prefix."""
        if self.namespaced:
            return name.removeprefix(max((p for p in self.prefixes if name.startswith(p)), key=len))
        return name


_FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Add a family (its module calls this when imported). Two families may not claim the
    same prefix: which one a name meant would depend on the import order."""
    taken = {p for f in _FAMILIES for p in f.prefixes} & set(family.prefixes)
    if taken:
        raise ValueError(f"model name prefix {sorted(taken)[0]!r} is already a registered family's")
    _FAMILIES.append(family)
    return family


def family_of(name: str) -> Family:
    """The family that owns the model ``name``: the one with the longest prefix it starts with."""
    best = max(((len(p), f) for f in _FAMILIES for p in f.prefixes if name.startswith(p)),
               key=lambda pair: pair[0], default=None)
    if best is None:  # only without torchvision's CNNs, whose "" claims every other name
        raise ValueError(f"no model family has {name!r}")
    return best[1]


def listed_models() -> tuple[str, ...]:
    """The models named in the docs and built by the tests, family by family."""
    return tuple(name for family in _FAMILIES for name in family.listed)


def unknown_name(name: str, source: str) -> ValueError:
    """The error for a model ``source`` does not have: up to five close names from every
    family that lists its models (or the listed ones), and how to reach the other families."""
    known = [n for family in _FAMILIES for n in family.names()]
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6) or list(listed_models())
    others = "".join(f"; or {family.hint}" for family in _FAMILIES if family.hint and family.source != source)
    return ValueError(f"no {source} model {name!r}; for example {', '.join(close)}{others}")
