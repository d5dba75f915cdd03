"""A consortium's own data set, as our tasks read data: any map-style torch ``Dataset`` whose items are
``(image, target)`` (an image tensor ready for the network, a class index or a mask).

The tasks batch it through a ``DataLoader`` (``data-workers`` processes, pinned memory on a GPU) in the order the
method draws (shuffled, class-balanced), and leave augmentation to the data set's own transforms. Labels are read
from ``dataset.targets`` (torchvision's convention) where it has them, else once from the items.
"""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from .containers import DataError


class TorchData:
    """``dataset`` with what the tasks ask of a data set: its length, labels, class names, subsets and batches."""

    def __init__(self, dataset: Dataset, where: str, class_names: tuple[str, ...] | None = None,
                 workers: int = 0):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise DataError(f"{where}: {type(dataset).__name__} is not a map-style torch Dataset "
                            "(it needs __len__ and __getitem__)")
        self.dataset = dataset
        self.where = where
        self.workers = workers
        self._class_names = class_names

    def __len__(self) -> int:
        return len(self.dataset)

    def item(self, index: int) -> tuple[torch.Tensor, Any]:
        image, target = pair(self.dataset[int(index)], f"{self.where}: item {index}")
        if not isinstance(image, torch.Tensor):
            try:
                image = torch.as_tensor(np.asarray(image))
            except (TypeError, ValueError):
                raise DataError(f"{self.where}: item {index}'s image is {type(image).__name__}, not a tensor") from None
        return image, target

    # --- labels (classification) and masks (segmentation) -------------------------------------------
    @cached_property
    def labels(self) -> np.ndarray:
        targets = getattr(self.dataset, "targets", None)
        if targets is None and isinstance(self.dataset, Subset):
            parent = getattr(self.dataset.dataset, "targets", None)
            targets = None if parent is None else np.asarray(parent)[np.asarray(self.dataset.indices)]
        if targets is None:
            targets = [self.item(i)[1] for i in range(len(self))]
        labels = np.asarray([int(t) for t in np.asarray(targets).reshape(len(self), -1)[:, 0]], dtype=np.int64)
        if len(labels) and labels.min() < 0:
            raise DataError(f"{self.where}: label {labels.min()} is negative")
        return labels

    @cached_property
    def masks(self) -> np.ndarray:
        """(N, H, W) uint8 masks in {0, 1} (a target of (1, H, W) or (H, W), thresholded at 0.5)."""
        targets = [torch.as_tensor(self.item(i)[1]) for i in range(len(self))]
        masks = [t.reshape(t.shape[-2:]) for t in targets]
        return (torch.stack(masks) > 0.5).numpy().astype(np.uint8) if masks else np.zeros((0, 1, 1), np.uint8)

    @property
    def class_names(self) -> tuple[str, ...]:
        if self._class_names is None:
            classes = getattr(self.dataset, "classes", None)
            count = int(self.labels.max()) + 1 if len(self) else 0
            self._class_names = tuple(str(c) for c in classes) if classes else tuple(str(c) for c in range(count))
        return self._class_names

    @property
    def names(self) -> np.ndarray:
        return np.array([f"{self.where}[{i}]" for i in range(len(self))])

    @property
    def strata(self) -> np.ndarray:
        return self.labels

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=len(self.class_names))

    @property
    def sources(self) -> np.ndarray:
        return np.array([self.where] * len(self))

    def source_names(self) -> list[str]:
        return [self.where]

    @property
    def in_channels(self) -> int:
        return int(self.item(0)[0].shape[0]) if len(self) else 3

    def subset(self, index: np.ndarray) -> "TorchData":
        return TorchData(Subset(self.dataset, [int(i) for i in index]), self.where, self._class_names, self.workers)

    # --- batches --------------------------------------------------------------------------------------
    def batches(self, order: Iterable[np.ndarray], device: torch.device,
                segmentation: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, targets) for each index array of ``order``, read by a DataLoader (``workers`` processes)."""
        workers = self.workers if self.workers >= 0 else (min(4, os.cpu_count() or 1) if device.type == "cuda" else 0)
        loader = DataLoader(self.dataset, batch_sampler=[[int(i) for i in index] for index in order],
                            num_workers=workers, pin_memory=device.type == "cuda", collate_fn=collate)
        batches = iter(loader)
        while True:
            try:
                images, targets = next(batches)
            except StopIteration:
                return
            except DataError:
                raise
            except (RuntimeError, ValueError, TypeError, IndexError) as error:  # torch says what, we say where
                raise DataError(f"{self.where}: its items cannot be batched ({type(error).__name__}: "
                                f"{str(error)[:300]}): every image must be a tensor of one shape") from None
            if not torch.isfinite(images).all():
                raise DataError(f"{self.where}: an image of the batch holds NaN or Inf values; a hospital trains only "
                                "on finite images")
            x = images.to(device, non_blocking=True).to(torch.float32, memory_format=torch.contiguous_format)
            if segmentation:
                y = targets.to(device, non_blocking=True).float()
                yield x, (y if y.ndim == 4 else y.unsqueeze(1))
            else:
                yield x, targets.to(device, non_blocking=True).long().view(-1)


#: the keys of a dict item's image and target, as Hugging Face and Flower Datasets name them ({"img", "label"})
IMAGE_KEYS = ("img", "image", "pixel_values", "x")
TARGET_KEYS = ("label", "labels", "target", "mask", "y")


def pair(item: Any, what: str) -> tuple[Any, Any]:
    """An item as ``(image, target)``: a pair as it is, or a dict's entries under one of :data:`IMAGE_KEYS` and one
    of :data:`TARGET_KEYS` (a Flower Datasets partition with its transforms gives ``{"img": ..., "label": ...}``)."""
    if isinstance(item, dict):
        image = next((key for key in IMAGE_KEYS if key in item), None)
        target = next((key for key in TARGET_KEYS if key in item), None)
        if image is None or target is None:
            raise DataError(f"{what} is a dict of {sorted(item)}: an image under one of {list(IMAGE_KEYS)} and a "
                            f"target under one of {list(TARGET_KEYS)} are needed")
        return item[image], item[target]
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise DataError(f"{what} is {type(item).__name__}, not an (image, target) pair")
    return item[0], item[1]


def collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(image, target) items, or dicts of them -> (images, targets) tensors (a module-level function: worker
    processes pickle it)."""
    images, targets = zip(*(pair(item, "an item") for item in items))
    images = [img if isinstance(img, torch.Tensor) else torch.as_tensor(np.asarray(img)) for img in images]
    return torch.stack(images), torch.stack([torch.as_tensor(t) for t in targets])
