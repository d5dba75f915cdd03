"""Deterministic generated data a model can really learn, for the demo and the tests.

The images imitate the real tasks closely enough to exercise the same code paths (RGB lesions on
skin for classification, polyps on mucosa for segmentation), and the class or mask is a real
function of the pixels, so accuracy above chance is earned. Generated volumes for the brain task
live with that method (``common.data.synthetic_brats``).
"""

from __future__ import annotations

import numpy as np

from .containers import LabelledImages, SegmentationImages

SYNTHETIC_CLASSES = ("solid", "ring", "striped", "dotted")


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    axis = (np.arange(size) + 0.5) / size
    return np.meshgrid(axis, axis, indexing="ij")


def _smooth_noise(rng: np.random.Generator, n: int, size: int, cells: int = 4) -> np.ndarray:
    """Low-frequency noise in [-1, 1], (n, size, size): a coarse random grid bilinearly upsampled."""
    coarse = rng.uniform(-1, 1, size=(n, cells + 1, cells + 1))
    pos = np.linspace(0, cells, size)
    i0 = np.minimum(pos.astype(int), cells - 1)
    frac = pos - i0
    rows = coarse[:, i0, :] * (1 - frac)[None, :, None] + coarse[:, i0 + 1, :] * frac[None, :, None]
    return rows[:, :, i0] * (1 - frac)[None, None, :] + rows[:, :, i0 + 1] * frac[None, None, :]


def make_classification(num_samples: int, image_size: int = 32, seed: int = 0,
                        num_classes: int = len(SYNTHETIC_CLASSES)) -> LabelledImages:
    """Skin-like images with one lesion whose *texture* gives the class (solid, ring, stripes, dots).

    Lesion colour, size, position, skin tone and noise vary at random and carry no label
    information, so a model has to learn the texture.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num_samples)
    y, x = _grid(image_size)
    skin = np.array([0.85, 0.65, 0.55]) + rng.normal(0, 0.05, size=(num_samples, 1, 1, 3))
    images = np.broadcast_to(skin, (num_samples, image_size, image_size, 3)).copy()
    images += 0.05 * _smooth_noise(rng, num_samples, image_size)[..., None]
    cy, cx = rng.uniform(0.35, 0.65, size=(2, num_samples, 1, 1))
    ry, rx = rng.uniform(0.18, 0.3, size=(2, num_samples, 1, 1))
    angle = rng.uniform(0, np.pi, size=(num_samples, 1, 1))
    radius = np.sqrt(((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2)
    inside = radius < 1.0
    u = (y - cy) * np.cos(angle) + (x - cx) * np.sin(angle)
    v = -(y - cy) * np.sin(angle) + (x - cx) * np.cos(angle)
    period = rng.uniform(0.09, 0.13, size=(num_samples, 1, 1))
    patterns = {
        0: np.ones_like(radius),                                                   # solid
        1: ((radius > 0.55) | (radius < 0.2)).astype(float),                       # ring
        2: (np.sin(2 * np.pi * u / period) > 0).astype(float),                     # stripes
        3: ((np.sin(2 * np.pi * u / period) > 0.3) & (np.sin(2 * np.pi * v / period) > 0.3)).astype(float),
    }
    pattern = np.zeros_like(radius)
    for cls in range(num_classes):
        selected = labels == cls
        base = patterns[cls % len(patterns)][selected]
        if cls >= len(patterns):  # more classes than textures: vary the period too
            base = (np.sin(2 * np.pi * u[selected] / (period[selected] * (1 + cls // len(patterns)))) > 0)
        pattern[selected] = base
    lesion = rng.uniform(0.15, 0.45, size=(num_samples, 1, 1, 3))
    weight = (inside * (0.35 + 0.65 * pattern))[..., None]
    images = images * (1 - weight) + lesion * weight
    images += rng.normal(0, 0.04, size=images.shape)
    pixels = (np.clip(images, 0, 1) * 255).astype(np.uint8)
    class_names = tuple(SYNTHETIC_CLASSES[c] if c < len(SYNTHETIC_CLASSES) else f"texture-{c}"
                        for c in range(num_classes))
    names = np.array([f"synthetic-{seed}-{i}" for i in range(num_samples)])
    return LabelledImages(pixels, labels.astype(np.int64), class_names, names)


def make_polyps(num_samples: int, image_size: int = 64, seed: int = 0, sources: int = 2) -> SegmentationImages:
    """Mucosa-like images with one polyp: a rounded, brighter, shaded blob; the mask is the blob.

    Each ``source`` has its own colour cast and noise level, like two endoscopy centres.
    """
    rng = np.random.default_rng(seed)
    source = rng.integers(0, sources, size=num_samples)
    y, x = _grid(image_size)
    cast = np.stack([np.array([0.75, 0.35, 0.3]) + 0.08 * np.array([np.sin(s), np.cos(s), -np.sin(s)])
                     for s in range(sources)])[source][:, None, None, :]
    images = cast + 0.12 * _smooth_noise(rng, num_samples, image_size, cells=6)[..., None]
    cy, cx = rng.uniform(0.25, 0.75, size=(2, num_samples, 1, 1))
    ry, rx = rng.uniform(0.1, 0.25, size=(2, num_samples, 1, 1))
    wobble = 1 + 0.15 * _smooth_noise(rng, num_samples, image_size, cells=3)
    radius = np.sqrt(((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2) * wobble
    mask = radius < 1.0
    shade = np.clip(1.2 - radius, 0, 1)[..., None]
    images = images + mask[..., None] * (0.18 + 0.2 * shade) * np.array([0.9, 0.7, 0.5])
    glints = rng.uniform(0, 1, size=(num_samples, image_size, image_size)) > 0.997  # specular highlights
    images[glints] = 1.0
    noise_level = np.array([0.03, 0.06, 0.045, 0.05])[source % 4][:, None, None, None]
    images += rng.normal(0, 1, size=images.shape) * noise_level
    pixels = (np.clip(images, 0, 1) * 255).astype(np.uint8)
    names = np.array([f"synthetic-polyp-{seed}-{i}.png" for i in range(num_samples)])
    return SegmentationImages(pixels, mask.astype(np.uint8), names, np.array([f"centre-{s}" for s in source]))
