"""Encoder + learnable prototypes (FedProIn, after Convolutional Prototype Learning).

The prototypes ``P`` of shape (classes, M, d) are ordinary parameters, trained with the encoder
and averaged by the server like any weight. ``forward`` returns class scores, minus each class's
smallest squared distance, so the usual classification code (argmax, metrics) predicts the class
of the nearest prototype without knowing about prototypes.
"""

from __future__ import annotations

import torch

from .resnet import FEATURE_DIM, build_resnet18_encoder, encoder_feature_dim


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


def build_prototype_net(num_classes: int, prototypes_per_class: int, in_channels: int = 3, image_size: int = 128,
                        classifier: str = "resnet18", width: float = 1.0) -> PrototypeNet:
    """MONAI's ResNet-18 encoder (512-d at width 1, post-ReLU, not normalised) with (C, M, d) prototypes.

    ``classifier='small-cnn'`` takes the small CNN without its last layer instead (tests, demos).
    """
    if classifier == "small-cnn":
        from .small_cnn import build_small_cnn

        network = build_small_cnn(1, in_channels)
        return PrototypeNet(network[:-1], num_classes, prototypes_per_class, network[-1].in_features)
    return PrototypeNet(build_resnet18_encoder(in_channels, image_size, width=width), num_classes,
                        prototypes_per_class, encoder_feature_dim(width))
