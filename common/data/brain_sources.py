"""Which brain tumour cases the server trains on, which it tests on, which each hospital holds, and
with which modalities.

Simulation (one folder of BraTS cases, or generated cases): the case names are shuffled once with
the job's seed; the first ``test-fraction`` of them is the server's held-out test set, the next
``brain.server-fraction`` its full-modality training set (unless ``brain.server-data-dir`` names
a folder of its own), and the rest are dealt round-robin to the hospitals. Every case is read with
all four modalities and a hospital's copy has the modalities it lacks zeroed, so all parties see
the same geometry. A simulated hospital is scored on the held-out test cases restricted to its
modalities, the paper's protocol (8 real cases leave a hospital none to spare for validation).

Deployment: each party reads its own folder of case folders; a hospital only the modalities it
declares (node config ``modalities``), and it keeps ``val-fraction`` of its cases for validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from common.config import JobConfig

from .brats import MODALITIES, BratsCase, find_cases, load_case, parse_modalities
from .containers import DataError
from .synthetic_brats import make_brain_cases


@dataclass(frozen=True)
class BrainSplit:
    """Case names of a simulation: the server's test and training cases, and the hospitals' pool."""

    test: tuple[str, ...]
    server: tuple[str, ...]
    pool: tuple[str, ...]


def with_modalities(case: BratsCase, modalities: tuple[str, ...]) -> BratsCase:
    """The same case as a party holding only ``modalities`` sees it (the others zero)."""
    keep = np.array([m in modalities for m in MODALITIES])
    image = case.image if keep.all() else case.image * keep[:, None, None, None].astype(np.float32)
    return BratsCase(case.name, image, case.label, tuple(m for m in MODALITIES if m in modalities))


@lru_cache(maxsize=2)
def _generated(num_cases: int, size: int, seed: int) -> dict[str, BratsCase]:
    return {case.name: case for case in make_brain_cases(num_cases, size, seed)}


def case_names(cfg: JobConfig) -> list[str]:
    """Every case of the job's data set (simulation), sorted."""
    if cfg.dataset == "synthetic":
        return sorted(_generated(cfg.brain.synthetic_cases, cfg.brain.synthetic_size, cfg.seed))
    if not cfg.data_dir:
        raise DataError("data-dir: the brain tumour task with dataset='brats' needs a folder of case folders")
    return [path.name for path in _find(cfg, cfg.data_dir)]


def simulation_split(cfg: JobConfig) -> BrainSplit:
    names = case_names(cfg)
    order = [names[i] for i in np.random.default_rng(cfg.seed).permutation(len(names))]
    n_test = max(1, round(cfg.test_fraction * len(names)))
    n_server = 0 if cfg.brain.server_data_dir else max(1, round(cfg.brain.server_fraction * len(names)))
    if n_test + n_server >= len(names):
        raise DataError(f"{len(names)} cases: {n_test} for testing and {n_server} for the server leave none for "
                        "the hospitals; lower test-fraction or brain.server-fraction")
    return BrainSplit(tuple(order[:n_test]), tuple(order[n_test:n_test + n_server]), tuple(order[n_test + n_server:]))


def load_named_cases(cfg: JobConfig, names: tuple[str, ...],
                     modalities: tuple[str, ...] = MODALITIES) -> list[BratsCase]:
    """Cases of the simulation's data set by name, restricted to ``modalities``."""
    if cfg.dataset == "synthetic":
        generated = _generated(cfg.brain.synthetic_cases, cfg.brain.synthetic_size, cfg.seed)
        return [with_modalities(generated[name], modalities) for name in names]
    return [with_modalities(_read(cfg, Path(cfg.data_dir) / name, MODALITIES), modalities) for name in names]


def load_folder_cases(cfg: JobConfig, folder: str | Path, modalities: tuple[str, ...] = MODALITIES) -> list[BratsCase]:
    """A party's own folder of BraTS case folders, only the files of ``modalities`` read."""
    if cfg.dataset not in ("brats", "dicom"):
        raise DataError(f"{folder}: a folder of cases needs dataset='brats' or 'dicom' (generated data has no folders)")
    return [_read(cfg, case, modalities) for case in _find(cfg, folder)]


def _find(cfg: JobConfig, folder: str | Path) -> list[Path]:
    """The case folders of ``folder``: BraTS case folders, or one folder per DICOM study."""
    if cfg.dataset == "dicom":
        from .dicom_brain import find_studies

        return find_studies(folder)
    return find_cases(folder)


def _read(cfg: JobConfig, case: Path, modalities: tuple[str, ...]) -> BratsCase:
    if cfg.dataset == "dicom":
        from .dicom_brain import load_study

        return load_study(case, modalities, downsample=cfg.brain.downsample)
    return load_case(case, modalities, downsample=cfg.brain.downsample)


def simulated_modalities(cfg: JobConfig, partition_id: int) -> tuple[str, ...]:
    """Simulated hospital ``partition_id``'s modalities, from ``brain.hospital-modalities``."""
    subsets = cfg.brain.hospital_modalities.split(";")
    if partition_id >= len(subsets):
        raise DataError(f"hospital-{partition_id:02d}: brain.hospital-modalities lists modalities for "
                        f"{len(subsets)} hospitals only; add a subset for each simulated hospital")
    return parse_modalities(subsets[partition_id], "brain.hospital-modalities")


def hospital_cases(cfg: JobConfig, partition_id: int, num_partitions: int) -> tuple[str, ...]:
    """Simulated hospital ``partition_id``'s share of the pool (round-robin)."""
    split = simulation_split(cfg)
    mine = split.pool[partition_id::num_partitions]
    if not mine:
        raise DataError(f"hospital-{partition_id:02d}: {len(split.pool)} cases are left for {num_partitions} hospitals "
                        f"(after {len(split.test)} test and {len(split.server)} server cases); "
                        "use fewer hospitals or lower test-fraction / brain.server-fraction")
    return mine


def server_training_cases(cfg: JobConfig) -> list[BratsCase]:
    """The server's full-modality training cases: its own folder, or its share of the simulation."""
    if cfg.brain.server_data_dir:
        return load_folder_cases(cfg, cfg.brain.server_data_dir)
    return load_named_cases(cfg, simulation_split(cfg).server)


def test_cases(cfg: JobConfig, modalities: tuple[str, ...] = MODALITIES) -> list[BratsCase]:
    """The held-out test cases (``test-dir`` in deployment), restricted to ``modalities``."""
    if cfg.test_dir:
        return [with_modalities(case, modalities) for case in load_folder_cases(cfg, cfg.test_dir)]
    return load_named_cases(cfg, simulation_split(cfg).test, modalities)
