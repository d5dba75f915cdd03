"""Generated multimodal brain volumes in which each tumour region shows in only some modalities.

A deterministic stand-in for BraTS (tests, demos, deployments tried without real data): a
brain-shaped ellipsoid with smooth tissue texture in all four modalities, and a tumour of three
nested, irregular regions, each visible only in the modalities where MRI shows it best:

=================  =======  =======  =======  =======
region (label)     FLAIR    T1c      T1       T2
=================  =======  =======  =======  =======
edema (2)          bright   -        -        bright
enhancing (3)      -        bright   -        -
necrotic core (1)  -        dark     dark     -
=================  =======  =======  =======  =======

So no modality shows the whole tumour: a hospital with T2 alone sees the edema but not the
core, one with T1c alone sees the core but not the edema. Cases are shaped like the BraTS loader's
(:class:`~common.data.brats.BratsCase`: z-scored inside the brain, zero outside, labels 0..3).
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import zoom

from .brats import MODALITIES, BratsCase

#: Intensity change of each region in each modality (order of MODALITIES: flair, t1ce, t1, t2).
REGION_CONTRAST = {
    2: (0.9, 0.0, 0.0, 0.9),    # edema
    3: (0.0, 1.2, 0.0, 0.0),    # enhancing tumour
    1: (0.0, -0.9, -0.9, 0.0),  # necrotic / non-enhancing core
}
TISSUE = (1.0, 0.8, 1.2, 0.9)  # mean tissue intensity per modality


def smooth_field(rng: np.random.Generator, size: int, coarse: int = 4) -> np.ndarray:
    """Low-frequency noise in about [-1, 1]: coarse random values, upsampled."""
    field = zoom(rng.uniform(-1, 1, (coarse,) * 3), size / coarse, order=1)
    return field[:size, :size, :size]


def ellipsoid(grid: np.ndarray, centre: np.ndarray, radii: np.ndarray, wobble: np.ndarray) -> np.ndarray:
    """Voxels inside an ellipsoid whose surface is pushed in and out by ``wobble``."""
    distance = np.sqrt((((grid - centre[:, None, None, None]) / radii[:, None, None, None]) ** 2).sum(0))
    return distance < 1.0 + 0.2 * wobble


def make_case(index: int, size: int, seed: int) -> BratsCase:
    rng = np.random.default_rng([seed, index])
    grid = np.indices((size,) * 3, dtype=np.float32)
    middle = np.full(3, (size - 1) / 2, dtype=np.float32)
    brain = ellipsoid(grid, middle, size * rng.uniform(0.40, 0.47, 3), smooth_field(rng, size))

    centre = middle + rng.uniform(-0.12, 0.12, 3) * size
    edema_radii = size * rng.uniform(0.17, 0.26, 3)
    core_centre, core_radii = centre + rng.uniform(-1, 1, 3), edema_radii * rng.uniform(0.5, 0.65)
    core = ellipsoid(grid, core_centre, core_radii, smooth_field(rng, size))
    necrosis = ellipsoid(grid, core_centre, core_radii * rng.uniform(0.55, 0.7), smooth_field(rng, size)) & core
    whole = (ellipsoid(grid, centre, edema_radii, smooth_field(rng, size)) | core) & brain
    label = np.zeros((size,) * 3, dtype=np.uint8)
    label[whole] = 2
    label[core & brain] = 3
    label[necrosis & brain] = 1

    image = np.zeros((len(MODALITIES), *(size,) * 3), dtype=np.float32)
    for m in range(len(MODALITIES)):
        volume = TISSUE[m] * (1.0 + 0.15 * smooth_field(rng, size, coarse=6))
        for region, contrast in REGION_CONTRAST.items():
            volume = volume + contrast[m] * (label == region)
        volume = volume + rng.normal(0.0, 0.25, volume.shape)
        inside = volume[brain]
        image[m] = np.where(brain, (volume - inside.mean()) / (inside.std() or 1.0), 0.0)
    return BratsCase(f"synthetic-{index:03d}", image, label, MODALITIES)


def make_brain_cases(num_cases: int, size: int, seed: int) -> list[BratsCase]:
    """``num_cases`` full-modality cases of ``size``^3 voxels; case i depends only on (seed, i)."""
    return [make_case(i, size, seed) for i in range(num_cases)]
