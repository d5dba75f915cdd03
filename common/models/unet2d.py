"""The small 2D U-Net of QFedPolyp (32-64-128, bottleneck 256), used for every polyp model.

Written out with plain Conv-BN-ReLU modules, rather than MONAI's UNet, because the INT8 export
must fuse each conv with its BatchNorm and ReLU and swap the skip concatenation for a quantised
one; every layer here has a fixed name that the fusion list in ``common.quantization`` refers to.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Sequential):
    """Two 3x3 conv + BatchNorm + ReLU."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU(inplace=True)


class Concat(nn.Module):
    """Channel concatenation as a module, so that quantisation can replace it."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=1)


class PolypUNet(nn.Module):
    """U-Net: encoder 32 (H), 64 (H/2), 128 (H/4), bottleneck 256 (H/8); returns logits (N, 1, H, W).

    ``forward`` gives logits so that losses stay numerically stable; apply a sigmoid (or use
    :meth:`probabilities`) for the paper's sigmoid output.
    """

    #: Three 2x2 poolings: an image edge must be a multiple of this for the skips to line up.
    SIZE_MULTIPLE = 8

    def __init__(self, in_channels: int = 3, out_channels: int = 1, widths: tuple[int, ...] = (32, 64, 128, 256)):
        super().__init__()
        w1, w2, w3, w4 = widths
        self.enc1 = ConvBlock(in_channels, w1)
        self.enc2 = ConvBlock(w1, w2)
        self.enc3 = ConvBlock(w2, w3)
        self.bottleneck = ConvBlock(w3, w4)
        self.pool = nn.MaxPool2d(2)
        self.up3 = nn.ConvTranspose2d(w4, w3, 2, stride=2)
        self.dec3 = ConvBlock(2 * w3, w3)
        self.up2 = nn.ConvTranspose2d(w3, w2, 2, stride=2)
        self.dec2 = ConvBlock(2 * w2, w2)
        self.up1 = nn.ConvTranspose2d(w2, w1, 2, stride=2)
        self.dec1 = ConvBlock(2 * w1, w1)
        self.head = nn.Conv2d(w1, out_channels, 1)
        self.cat3, self.cat2, self.cat1 = Concat(), Concat(), Concat()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        e3 = self.enc3(self.pool(e2))
        b = self.bottleneck(self.pool(e3))
        d3 = self.dec3(self.cat3(self.up3(b), e3))
        d2 = self.dec2(self.cat2(self.up2(d3), e2))
        d1 = self.dec1(self.cat1(self.up1(d2), e1))
        return self.head(d1)

    @torch.no_grad()
    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.forward(x))
