"""Reading 2D image files (JPEG/PNG) with errors that name the file, and a disk cache of decoded arrays.

Decoding ten thousand JPEGs takes a while on two cores, and in deployment every Flower message
starts a fresh process, so decoded, resized arrays are cached as ``.npz`` keyed by the files' names,
sizes and modification times and the target size.
"""

from __future__ import annotations

import hashlib
import os
import stat
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from PIL import Image, UnidentifiedImageError

from .containers import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff")
#: Pillow modes without colour: such a mask is thresholded as it is.
GREY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F")
#: How far a mask's R, G and B may differ and still count as grey (JPEG rounding); a colour mask differs more.
GREY_TOLERANCE = 8
#: The largest image (width x height) read: an image is decoded whole before it is resized, and a PNG of 144
#: megapixels compresses to a few kB, so sizes are checked in the file's header before anything is decoded.
MAX_IMAGE_PIXELS = 50_000_000

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def regular_file(path: Path, what: str = "file") -> Path:
    """``path`` when it is a regular file (links followed); else a DataError saying what it is. A FIFO would block
    its reader forever and a device never ends, so neither is opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"{path}: {what} not found") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read {what} ({error.strerror or error})") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise DataError(f"{path}: is {kind}, not a regular file; give the {what} itself (a FIFO, device or socket "
                        "is never read)")
    return path


def _bomb(path: Path, error: Exception) -> DataError:
    return DataError(f"{path}: refused as a decompression bomb ({error}); images over {MAX_IMAGE_PIXELS // 10**6} "
                     "megapixels are not read: downscale it first")


@contextmanager
def open_image(path: Path, what: str = "image") -> Iterator[Image.Image]:
    """The image opened lazily (header only), refused when it is not a regular file, larger than
    :data:`MAX_IMAGE_PIXELS` in its header, or a Pillow decompression bomb (error or warning) -- before any pixel is
    decoded. Other read errors are DataErrors naming the file too."""
    regular_file(path, what)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(path)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise _bomb(path, error) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
            raise DataError(f"{path}: cannot read {what} ({error})") from None
        with image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise DataError(f"{path}: {width}x{height} pixels ({width * height / 1e6:.0f} megapixels) is over "
                                f"the limit of {MAX_IMAGE_PIXELS // 10**6} megapixels for one {what} (it would be "
                                "decoded whole before resizing); downscale it first")
            try:
                yield image
            except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
                raise _bomb(path, error) from None


def read_rgb(path: Path, size: int | None) -> np.ndarray:
    """An RGB image as (H, W, 3) uint8, resized to size x size (bilinear) when size is given."""
    try:
        with open_image(path) as image:
            image = image.convert("RGB")
            if size is not None and image.size != (size, size):
                image = image.resize((size, size), Image.BILINEAR)
            return np.asarray(image, dtype=np.uint8).copy()
    except DataError:
        raise
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
        with open_image(path, "mask") as image:
            rgb = None if image.mode in GREY_MODES else np.asarray(image.convert("RGB"))
            image = image.convert("L")
            if size is not None and image.size != (size, size):
                image = image.resize((size, size), Image.BILINEAR)
            mask = (np.asarray(image) > threshold).astype(np.uint8)
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(f"{path}: cannot read mask ({error})") from None
    if rgb is not None:
        _check_grey(path, rgb)
    return mask


def image_size_of(path: Path) -> tuple[int, int]:
    """(width, height) from the file's header, nothing decoded (the same checks as reading it)."""
    with open_image(path) as image:
        return image.size


def list_images(folder: Path) -> list[Path]:
    """The image files of ``folder``, sorted; an entry with an image name that is not a regular file (a FIFO, a
    folder, a device) is an error naming it."""
    if not folder.is_dir():
        if folder.exists():
            raise DataError(f"{folder}: is a file, not a folder of images")
        raise DataError(f"{folder}: folder not found")
    found = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    for path in found:
        regular_file(path, "image")
    return found


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
