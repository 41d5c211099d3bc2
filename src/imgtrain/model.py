"""The model and the batch-tensor preprocessing shared by training and inference."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut: torchvision's ``BasicBlock``, attribute for attribute."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + shortcut)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` rebuilt here with the same module names, creation order and
    initialisation: the same seed gives the same weights, and state_dicts load both ways.

    Why not import it: ``import torchvision`` pulls in ``torch._dynamo`` (through
    ``torchvision.ops``), 1.5 s of every training worker's, inference actor's and driver's
    start on this machine, for one model definition.
    """

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(64, stride=1)
        self.layer2 = self._stage(128, stride=2)
        self.layer3 = self._stage(256, stride=2)
        self.layer4 = self._stage(512, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _stage(self, planes: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )
        first = BasicBlock(self.inplanes, planes, stride, downsample)
        self.inplanes = planes
        return nn.Sequential(first, BasicBlock(planes, planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_resnet18(in_channels: int = 1, num_classes: int = 10) -> nn.Module:
    """ResNet-18 with the tutorial's conv1 override for ``in_channels``.

    Kept layer-for-layer identical to the Ray tutorial's ``build_model()`` (torchvision's
    ``resnet18`` with a new ``conv1``) so that its own inference code loads our ``model.pt``
    unchanged.
    """
    model = ResNet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(
        in_channels, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False
    )
    return model


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
