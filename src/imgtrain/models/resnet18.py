"""imgtrain's own ResNet-18, the default model: torchvision's, module for module, without importing
torchvision (the tutorial's model; its inference code loads our model.pt)."""

from __future__ import annotations

import torch
import torch.nn as nn


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
