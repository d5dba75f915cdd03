"""Which samples a hospital trains on and which the server tests on, for a given job.

Simulation: one data set (``data-dir``, or generated) is split once, the same way everywhere:
a held-out test part for the server, the rest partitioned across ``num-partitions`` hospitals.
Deployment: a hospital's node config names its own folder, in the data set's native format, and
the server reads its test set from ``test-dir``. Either way a hospital keeps ``val-fraction`` of
its samples for validating the models it receives.

Every split here keeps a container's ``groups`` whole (one lesion's images, one video's frames), so no test or
validation sample has a near-copy on the other side (:mod:`common.data.partition`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from common.config import JobConfig
from common.trust.code_gate import parse_arguments

from .containers import DataError, LabelledImages, SegmentationImages, concat
from .ham10000 import load_ham10000
from .image_mask import load_image_mask
from .medmnist_npz import load_npz
from .partition import partition, stratified_holdout
from .synthetic import make_classification, make_polyps

TEST_SEED_OFFSET = 10_007  # generated test sets never share a seed with training data


@dataclass(frozen=True)
class Split:
    """The whole data set of a simulation, split: ``pool`` is partitioned, ``test`` is the server's."""

    pool: LabelledImages | SegmentationImages
    test: LabelledImages | SegmentationImages


def generate(task: str, num_samples: int, image_size: int, seed: int, num_classes: int = 0):
    """Generated data for a 2D task (the brain task generates its own volumes)."""
    if task == "classification":
        return make_classification(num_samples, image_size, seed, num_classes or 4)
    if task == "polyp-segmentation":
        return make_polyps(num_samples, image_size, seed)
    raise DataError(f"task {task!r}: generated data lives with the brain tumour method")


def load_folder(cfg: JobConfig, folder: str | Path) -> LabelledImages | SegmentationImages:
    """Everything in one folder of the job's data set format (a hospital's or the server's)."""
    return _load_folder(cfg.task, cfg.dataset, str(folder), cfg.image_size, cfg.num_classes, cfg.dataset_args)


def _load_folder(task: str, dataset: str, folder: str, image_size: int, num_classes: int, dataset_args: str = ""):
    if dataset == "dicom":
        from .dicom_images import load_dicom_classification, load_dicom_segmentation

        if task == "classification":
            classes = parse_arguments(dataset_args, "dataset-args").get("classes", ())
            return load_dicom_classification(folder, image_size, tuple(classes))
        return load_dicom_segmentation(folder, image_size)
    if dataset == "ham10000":
        return load_ham10000(folder, image_size)
    if dataset == "npz":
        return concat(list(load_npz(folder, image_size, num_classes).values()))
    if dataset == "image-mask":
        return load_image_mask(folder, image_size)
    raise DataError(f"dataset {dataset!r} has no folder loader here")


@lru_cache(maxsize=4)
def _split(task: str, dataset: str, data_dir: str, image_size: int, num_classes: int, seed: int,
           test_fraction: float, synthetic_samples: int, dataset_args: str = "") -> Split:
    if dataset == "synthetic":
        test_size = max(100, int(synthetic_samples * test_fraction))
        return Split(generate(task, synthetic_samples, image_size, seed, num_classes),
                     generate(task, test_size, image_size, seed + TEST_SEED_OFFSET, num_classes))
    if dataset == "npz":
        splits = load_npz(data_dir, image_size, num_classes)
        if "test" not in splits:
            raise DataError(f"{data_dir}: the npz file has no test split for the server")
        pool = concat([splits[s] for s in ("train", "val") if s in splits])
        shared = np.intersect1d(pool.groups, splits["test"].groups)
        if shared.size:  # only groups the file declares can meet here (by default each sample is its own)
            raise DataError(f"{data_dir}: the npz file's test split shares {shared.size} group(s) with its train/val "
                            f"splits (e.g. {str(shared[0])!r}), so the server would test on samples the hospitals "
                            "train on; split the file by group")
        return Split(pool, splits["test"])
    data = _load_folder(task, dataset, data_dir, image_size, num_classes, dataset_args)
    kept, held_out = stratified_holdout(data.strata, test_fraction, seed, groups=data.groups)
    return Split(data.subset(kept), data.subset(held_out))


def simulation_split(cfg: JobConfig) -> Split:
    """The job's data set split into pool and test (cached per process: Ray actors and benchmarks reuse it)."""
    return _split(cfg.task, cfg.dataset, cfg.data_dir, cfg.image_size, cfg.num_classes, cfg.seed,
                  cfg.test_fraction, cfg.synthetic_samples, cfg.dataset_args)


_PARTITIONS: dict[tuple, tuple[Any, list[np.ndarray]]] = {}  # split settings -> (the pool split, its parts)


def partition_indices(cfg: JobConfig, pool, num_partitions: int) -> list[np.ndarray]:
    """Each hospital's indices into ``pool``, computed once per pool and split settings: every virtual hospital
    of a simulation asks for its own part with every message (12 ms each for 1000 hospitals' parts)."""
    key = (cfg.partitioner, cfg.dirichlet_alpha, cfg.min_partition_size, cfg.seed, num_partitions)
    cached = _PARTITIONS.get(key)
    if cached is None or cached[0] is not pool:
        if len(_PARTITIONS) >= 8:
            _PARTITIONS.clear()
        cached = _PARTITIONS[key] = (pool, partition(pool.strata, num_partitions, cfg.partitioner,
                                                     alpha=cfg.dirichlet_alpha, min_size=cfg.min_partition_size,
                                                     seed=cfg.seed, groups=getattr(pool, "groups", None)))
    return cached[1]


def simulated_hospital(cfg: JobConfig, partition_id: int, num_partitions: int):
    """Partition ``partition_id`` of the pool: this virtual hospital's samples."""
    if not 0 <= partition_id < num_partitions:
        raise DataError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    pool = simulation_split(cfg).pool
    return pool.subset(partition_indices(cfg, pool, num_partitions)[partition_id])


def train_val(data, val_fraction: float, seed: int):
    """A hospital's own train/validation split (stratified, seeded, whole groups)."""
    if val_fraction <= 0 or len(data) < 4:
        return data, data.subset(np.arange(0))
    kept, held_out = stratified_holdout(data.strata, val_fraction, seed, groups=data.groups)
    return data.subset(kept), data.subset(held_out)


def server_test_set(cfg: JobConfig):
    """The server's held-out test set: ``test-dir`` when given (deployment), else the split's test part."""
    if cfg.test_dir:
        return load_folder(cfg, cfg.test_dir)
    return simulation_split(cfg).test
