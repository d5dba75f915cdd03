"""MedMNIST-style ``.npz`` files: ``{train,val,test}_images`` (N, H, W[, C]) uint8 and ``*_labels`` (N, 1).

A file may declare its classes in a ``class_names`` array (the files ``fedmed partition`` writes do), so a
hospital that lacks a class still has the data set's class count, and the groups its samples belong to in
``<split>_groups`` (samples every split keeps together; without it, one group per sample).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

from .containers import DataError, LabelledImages
from .image_files import MAX_IMAGE_PIXELS, regular_file

SPLITS = ("train", "val", "test")

#: Class names of the data sets we know; others get "class-<i>".
KNOWN_CLASS_NAMES = {
    8: ("basophil", "eosinophil", "erythroblast", "ig", "lymphocyte", "monocyte", "neutrophil", "platelet"),
}


#: The most bytes one array of an npz file may hold once decompressed (checked in its header before it is read: a
#: compressed npz of zeros is a zip bomb).
MAX_ARRAY_BYTES = 8 * 2**30


def find_npz(path: str | Path) -> Path:
    """The file itself, or the single ``.npz`` inside a folder; never anything but a regular file (a FIFO given as
    the file would block the reader forever)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*.npz"))
        if len(found) != 1:
            raise DataError(f"{path}: expected one .npz file in the folder, found {len(found)}")
        path = found[0]
    elif not path.exists():
        raise DataError(f"{path}: npz file (or folder holding one) not found")
    return regular_file(path, "npz file")


def _check_array_sizes(file: Path) -> None:
    """Every array's shape from its .npy header, before anything is decompressed: refuse an array over
    :data:`MAX_ARRAY_BYTES` or images over :data:`~common.data.image_files.MAX_IMAGE_PIXELS` each."""
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with archive.open(info) as handle:
                    version = np.lib.format.read_magic(handle)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(handle)
                    else:  # 2.0 (and 3.0, whose header only differs in its text encoding)
                        shape, _, dtype = np.lib.format.read_array_header_2_0(handle)
                key = info.filename[:-4]
                size = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
                if size > MAX_ARRAY_BYTES:
                    raise DataError(f"{file}: array {key!r} {shape} {dtype} would take {size / 2**30:.1f} GiB "
                                    f"(more than {MAX_ARRAY_BYTES // 2**30} GiB); split or shrink the data")
                if key.endswith("_images") and len(shape) >= 3 and shape[1] * shape[2] > MAX_IMAGE_PIXELS:
                    raise DataError(f"{file}: {key} holds {shape[2]}x{shape[1]} images, over the limit of "
                                    f"{MAX_IMAGE_PIXELS // 10**6} megapixels per image; downscale them")
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        if isinstance(error, DataError):
            raise
        raise DataError(f"{file}: cannot read npz ({error})") from None


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    if images.shape[1:3] == (size, size):
        return images
    mode = "L" if images.shape[-1] == 1 else "RGB"
    out = [np.asarray(Image.fromarray(im.squeeze(-1) if mode == "L" else im).resize((size, size), Image.BILINEAR))
           for im in images]
    out_array = np.stack(out)
    return out_array[..., None] if mode == "L" else out_array


def _ranges(values) -> str:
    """Sorted integers as short runs: [0, 1, 2, 3, 99] -> '0..3, 99'."""
    runs: list[list[int]] = []
    for value in sorted(int(v) for v in values):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}..{b}" for a, b in runs)


def _integer_labels(file: Path, split: str, labels: np.ndarray) -> np.ndarray:
    """Labels as int64; float labels only when every one is a whole number (``astype`` would turn 2.7 into 2)."""
    labels = labels.reshape(-1)
    if labels.dtype.kind in "biu":
        return labels.astype(np.int64)
    if labels.dtype.kind != "f":
        raise DataError(f"{file}: {split}_labels must be integer class indices, got dtype {labels.dtype}")
    bad = np.flatnonzero(~np.isfinite(labels) | (labels != np.round(labels)))
    if bad.size:
        raise DataError(f"{file}: {split}_labels[{bad[0]}] is {labels[bad[0]]!s}, not a whole number "
                        f"({bad.size} such label(s); labels must be integer class indices)")
    return labels.astype(np.int64)


def _declared_classes(file: Path, contents: dict[str, np.ndarray], num_classes: int) -> tuple[str, ...] | None:
    """The ``class_names`` the file declares, checked against num-classes when both are given."""
    if "class_names" not in contents:
        return None
    names = tuple(str(name) for name in contents["class_names"].reshape(-1))
    if num_classes and num_classes != len(names):
        raise DataError(f"{file}: declares {len(names)} classes in class_names, but num-classes={num_classes}")
    return names


def _inferred_class_count(file: Path, labels_all: list[np.ndarray]) -> int:
    """With num-classes=0 and no declared classes the count is max label + 1, so every class 0..max must have a
    sample: a stray label (99 among 0..3) would otherwise silently make a 100-class model."""
    present = np.unique(np.concatenate(labels_all))
    if present.size == 0:
        raise DataError(f"{file}: no labels to take the class count from; set num-classes")
    if present[0] < 0:
        raise DataError(f"{file}: label {present[0]} is negative (labels are class indices 0, 1, ...)")
    count = int(present[-1]) + 1
    missing = np.setdiff1d(np.arange(count), present)
    if missing.size:
        raise DataError(
            f"{file}: labels are {_ranges(present)}, so class(es) {_ranges(missing)} have no sample; num-classes=0 "
            f"takes the class count ({count}) from the labels, which needs every class 0..{count - 1} present: "
            "fix the labels or set num-classes"
        )
    return count


def load_npz(path: str | Path, image_size: int, num_classes: int = 0) -> dict[str, LabelledImages]:
    """Every split present in the file, as LabelledImages (grey images get a channel axis)."""
    file = find_npz(path)
    _check_array_sizes(file)
    try:
        with np.load(file, allow_pickle=False) as archive:
            contents = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        raise DataError(f"{file}: cannot read npz ({error})") from None
    splits = [s for s in SPLITS if f"{s}_images" in contents]
    if not splits:
        raise DataError(f"{file}: no '<split>_images' arrays (found {sorted(contents)})")
    labels_all = []
    for split in splits:
        if f"{split}_labels" not in contents:
            raise DataError(f"{file}: {split}_images has no {split}_labels")
        labels_all.append(_integer_labels(file, split, contents[f"{split}_labels"]))
    class_names = _declared_classes(file, contents, num_classes)
    if class_names is None:
        classes = num_classes or _inferred_class_count(file, labels_all)
        class_names = KNOWN_CLASS_NAMES.get(classes, tuple(f"class-{i}" for i in range(classes)))
    result = {}
    for split, labels in zip(splits, labels_all):
        images = contents[f"{split}_images"]
        if images.ndim == 3:
            images = images[..., None]
        if images.ndim != 4 or images.dtype != np.uint8:
            raise DataError(f"{file}: {split}_images must be (N, H, W[, C]) uint8, got {images.shape} {images.dtype}")
        if len(images) != len(labels):
            raise DataError(f"{file}: {split}_images has {len(images)} rows but {split}_labels has {len(labels)}")
        ids = contents.get(f"{split}_ids")
        names = np.array([f"{file.name}:{split}[{i}]" if ids is None else f"{file.name}:{ids[i]}"
                          for i in range(len(labels))])
        groups = contents.get(f"{split}_groups")
        if groups is not None and groups.reshape(-1).shape != (len(labels),):
            raise DataError(f"{file}: {split}_groups has shape {groups.shape}, not one group per sample "
                            f"({len(labels)})")
        if groups is None:  # one group per sample, even where ids repeat across splits
            groups = np.array([f"{file.name}:{split}[{i}]" for i in range(len(labels))])
        try:
            result[split] = LabelledImages(_resize(images, image_size), labels, class_names, names,
                                           groups.reshape(-1).astype(str))
        except DataError as error:
            raise DataError(f"{file}: {error}") from None
    return result


def write_npz(path: Path, splits: dict[str, LabelledImages]) -> None:
    """Write ``splits`` with their ``class_names``, so a part lacking some class still reads as the whole set."""
    arrays = {"class_names": np.array(next(iter(splits.values())).class_names, dtype=str)}
    for split, data in splits.items():
        arrays[f"{split}_images"] = data.images
        arrays[f"{split}_labels"] = data.labels.reshape(-1, 1).astype(np.uint8)
        arrays[f"{split}_ids"] = data.names.astype(str)
        arrays[f"{split}_groups"] = data.groups.astype(str)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
