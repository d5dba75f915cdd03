"""A very small CNN classifier (three conv blocks, ~25k parameters) for load tests and overhead benchmarks.

Plain PyTorch on purpose: with it a hospital's ClientApp process imports torch and nothing heavier
(MONAI's import alone costs several seconds of CPU per message), so orchestration overhead can be
measured apart from model cost.
"""

from __future__ import annotations

from torch import nn


def build_small_cnn(num_classes: int, in_channels: int = 3, widths: tuple[int, ...] = (8, 16, 32)) -> nn.Module:
    layers: list[nn.Module] = []
    channels = in_channels
    for width in widths:
        layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)
