"""HAM10000 in its own layout: ``images/<image_id>.jpg`` and ``HAM10000_metadata.csv``.

HAM10000 holds several images of many lesions (7470 lesions in 10015 images): the metadata's ``lesion_id`` is each
image's group, so every split keeps a lesion's images on one side (split by image, 755 of 2003 test images had
another image of their lesion among the hospitals'). A file without that column (or a row with it empty) has one
group per image.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from .containers import DataError, LabelledImages
from .image_files import cached_arrays, read_rgb, regular_file

#: The seven diagnoses in the usual (alphabetical) order; label i is HAM10000_CLASSES[i].
HAM10000_CLASSES = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")
METADATA_FILE = "HAM10000_metadata.csv"


def _check_image_id(path: Path, line_number: int, image_id: str | None, images: Path) -> None:
    """An image_id must name a file directly inside ``images/`` (``images`` is that folder, resolved): an id such
    as '../../outside', or a link out of the folder, would make a hospital read a file outside its data."""
    if not image_id or "/" in image_id or "\\" in image_id or ".." in image_id or "\0" in image_id:
        raise DataError(f"{path}, line {line_number}: image_id {image_id!r} is not a plain file name "
                        f"(it must not be empty or hold '/', '\\' or '..')")
    target = (images / f"{image_id}.jpg").resolve()
    if not target.is_relative_to(images):
        raise DataError(f"{path}, line {line_number}: images/{image_id}.jpg resolves to {target}, outside {images}")


def _check_folder(folder: Path) -> None:
    """``data-dir`` must be the folder, not the metadata file in it (nor any other file)."""
    if folder.exists() and not folder.is_dir():
        hint = (f"give its folder {folder.parent}" if folder.name == METADATA_FILE else
                f"give the folder that holds {METADATA_FILE} and images/")
        raise DataError(f"{folder}: is a file, not a folder; a HAM10000 data-dir is the folder that holds "
                        f"{METADATA_FILE} and images/: {hint}")
    if not folder.exists():
        raise DataError(f"{folder}: HAM10000 folder not found (it holds {METADATA_FILE} and images/)")


def read_metadata(folder: Path) -> list[tuple[str, str, str]]:
    """(image_id, dx, group) rows of the metadata file, checked for the columns, the class set, ids that are not
    plain file names and ids listed twice (one image would land in two of train/validation/test). The group is the
    row's lesion_id, or its image_id when there is no lesion_id."""
    _check_folder(folder)
    path = folder / METADATA_FILE
    if not path.exists():
        raise DataError(f"{path}: metadata file not found (a HAM10000 folder holds {METADATA_FILE} and images/)")
    regular_file(path, "metadata file")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"image_id", "dx"} - set(reader.fieldnames or [])
        if missing:
            raise DataError(f"{path}: missing column(s) {sorted(missing)}")
        rows = []
        first_line: dict[str, int] = {}
        images = (folder / "images").resolve()
        for row in reader:
            line_number = reader.line_num  # the row's last physical line (blank lines are skipped, not counted)
            image_id = row["image_id"]
            _check_image_id(path, line_number, image_id, images)
            if image_id in first_line:
                raise DataError(f"{path}, line {line_number}: image_id {image_id!r} appears twice "
                                f"(lines {first_line[image_id]} and {line_number})")
            first_line[image_id] = line_number
            if row["dx"] not in HAM10000_CLASSES:
                raise DataError(
                    f"{path}, line {line_number}: label dx={row['dx']!r} of {row['image_id']} is not one of "
                    f"{list(HAM10000_CLASSES)}"
                )
            rows.append((row["image_id"], row["dx"], (row.get("lesion_id") or "").strip() or row["image_id"]))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def load_ham10000(folder: str | Path, image_size: int) -> LabelledImages:
    """Load every image the metadata lists, resized to image_size (cached after the first read)."""
    folder = Path(folder)
    rows = read_metadata(folder)
    files = [folder / "images" / f"{image_id}.jpg" for image_id, _, _ in rows]
    missing = [str(p) for p in files if not p.exists()]
    if missing:
        raise DataError(f"{missing[0]}: image listed in {METADATA_FILE} not found ({len(missing)} missing in all)")
    for path in files:
        regular_file(path, "image")

    def decode() -> dict[str, np.ndarray]:
        return {"images": np.stack([read_rgb(p, image_size) for p in files])}

    arrays = cached_arrays([folder / METADATA_FILE, *files], f"ham10000-{image_size}", decode)
    labels = np.array([HAM10000_CLASSES.index(dx) for _, dx, _ in rows], dtype=np.int64)
    names = np.array([image_id for image_id, _, _ in rows])
    groups = np.array([group for _, _, group in rows])
    return LabelledImages(arrays["images"], labels, HAM10000_CLASSES, names, groups)


def write_ham10000(data: LabelledImages, folder: Path, source_folder: Path) -> None:
    """Write a HAM10000-layout folder holding ``data``'s images (copied from ``source_folder``), with each image's
    group as its lesion_id."""
    import shutil

    (folder / "images").mkdir(parents=True, exist_ok=True)
    with (folder / METADATA_FILE).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["lesion_id", "image_id", "dx"])
        for name, label, group in zip(data.names, data.labels, data.groups):
            writer.writerow([group, name, data.class_names[label]])
            shutil.copy2(source_folder / "images" / f"{name}.jpg", folder / "images" / f"{name}.jpg")
