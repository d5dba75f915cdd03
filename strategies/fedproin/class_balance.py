"""Class-balanced sampling and per-class augmentation for a hospital's long-tailed data.

With several prototypes per class, a prototype only learns from the samples it is nearest to, so
the prototypes of rare classes starve (FedProIn, after BalanceFL). A hospital therefore draws its
training samples with weight 1 / (classes present * n_c), with replacement, so every class it holds
is drawn equally often, and augments a class-c sample with probability p_c = 1 - n_c / n_max, so
that the repeated rare samples come as varied views while the largest class stays as it is.
"""

from __future__ import annotations

import numpy as np
import torch
from monai.networks.layers import AffineTransform

from common.tasks.base import normalisation

MAX_ROTATION_DEGREES = 15.0
MAX_SHIFT = 0.1  # of the image side
SCALE_RANGE = (0.9, 1.1)
JITTER = 0.2  # brightness, contrast and saturation factors in [1 - JITTER, 1 + JITTER]


def balanced_draws(labels: np.ndarray, num_draws: int, rng: np.random.Generator) -> np.ndarray:
    """Sample indices drawn with replacement so that each class present is drawn equally often."""
    counts = np.bincount(labels)
    present = np.count_nonzero(counts)
    weights = 1.0 / (present * counts[labels])
    return rng.choice(len(labels), size=num_draws, replace=True, p=weights / weights.sum())


def augmentation_probabilities(class_counts: np.ndarray) -> np.ndarray:
    """p_c = 1 - n_c / n_max per class (0 for the largest class; classes absent here get 1)."""
    counts = np.asarray(class_counts, dtype=np.float64)
    return 1.0 - counts / max(counts.max(), 1.0)


def random_views(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """A random rotation, shift, scale and colour jitter of every image of a normalised batch."""
    n, channels = x.shape[:2]
    mean, std = normalisation(channels, x.device)
    unit = x * std + mean  # back to [0, 1], where black borders and colour factors mean what they say

    angle = np.deg2rad(rng.uniform(-MAX_ROTATION_DEGREES, MAX_ROTATION_DEGREES, n))
    scale = rng.uniform(*SCALE_RANGE, n)
    shift = rng.uniform(-2 * MAX_SHIFT, 2 * MAX_SHIFT, (n, 2))  # normalised coordinates span [-1, 1]
    theta = np.zeros((n, 2, 3), dtype=np.float32)
    theta[:, 0, 0] = theta[:, 1, 1] = np.cos(angle) / scale
    theta[:, 0, 1] = -np.sin(angle) / scale
    theta[:, 1, 0] = np.sin(angle) / scale
    theta[:, :, 2] = shift
    warp = AffineTransform(normalized=True, reverse_indexing=False, align_corners=False, padding_mode="zeros")
    unit = warp(unit, torch.from_numpy(theta).to(x.device))

    def factors() -> torch.Tensor:
        return torch.from_numpy(rng.uniform(1 - JITTER, 1 + JITTER, (n, 1, 1, 1)).astype(np.float32)).to(x.device)

    unit = unit * factors()  # brightness
    grey_level = unit.mean(dim=(1, 2, 3), keepdim=True)
    unit = (unit - grey_level) * factors() + grey_level  # contrast
    if channels == 3:
        luma = torch.tensor([0.299, 0.587, 0.114], device=x.device).view(1, 3, 1, 1)
        grey = (unit * luma).sum(dim=1, keepdim=True)
        unit = (unit - grey) * factors() + grey  # saturation
    return (unit.clamp(0.0, 1.0) - mean) / std


def augment_by_class(x: torch.Tensor, labels: np.ndarray, probabilities: np.ndarray,
                     rng: np.random.Generator) -> torch.Tensor:
    """Replace each sample by a random view with its class's probability."""
    chosen = np.flatnonzero(rng.random(len(labels)) < probabilities[labels])
    if chosen.size == 0:
        return x
    x = x.clone()
    index = torch.from_numpy(chosen).to(x.device)
    x[index] = random_views(x[index], rng)
    return x
