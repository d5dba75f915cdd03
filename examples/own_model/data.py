"""A consortium's own data, as torch Datasets: loaders named in the run config (``dataset='data:image_folders'``).

Each hospital keeps its images in its own folder (in a simulation, one folder holds every hospital's and each takes
its part): ``<folder>/<class>/*.png`` for classification, ``<folder>/images/*.png`` + ``<folder>/masks/*.png`` for
segmentation. fedmed calls a loader with a ``DataRequest`` (common/data/loaders.py) and takes what it returns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

MEAN, STD = 0.5, 0.25


def to_tensor(path: Path, size: int) -> torch.Tensor:
    image = Image.open(path).convert("RGB").resize((size, size))
    return (torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1) - MEAN) / STD


class LabelledFolder(Dataset):
    """(image, class index) pairs; ``targets`` and ``classes`` as torchvision's ImageFolder has them."""

    def __init__(self, items: list[tuple[Path, int]], classes: list[str], size: int, flips: bool = False):
        self.items, self.classes, self.size, self.flips = items, classes, size, flips
        self.targets = [label for _, label in items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        path, label = self.items[index]
        image = to_tensor(path, self.size)
        if self.flips and torch.rand(()) < 0.5:  # this data set's own augmentation
            image = image.flip(-1)
        return image, label


class MaskFolder(Dataset):
    """(image, mask) pairs, masks as (1, H, W) floats in {0, 1}."""

    def __init__(self, pairs: list[tuple[Path, Path]], size: int):
        self.pairs, self.size = pairs, size

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int):
        image, mask = self.pairs[index]
        target = np.asarray(Image.open(mask).convert("L").resize((self.size, self.size), Image.NEAREST)) > 127
        return to_tensor(image, self.size), torch.from_numpy(target[None].astype(np.float32))


def my_part(items: list, request) -> list:
    """In a simulation every hospital reads the same folder and takes its share; deployed, it has its own."""
    if request.partition_id is None:
        return items
    return items[request.partition_id::request.num_partitions]


def split(items: list, seed: int, val_share: float = 0.2) -> tuple[list, list]:
    order = np.random.default_rng(seed).permutation(len(items))
    cut = max(1, int(len(items) * val_share))
    return [items[i] for i in sorted(order[cut:])], [items[i] for i in sorted(order[:cut])]


def image_folders(request):
    """Classification: hospitals read ``<data-dir>/train/<class>/``, the server ``<data-dir>/test/<class>/``."""
    size = int(request.args.get("size", request.job.image_size))
    root = Path(request.data_dir)
    folder = root / ("test" if request.role == "server" else "train")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    items = [(path, label) for label, name in enumerate(classes) for path in sorted((folder / name).glob("*.png"))]
    if request.role == "server":
        return LabelledFolder(items, classes, size)
    train, val = split(my_part(items, request), request.seed)
    return LabelledFolder(train, classes, size, flips=True), LabelledFolder(val, classes, size)


def mask_folders(request):
    """Segmentation: ``<data-dir>/train/{images,masks}/`` for hospitals, ``<data-dir>/test/...`` for the server."""
    size = int(request.args.get("size", request.job.image_size))
    folder = Path(request.data_dir) / ("test" if request.role == "server" else "train")
    pairs = [(path, folder / "masks" / path.name) for path in sorted((folder / "images").glob("*.png"))]
    if request.role == "server":
        return MaskFolder(pairs, size)
    train, val = split(my_part(pairs, request), request.seed)
    return MaskFolder(train, size), MaskFolder(val, size)
