"""Image/mask folder pairs (Kvasir-SEG, CVC-ClinicDB): ``images/<name>`` with ``masks/<name>``.

A folder is either one data set (it has ``images/`` and ``masks/``) or a collection whose
subfolders are data sets; each data set becomes a *source*, the natural unit of a site.

Groups (pairs that every split keeps together, :mod:`common.data.partition`): a data set folder may list them in
``groups.csv`` (columns ``image,group``: every image of ``images/`` once; ``fedmed partition`` writes it). Without
that file, a data set whose image names are all whole numbers (``1.jpg``, ``2.jpg``, ... as CVC-ClinicDB) holds
frames of videos and its frames are grouped into video sequences (:func:`frame_sequences`); any other data set
(Kvasir-SEG: one independent image per polyp) has one group per image.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from .containers import DataError, SegmentationImages, concat
from .image_files import (
    by_stem,
    cached_arrays,
    image_size_of,
    list_images,
    open_image,
    read_mask,
    read_rgb,
    regular_file,
)

GROUPS_FILE = "groups.csv"

# --- video frames: which consecutive frames are one sequence ------------------------------------------------------
#: Frames whose ids differ by more than this are never one sequence (a missing frame or two is allowed).
FRAME_MAX_ID_GAP = 2
#: How many frames on each side of a candidate cut are compared.
FRAME_WINDOW = 5
#: The cut threshold on the frame distance (see :func:`frame_distance`; about 1 for neighbouring frames of a video).
FRAME_THRESHOLD = 4.25
#: A sequence shorter than this is merged into the neighbour it is closer to (a flash, a blurred frame).
FRAME_MIN_RUN = 3
_MAD_SCALE = 10.0  # grey levels: the typical mean absolute difference of neighbouring 16x16 thumbnails
_HIST_SCALE = 0.1  # the typical colour-histogram distance of neighbouring frames


def data_set_folders(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise DataError(f"{folder}: is a file, not a folder; an image/mask data set is a folder holding images/ and "
                        f"masks/ (or subfolders that do): give {folder.parent} or the folder above it")
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


def _frame_features(paths: list[Path]) -> dict[str, np.ndarray]:
    """Per frame: a 16x16 RGB thumbnail and a 16-bin histogram of each colour channel (of a 64x64 box-filtered
    copy, so the same frame gives the same features at any image-size)."""
    def build() -> dict[str, np.ndarray]:
        small, hist = [], []
        for path in paths:
            with open_image(path) as image:
                pixels = np.asarray(image.convert("RGB").resize((64, 64), Image.BOX))
            small.append(pixels.astype(np.float32).reshape(16, 4, 16, 4, 3).mean(axis=(1, 3)))
            hist.append(np.stack([np.bincount(pixels[..., c].ravel() // 16, minlength=16) for c in range(3)]) / 4096)
        return {"small": np.stack(small).astype(np.float32), "hist": np.stack(hist).astype(np.float32)}

    return cached_arrays(paths, "frame-features-v1", build)


def frame_distance(features: dict[str, np.ndarray], a: int, b: int) -> float:
    """How unlike two frames are: the mean absolute difference of their 16x16 thumbnails in units of 10 grey levels
    plus the total-variation distance of their colour histograms (mean over R, G, B) in units of 0.1. Neighbouring
    frames of one video score about 1 each (the medians over CVC-ClinicDB's neighbours are 11.1 and 0.11)."""
    mad = float(np.abs(features["small"][a] - features["small"][b]).mean()) / _MAD_SCALE
    tv = float(np.abs(features["hist"][a] - features["hist"][b]).sum()) / 6 / _HIST_SCALE
    return mad + tv


def frame_sequences(ids: list[int], features: dict[str, np.ndarray]) -> list[list[int]]:
    """Frames (positions into ``ids``, ascending ids) grouped into video sequences, deterministically:

    1. Frames are taken in id order; two consecutive ids more than :data:`FRAME_MAX_ID_GAP` apart are a cut.
    2. Between two consecutive frames a and b the cut score is the *smallest* :func:`frame_distance` between any of
       the last :data:`FRAME_WINDOW` frames up to a and any of the first :data:`FRAME_WINDOW` from b (not across an
       id gap), so one odd frame or a fast camera move inside a video is bridged by the frames around it; a score
       above :data:`FRAME_THRESHOLD` is a cut.
    3. A sequence of fewer than :data:`FRAME_MIN_RUN` frames is merged into the neighbouring sequence it is closer
       to (the smallest distance between its frames and that neighbour's :data:`FRAME_WINDOW` nearest; the earlier
       on a tie; never across an id gap), the first such sequence first, until none is left.

    On the 399 frames of CVC-ClinicDB (ids 1..400 without 133) this gives 20 sequences of 5 to 47 frames. Looked
    at frame by frame, its cuts fall where the scene changes to another polyp, but for one it misses (206-227 and
    228-252 are one group) and two it may add (after 309 and 388, where the light or view changes). A missed cut
    only merges two videos, which keeps splits cautious. The sequences are a property of the frames alone: the same
    at any image-size, seed or split.
    """
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    n = len(order)
    if n < 2:
        return [order]
    gap = [ids[order[p + 1]] - ids[order[p]] > FRAME_MAX_ID_GAP for p in range(n - 1)]
    run_start = [0] * n
    for p in range(1, n):
        run_start[p] = p if gap[p - 1] else run_start[p - 1]
    run_end = [n - 1] * n
    for p in range(n - 2, -1, -1):
        run_end[p] = p if gap[p] else run_end[p + 1]
    score = np.full(n - 1, np.inf)
    for p in range(n - 1):
        if gap[p]:
            continue
        before = range(max(run_start[p], p - FRAME_WINDOW + 1), p + 1)
        after = range(p + 1, min(run_end[p + 1], p + FRAME_WINDOW) + 1)
        score[p] = min(frame_distance(features, order[x], order[y]) for x in before for y in after)
    bounds = [0] + [p + 1 for p in range(n - 1) if score[p] > FRAME_THRESHOLD] + [n]
    segments = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    def closeness(segment: list[int], neighbour: list[int]) -> float:
        near = neighbour[-FRAME_WINDOW:] if neighbour[-1] < segment[0] else neighbour[:FRAME_WINDOW]
        return min(frame_distance(features, order[x], order[y]) for x in segment for y in near)

    while True:
        for i, segment in enumerate(segments):
            if len(segment) >= FRAME_MIN_RUN:
                continue
            left = closeness(segment, segments[i - 1]) if i > 0 and not gap[segment[0] - 1] else np.inf
            right = (closeness(segment, segments[i + 1]) if i < len(segments) - 1 and not gap[segment[-1]]
                     else np.inf)
            if np.isinf(left) and np.isinf(right):
                continue  # alone between id gaps
            j = i - 1 if left <= right else i + 1
            a, b = sorted((i, j))
            segments[a:b + 1] = [segments[a] + segments[b]]
            break
        else:
            break
    return [[order[p] for p in segment] for segment in segments]


def _listed_groups(folder: Path, names: list[str]) -> list[str] | None:
    """Groups from ``folder/groups.csv`` (each image of the data set listed once), or None without that file."""
    path = folder / GROUPS_FILE
    if not path.exists():
        return None
    regular_file(path, "groups file")
    known = set(names)
    found: dict[str, str] = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"image", "group"} - set(reader.fieldnames or [])
        if missing:
            raise DataError(f"{path}: missing column(s) {sorted(missing)} (a groups file has columns image,group)")
        for row in reader:
            name, group = (row["image"] or "").strip(), (row["group"] or "").strip()
            if name not in known:
                raise DataError(f"{path}, line {reader.line_num}: {name!r} is not an image of {folder / 'images'}")
            if name in found:
                raise DataError(f"{path}, line {reader.line_num}: {name!r} is listed twice")
            if not group:
                raise DataError(f"{path}, line {reader.line_num}: {name!r} has an empty group")
            found[name] = group
    unlisted = [name for name in names if name not in found]
    if unlisted:
        raise DataError(f"{path}: {len(unlisted)} image(s) have no group, e.g. {unlisted[0]!r}; list every image of "
                        f"{folder / 'images'} or remove the file")
    return [found[name] for name in names]


def pair_groups(folder: Path, images: list[Path]) -> list[str]:
    """Each image's group within its data set (see the module's docstring)."""
    names = [path.name for path in images]
    listed = _listed_groups(folder, names)
    if listed is not None:
        return listed
    stems = [path.stem for path in images]
    if len(images) < 2 or not all(stem.isascii() and stem.isdigit() for stem in stems):
        return names
    ids = [int(stem) for stem in stems]
    groups = [""] * len(images)
    for sequence in frame_sequences(ids, _frame_features(images)):
        first, last = min(ids[i] for i in sequence), max(ids[i] for i in sequence)
        for i in sequence:
            groups[i] = f"frames-{first}-{last}"
    return groups


def _check_not_all_foreground(masks: np.ndarray, pairs: list[tuple[Path, Path]]) -> None:
    """A polyp mask whose every pixel is foreground is almost certainly inverted (polyp black on white) or the wrong
    file; those that are full after resizing are read again at their own size to be sure."""
    full = np.flatnonzero(masks.reshape(len(masks), -1).all(axis=1))
    for index in full:
        path = pairs[int(index)][1]
        if read_mask(path, None).all():
            raise DataError(f"{path}: every pixel of the mask is foreground (above grey level 127); a polyp mask "
                            f"marks the polyp white on a black background: check whether it is inverted or not "
                            f"the mask of {pairs[int(index)][0].name}, and fix or remove the pair")


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
    _check_not_all_foreground(arrays["masks"], pairs)
    names = np.array([image.name for image, _ in pairs])
    source = source or folder.name
    sources = np.full(len(pairs), source)
    groups = np.array([f"{source}/{group}" for group in pair_groups(folder, [image for image, _ in pairs])])
    return SegmentationImages(arrays["images"], arrays["masks"], names, sources, groups)


def load_image_mask(folder: str | Path, image_size: int) -> SegmentationImages:
    """All data sets under ``folder``; each sample's source is its data set's folder name."""
    return concat([load_image_mask_folder(f, image_size) for f in data_set_folders(folder)])


def write_image_mask(data: SegmentationImages, folder: Path, source_root: Path) -> None:
    """Copy ``data``'s original files into ``folder/<source>/{images,masks}``, with a ``groups.csv`` per source so the
    copy keeps the groups of the whole data set (a hospital's own validation split keeps them whole too)."""
    pairs = {f.name: {image.name: (image, mask) for image, mask in matched_pairs(f)}
             for f in data_set_folders(source_root)}
    listed: dict[str, list[tuple[str, str]]] = {}
    for name, source, group in zip(data.names, data.sources, data.groups):
        image, mask = pairs[source][name]
        for sub, path in (("images", image), ("masks", mask)):
            target = folder / source / sub
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / path.name)
        prefix = f"{source}/"
        listed.setdefault(str(source), []).append((image.name, group[len(prefix):] if group.startswith(prefix)
                                                    else group))
    for source, rows in listed.items():
        with (folder / source / GROUPS_FILE).open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["image", "group"])
            writer.writerows(rows)
