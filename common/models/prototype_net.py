"""Encoder + learnable prototypes (FedProIn, after Convolutional Prototype Learning).

The prototypes ``P`` of shape (classes, M, d) are ordinary parameters, trained with the encoder
and averaged by the server like any weight. ``forward`` returns class scores, minus each class's
smallest squared distance, so the usual classification code (argmax, metrics) predicts the class
of the nearest prototype without knowing about prototypes.
"""

from __future__ import annotations

import torch

from .resnet import FEATURE_DIM


def squared_distances(features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """(B, d) features and (C, M, d) prototypes -> (B, C, M) squared Euclidean distances."""
    flat = prototypes.reshape(-1, prototypes.shape[-1])
    distances = (features.pow(2).sum(1, keepdim=True) - 2.0 * features @ flat.T + flat.pow(2).sum(1))
    return distances.clamp_min(0.0).view(features.shape[0], *prototypes.shape[:2])


class PrototypeNet(torch.nn.Module):
    """``encoder`` (image -> d-dim feature) and ``prototypes`` (C, M, d), initialised N(0, 1)."""

    def __init__(self, encoder: torch.nn.Module, num_classes: int, prototypes_per_class: int,
                 feature_dim: int = FEATURE_DIM):
        super().__init__()
        self.encoder = encoder
        self.prototypes = torch.nn.Parameter(torch.randn(num_classes, prototypes_per_class, feature_dim))

    def distances(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, M) squared distances of each image's feature to every prototype."""
        return squared_distances(self.encoder(x), self.prototypes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C) class scores: minus the squared distance to the class's nearest prototype."""
        return -self.distances(x).min(dim=2).values

    def per_sample_view(self) -> torch.nn.Module:
        """The same network, its parameters shared, with the prototypes in a leaf module of their own: per-sample
        gradients (Opacus, patient-level DP-SGD) are taken layer by layer, and a module that holds parameters beside
        children would be taken as one opaque layer, losing the gradient that reaches the encoder other than
        through the scores (FedProIn's feature divergence loss)."""
        return _PerSampleView(self)


class _PrototypeScores(torch.nn.Module):
    """(B, d) features -> (B, C) scores against ``prototypes`` (the network's own parameter)."""

    def __init__(self, prototypes: torch.nn.Parameter):
        super().__init__()
        self.prototypes = prototypes

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return -squared_distances(features, self.prototypes).min(dim=2).values


class _PerSampleView(torch.nn.Module):
    def __init__(self, net: PrototypeNet):
        super().__init__()
        self.encoder, self.scores = net.encoder, _PrototypeScores(net.prototypes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scores(self.encoder(x))
