"""Writing per-hospital folders for a deployment, split exactly as a simulation of the same job would be.

``<out>/test`` is the server's held-out test set (``test-dir``), ``<out>/hospital-NN`` each
hospital's ``data-dir``, in the data set's own format; ``<out>/manifest.json`` lists what each
holds. No group (a lesion's images, a video's frames) is split between two of them, and each folder records its
samples' groups (HAM10000's lesion_id, an image/mask data set's groups.csv, an npz file's ``<split>_groups``), so a
hospital's own validation split keeps them whole too. Generated data is written as MedMNIST-style npz
(classification) or PNG image/mask pairs (polyps), so a deployment can be tried without real data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from common.config import JobConfig

from .containers import DataError, LabelledImages, SegmentationImages
from .dicom_images import write_dicom_classification, write_dicom_segmentation
from .ham10000 import write_ham10000
from .image_mask import write_image_mask
from .medmnist_npz import write_npz
from .sources import partition_indices, simulation_split


def _write_pngs(data: SegmentationImages, folder: Path) -> None:
    for image, mask, name, source in zip(data.images, data.masks, data.names, data.sources):
        for sub, pixels in (("images", image), ("masks", mask * 255)):
            target = folder / str(source) / sub
            target.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels.astype(np.uint8)).save(target / Path(str(name)).with_suffix(".png").name)


def write_site(cfg: JobConfig, data, folder: Path, split_name: str) -> None:
    """One folder in the format the job's dataset reads (generated data: npz or PNG pairs)."""
    folder.mkdir(parents=True, exist_ok=True)
    if cfg.dataset == "dicom":
        if isinstance(data, LabelledImages):
            write_dicom_classification(data, folder, Path(cfg.data_dir))
        else:
            write_dicom_segmentation(data, folder, Path(cfg.data_dir))
    elif cfg.dataset == "ham10000":
        write_ham10000(data, folder, Path(cfg.data_dir))
    elif cfg.dataset == "image-mask":
        write_image_mask(data, folder, Path(cfg.data_dir))
    elif isinstance(data, LabelledImages):  # npz, or generated classification data
        write_npz(folder / "data.npz", {split_name: data})
    else:  # generated polyps
        _write_pngs(data, folder)


def describe(data) -> dict[str, Any]:
    groups = int(len(np.unique(data.groups)))
    if isinstance(data, LabelledImages):
        counts = data.class_counts()
        return {"samples": len(data), "groups": groups,
                "classes": {n: int(c) for n, c in zip(data.class_names, counts)}}
    sources, counts = np.unique(data.sources, return_counts=True)
    return {"samples": len(data), "groups": groups, "sources": {str(s): int(c) for s, c in zip(sources, counts)}}


def _check_groups_disjoint(sites: dict[str, Any]) -> None:
    """No group (a lesion, a video) may have samples in two sites: the test set would hold near-copies of training
    samples. The splits guarantee it; this keeps a written partition from ever breaking it silently."""
    owner: dict[str, str] = {}
    for name, data in sites.items():
        for group in np.unique(data.groups).tolist():
            if owner.setdefault(group, name) != name:
                raise DataError(f"group {group!r} has samples in both {owner[group]} and {name}; the partition must "
                                "keep groups whole")


def _check_output_folder(out: Path) -> None:
    """Refuse an output folder that already holds something: a hospital folder left from an earlier partition
    (more hospitals, another seed) would stay beside the new ones and its samples would be used twice."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a folder (the partition output must be a new or empty folder)")
    if out.is_dir() and any(out.iterdir()):
        raise DataError(f"{out}: output folder exists and is not empty; remove it or choose another --out")


def export_partitions(cfg: JobConfig, num_hospitals: int, out: Path) -> dict[str, Any]:
    """Write ``out/test`` and ``out/hospital-NN`` into a new or empty ``out``; return (and write) the manifest."""
    _check_output_folder(out)
    split = simulation_split(cfg)
    manifest: dict[str, Any] = {"dataset": cfg.dataset, "task": cfg.task, "partitioner": cfg.partitioner,
                                "dirichlet-alpha": cfg.dirichlet_alpha, "seed": cfg.seed, "sites": {}}
    sites = {"test": split.test}
    for pid, index in enumerate(partition_indices(cfg, split.pool, num_hospitals)):
        sites[f"hospital-{pid:02d}"] = split.pool.subset(index)
    _check_groups_disjoint(sites)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in sites.items():
        write_site(cfg, part, out / name, "test" if name == "test" else "train")
        manifest["sites"][name] = describe(part)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
