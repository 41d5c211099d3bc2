"""torchvision's vision transformers: ViT, Swin and MaxViT (``vit_``, ``swin_``, ``maxvit_``).

They cut the image into patches, so there is no convolution stem to make small, and a ViT
takes square images whose side is a multiple of its patch (``vit_b_16``: 16 px), its position
embeddings sized for that side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from imgtrain.models import torchvision_common as tv
from imgtrain.models.registry import Family, register

if TYPE_CHECKING:
    import torch.nn as nn

PREFIXES = ("vit_", "swin_", "maxvit_")


def build(name: str, channels: int, classes: int, stem: str, size: list[int],
          drop_path: float | None = None) -> nn.Module:
    tv.require_known(name)
    if stem == "small":
        raise ValueError(f"{name} cuts the image into patches; it has no convolution stem to make small")
    kwargs = {}
    if name.startswith("vit_"):
        patch = int(name.rsplit("_", 1)[1])
        if size[0] != size[1] or size[0] % patch:
            side = -(-max(size) // patch) * patch  # the next multiple up
            raise ValueError(f"{name} needs square images whose side is a multiple of {patch} (these are "
                             f"{size[0]}x{size[1]}): prepare the data with --size {side}x{side}")
        kwargs["image_size"] = size[0]
    return tv.take_channels(tv.get_model(name, classes, drop_path, **kwargs), channels)


register(Family(
    source=tv.SOURCE, prefixes=PREFIXES, build=build, check=tv.check_known, small_stem=False,
    weights=tv.published_weights, names=lambda: [n for n in tv.torchvision_names() if n.startswith(PREFIXES)],
    listed=("vit_b_16",),
))
