"""ResNet9, the fast CIFAR ResNet (Myrtle.ai, "How to train your ResNet")."""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(cin: int, cout: int, pool: bool = False) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv_bn(channels, channels), _conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNet9(nn.Module):
    def __init__(self, num_classes: int = 10, scale: float = 0.125) -> None:
        super().__init__()
        self.net = nn.Sequential(
            _conv_bn(3, 64),
            _conv_bn(64, 128, pool=True),
            _Residual(128),
            _conv_bn(128, 256, pool=True),
            _conv_bn(256, 512, pool=True),
            _Residual(512),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
            nn.Linear(512, num_classes, bias=False),
        )
        self.scale = scale  # the output scaling of the original recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale
