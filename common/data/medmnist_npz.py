"""MedMNIST-style ``.npz`` files: ``{train,val,test}_images`` (N, H, W[, C]) uint8 and ``*_labels`` (N, 1)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

from .containers import DataError, LabelledImages

SPLITS = ("train", "val", "test")

#: Class names of the data sets we know; others get "class-<i>".
KNOWN_CLASS_NAMES = {
    8: ("basophil", "eosinophil", "erythroblast", "ig", "lymphocyte", "monocyte", "neutrophil", "platelet"),
}


def find_npz(path: str | Path) -> Path:
    """The file itself, or the single ``.npz`` inside a folder."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.glob("*.npz")) if path.is_dir() else []
    if len(found) != 1:
        raise DataError(f"{path}: expected one .npz file, found {len(found)}")
    return found[0]


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    if images.shape[1:3] == (size, size):
        return images
    mode = "L" if images.shape[-1] == 1 else "RGB"
    out = [np.asarray(Image.fromarray(im.squeeze(-1) if mode == "L" else im).resize((size, size), Image.BILINEAR))
           for im in images]
    out_array = np.stack(out)
    return out_array[..., None] if mode == "L" else out_array


def load_npz(path: str | Path, image_size: int, num_classes: int = 0) -> dict[str, LabelledImages]:
    """Every split present in the file, as LabelledImages (grey images get a channel axis)."""
    file = find_npz(path)
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
        labels_all.append(contents[f"{split}_labels"].reshape(-1))
    classes = num_classes or int(max(int(lab.max()) for lab in labels_all if lab.size) + 1)
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
        try:
            result[split] = LabelledImages(_resize(images, image_size), labels.astype(np.int64), class_names, names)
        except DataError as error:
            raise DataError(f"{file}: {error}") from None
    return result


def write_npz(path: Path, splits: dict[str, LabelledImages]) -> None:
    arrays = {}
    for split, data in splits.items():
        arrays[f"{split}_images"] = data.images
        arrays[f"{split}_labels"] = data.labels.reshape(-1, 1).astype(np.uint8)
        arrays[f"{split}_ids"] = data.names.astype(str)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
