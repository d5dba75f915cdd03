"""Image/mask folder pairs (Kvasir-SEG, CVC-ClinicDB): ``images/<name>`` with ``masks/<name>``.

A folder is either one data set (it has ``images/`` and ``masks/``) or a collection whose
subfolders are data sets; each data set becomes a *source*, the natural unit of a site.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from .containers import DataError, SegmentationImages, concat
from .image_files import by_stem, cached_arrays, image_size_of, list_images, read_mask, read_rgb


def data_set_folders(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if (folder / "images").is_dir():
        return [folder]
    found = sorted(p for p in folder.iterdir() if (p / "images").is_dir()) if folder.is_dir() else []
    if not found:
        raise DataError(f"{folder}: no images/ and masks/ folders (nor subfolders holding them)")
    return found


def matched_pairs(folder: Path) -> list[tuple[Path, Path]]:
    """(image, mask) pairs matched by file stem; an image without a mask (or the reverse), or two files of one
    stem in a folder, is an error."""
    images = by_stem(list_images(folder / "images"))
    masks = by_stem(list_images(folder / "masks"))
    for stem in sorted(set(images) ^ set(masks)):
        if stem in images:
            raise DataError(f"{images[stem]}: no mask with the same name in {folder / 'masks'}")
        raise DataError(f"{masks[stem]}: no image with the same name in {folder / 'images'}")
    if not images:
        raise DataError(f"{folder / 'images'}: no image files")
    return [(images[stem], masks[stem]) for stem in sorted(images)]


def load_image_mask_folder(folder: Path, image_size: int, source: str | None = None) -> SegmentationImages:
    pairs = matched_pairs(folder)

    def decode() -> dict[str, np.ndarray]:
        images, masks = [], []
        for image_path, mask_path in pairs:
            if image_size_of(image_path) != image_size_of(mask_path):
                raise DataError(
                    f"{mask_path}: size {image_size_of(mask_path)} does not match its image "
                    f"{image_path.name} {image_size_of(image_path)}"
                )
            images.append(read_rgb(image_path, image_size))
            masks.append(read_mask(mask_path, image_size))
        return {"images": np.stack(images), "masks": np.stack(masks)}

    files = [path for pair in pairs for path in pair]
    arrays = cached_arrays(files, f"image-mask-{image_size}", decode)
    names = np.array([image.name for image, _ in pairs])
    sources = np.full(len(pairs), source or folder.name)
    return SegmentationImages(arrays["images"], arrays["masks"], names, sources)


def load_image_mask(folder: str | Path, image_size: int) -> SegmentationImages:
    """All data sets under ``folder``; each sample's source is its data set's folder name."""
    return concat([load_image_mask_folder(f, image_size) for f in data_set_folders(folder)])


def write_image_mask(data: SegmentationImages, folder: Path, source_root: Path) -> None:
    """Copy ``data``'s original files into ``folder/<source>/{images,masks}``."""
    pairs = {f.name: {image.name: (image, mask) for image, mask in matched_pairs(f)}
             for f in data_set_folders(source_root)}
    for name, source in zip(data.names, data.sources):
        image, mask = pairs[source][name]
        for sub, path in (("images", image), ("masks", mask)):
            target = folder / source / sub
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / path.name)
