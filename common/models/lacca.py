"""LACCA: a hospital calibrates a decoder feature map by cross-attention on the server's anchors.

Every voxel's feature is a query; the multimodal anchors of that scale (N_k per class, computed on
the server's full-modality data) are keys and values:
``F + softmax((F W0)(A W1)^T / sqrt(d)) (A W2) Wo`` with PyTorch's multi-head attention (d is the
head width; MONAI's ``CrossAttentionBlock`` would need einops, which this project does not carry).

The public code adds the attention output to the feature (a residual) and initialises every
projection with a tiny normal (std 1e-3), so a new LACCA starts as (almost) the identity and
cannot wreck the decoder it is put into. Before a hospital has received anchors it is the identity.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LACCA(nn.Module):
    """Localised adaptive calibration via cross-attention at one decoder scale."""

    def __init__(self, channels: int, heads: int):
        super().__init__()
        self.attention = nn.MultiheadAttention(channels, math.gcd(heads, channels), batch_first=True)
        for name, parameter in self.attention.named_parameters():
            if name.endswith("weight"):
                nn.init.normal_(parameter, std=1e-3)
            else:
                nn.init.zeros_(parameter)
        # anchors are data from the server, not weights: kept out of the state dict
        self.register_buffer("anchors", torch.zeros(0, channels), persistent=False)

    def set_anchors(self, anchors: torch.Tensor | None) -> None:
        channels = self.anchors.shape[1]
        if anchors is None:
            anchors = torch.zeros(0, channels)
        if anchors.ndim != 2 or anchors.shape[1] != channels:
            raise ValueError(f"anchors of shape {tuple(anchors.shape)} do not fit a {channels}-channel LACCA")
        self.anchors = anchors.to(self.anchors.device, torch.float32)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.anchors.shape[0] == 0:
            return features
        batch = features.shape[0]
        queries = features.flatten(2).transpose(1, 2)  # (B, voxels, C)
        context = self.anchors.unsqueeze(0).expand(batch, -1, -1)
        calibration, _ = self.attention(queries, context, context, need_weights=False)
        calibration = calibration.transpose(1, 2).reshape(features.shape)
        return features + calibration
