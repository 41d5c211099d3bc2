"""Image batches as tensors: what a model takes (uint8 [B, H, W, C] -> normalised float
[B, C, H, W]) and the digits' batch augmentation (a random affine per image), shared by
training, the streamed decoding tasks and inference."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def to_model_input(images: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """uint8 images [B, H, W, C] -> normalised float32 [B, C, H, W].

    With mean = std = 0.5 the result is in [-1, 1], the tutorial's ``Normalize((0.5,), (0.5,))``.
    """
    x = images.permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
    m, s = _normalisation(tuple(mean), tuple(std), x.device)
    return (x - m) / s


@functools.lru_cache(maxsize=16)
def _normalisation(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: on a GPU a tensor built from Python numbers is a blocking
    # host-to-device copy, and this runs at every step (issue 19).
    return (torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1),
            torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1))


def affine_matrices(r: torch.Tensor, max_rotate_deg: float, max_shift: float, max_scale: float) -> torch.Tensor:
    """Four uniform numbers in [-1, 1] per image [N, 4] (``order.augment_draw``: drawn on the
    CPU, so runs are reproducible on any device) -> affine matrices [N, 2, 3]: a random
    rotation, zoom and shift."""
    angle = r[:, 0] * math.radians(max_rotate_deg)
    scale = 1.0 + r[:, 1] * max_scale
    shift = r[:, 2:] * (2 * max_shift)  # grid coordinates span [-1, 1], i.e. 2 units
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    return torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)


def apply_affine(x: torch.Tensor, theta: torch.Tensor, fill: float = -1.0) -> torch.Tensor:
    """Transform a whole batch [B, C, H, W] by its matrices [B, 2, 3] (same device and dtype).

    One affine_grid + grid_sample call for the batch is far cheaper than per-image PIL
    transforms (the slow path the tutorial uses). ``fill`` is the background value after
    normalisation (-1 = black for mean = std = 0.5).
    """
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    # grid_sample pads with zeros; shift so that padding lands on the background value.
    out = F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out + fill


def random_affine(x: torch.Tensor, r: torch.Tensor, max_rotate_deg: float, max_shift: float, max_scale: float,
                  fill: float = -1.0) -> torch.Tensor:
    """``apply_affine`` with the matrices of the draws ``r`` [B, 4]."""
    theta = affine_matrices(r, max_rotate_deg, max_shift, max_scale).to(device=x.device, dtype=x.dtype)
    return apply_affine(x, theta, fill)
