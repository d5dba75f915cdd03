"""Reading 2D image files (JPEG/PNG) with errors that name the file, and a disk cache of decoded arrays.

Decoding ten thousand JPEGs takes a while on two cores, and in deployment every Flower message
starts a fresh process, so decoded, resized arrays are cached as ``.npz`` keyed by the files' names,
sizes and modification times and the target size.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, UnidentifiedImageError

from .containers import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff")
#: Pillow modes without colour: such a mask is thresholded as it is.
GREY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F")
#: How far a mask's R, G and B may differ and still count as grey (JPEG rounding); a colour mask differs more.
GREY_TOLERANCE = 8


def read_rgb(path: Path, size: int | None) -> np.ndarray:
    """An RGB image as (H, W, 3) uint8, resized to size x size (bilinear) when size is given."""
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            if size is not None and image.size != (size, size):
                image = image.resize((size, size), Image.BILINEAR)
            return np.asarray(image, dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(f"{path}: cannot read image ({error})") from None


def _check_grey(path: Path, rgb: np.ndarray) -> None:
    """A mask stored as RGB must have equal channels: converting a colour mask (say, red polyp on green) to grey
    and thresholding it would silently give a wrong foreground."""
    spread = rgb.max(axis=-1).astype(np.int16) - rgb.min(axis=-1)
    if spread.max() > GREY_TOLERANCE:
        y, x = np.unravel_index(int(np.argmax(spread)), spread.shape)
        raise DataError(f"{path}: colour mask (pixel x={x}, y={y} is RGB {tuple(int(c) for c in rgb[y, x])}); "
                        "a mask must be grey (or RGB with equal channels)")


def read_mask(path: Path, size: int | None, threshold: int = 127) -> np.ndarray:
    """A binary mask as (H, W) uint8 in {0, 1}: grey level above ``threshold`` is foreground.

    Grey masks with many levels (anti-aliased JPEG masks, as Kvasir-SEG ships them) are thresholded;
    colour masks are refused. Resizing uses bilinear interpolation before thresholding so that thin
    borders survive downscaling the way they do in the usual preprocessing of these data sets.
    """
    try:
        with Image.open(path) as image:
            rgb = None if image.mode in GREY_MODES else np.asarray(image.convert("RGB"))
            image = image.convert("L")
            if size is not None and image.size != (size, size):
                image = image.resize((size, size), Image.BILINEAR)
            mask = (np.asarray(image) > threshold).astype(np.uint8)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(f"{path}: cannot read mask ({error})") from None
    if rgb is not None:
        _check_grey(path, rgb)
    return mask


def image_size_of(path: Path) -> tuple[int, int]:
    try:
        with Image.open(path) as image:
            return image.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(f"{path}: cannot read image ({error})") from None


def list_images(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise DataError(f"{folder}: folder not found")
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def by_stem(paths: list[Path]) -> dict[str, Path]:
    """Files by name stem; two with one stem (x.jpg and x.png) is an error, since pairs are matched by stem and
    one of the two would be silently dropped."""
    found: dict[str, Path] = {}
    for path in paths:
        if path.stem in found:
            raise DataError(f"{found[path.stem]} and {path.name}: two files with the name {path.stem!r} in "
                            f"{path.parent}; keep one")
        found[path.stem] = path
    return found


def cache_dir() -> Path:
    return Path(os.environ.get("FEDMED_CACHE_DIR", Path.home() / ".cache" / "fedmed"))


def cached_arrays(files: list[Path], tag: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Return ``build()``'s arrays, cached on disk under a key made from the files' metadata and ``tag``."""
    digest = hashlib.sha256(tag.encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    target = cache_dir() / f"{digest.hexdigest()[:24]}.npz"
    if target.exists():
        try:
            with np.load(target, allow_pickle=False) as cached:
                return {key: cached[key] for key in cached.files}
        except (OSError, ValueError):
            target.unlink(missing_ok=True)  # a broken cache entry is rebuilt, never trusted
    arrays = build()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(partial, **arrays)
        os.replace(partial, target)
    except OSError:
        pass  # a read-only home only costs speed
    return arrays
