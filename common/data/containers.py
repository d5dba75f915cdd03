"""In-memory data sets as plain arrays: what every loader returns and every partitioner slices.

Images are kept as uint8 NHWC (compact, like the files they came from); the torch datasets in
:mod:`common.data.torch_datasets` normalise them batch by batch.

Every container has ``groups``: samples that must stay on one side of every split (the images of one skin lesion,
the frames of one colonoscopy video). Two samples with the same group value are never split between the server's
test set and the hospitals, a hospital's training and validation data, or two hospitals
(:mod:`common.data.partition`). The default is one group per sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class DataError(ValueError):
    """A data file or folder that cannot be used; the message names the file."""


def _checked_groups(groups, names: np.ndarray) -> np.ndarray:
    """Group labels as a string array, one per sample (the names, i.e. one group each, when not given)."""
    if groups is None:
        return np.asarray(names).astype(str)
    groups = np.asarray(groups)
    if groups.shape != (len(names),):
        raise DataError(f"groups has shape {groups.shape}; it must hold one group per sample ({len(names)})")
    return groups.astype(str)


@dataclass
class LabelledImages:
    """Classification data: ``images`` (N, H, W, C) uint8, ``labels`` (N,) int64."""

    images: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]
    names: np.ndarray = field(default=None)  # type: ignore[assignment]  # file or sample ids, for messages
    groups: np.ndarray = field(default=None)  # type: ignore[assignment]  # kept together by every split

    def __post_init__(self) -> None:
        if self.names is None:
            self.names = np.array([f"sample-{i}" for i in range(len(self.labels))])
        if len(self.images) != len(self.labels) or len(self.labels) != len(self.names):
            raise DataError(f"{len(self.images)} images, {len(self.labels)} labels and {len(self.names)} names")
        self.groups = _checked_groups(self.groups, self.names)
        bad = (self.labels < 0) | (self.labels >= len(self.class_names))
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise DataError(
                f"{self.names[first]}: label {int(self.labels[first])} is outside the task's "
                f"{len(self.class_names)} classes {list(self.class_names)}"
            )

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def strata(self) -> np.ndarray:
        """What partitioners stratify on: the class."""
        return self.labels

    def subset(self, index: np.ndarray) -> "LabelledImages":
        return LabelledImages(self.images[index], self.labels[index], self.class_names, self.names[index],
                              self.groups[index])

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=len(self.class_names))


@dataclass
class SegmentationImages:
    """2D binary segmentation: ``images`` (N, H, W, 3) uint8, ``masks`` (N, H, W) uint8 in {0, 1}.

    ``sources`` names the data set (site) each pair came from, so a split can keep one test set per
    data set and the by-source partitioner can make natural hospitals.
    """

    images: np.ndarray
    masks: np.ndarray
    names: np.ndarray
    sources: np.ndarray
    groups: np.ndarray = field(default=None)  # type: ignore[assignment]  # default: '<source>/<name>', one per pair

    def __post_init__(self) -> None:
        n = len(self.images)
        if not (len(self.masks) == len(self.names) == len(self.sources) == n):
            raise DataError("images, masks, names and sources differ in length")
        if self.masks.shape[:3] != self.images.shape[:3]:
            raise DataError(f"mask shape {self.masks.shape} does not match image shape {self.images.shape}")
        if self.groups is None:
            self.groups = np.array([f"{source}/{name}" for source, name in zip(self.sources, self.names)], dtype=str)
        self.groups = _checked_groups(self.groups, self.names)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def strata(self) -> np.ndarray:
        _, codes = np.unique(self.sources, return_inverse=True)
        return codes

    def subset(self, index: np.ndarray) -> "SegmentationImages":
        return SegmentationImages(self.images[index], self.masks[index], self.names[index], self.sources[index],
                                  self.groups[index])

    def source_names(self) -> list[str]:
        return sorted(set(self.sources.tolist()))


def concat(parts: list):
    """Concatenate data sets of one kind."""
    first = parts[0]
    if isinstance(first, LabelledImages):
        return LabelledImages(
            np.concatenate([p.images for p in parts]),
            np.concatenate([p.labels for p in parts]),
            first.class_names,
            np.concatenate([p.names for p in parts]),
            np.concatenate([p.groups for p in parts]),
        )
    return SegmentationImages(
        np.concatenate([p.images for p in parts]),
        np.concatenate([p.masks for p in parts]),
        np.concatenate([p.names for p in parts]),
        np.concatenate([p.sources for p in parts]),
        np.concatenate([p.groups for p in parts]),
    )
