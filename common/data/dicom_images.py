"""2D data sets as DICOM (``dataset='dicom'``): photographs, endoscopy frames, radiographs -- any single-frame
instance -- for classification, and images with DICOM SEG (or image-file) masks for 2D segmentation.

Classification: ``<data-dir>/labels.csv`` labels instances anywhere under ``data-dir``, one row each, keyed by
``sop_instance_uid`` or by ``path`` (relative to ``data-dir``), the class in ``label``; the classes are
``dataset-args`` ``classes`` (a list, the order of the labels) or else the labels found, sorted.

Segmentation: a data set folder holds ``images/`` (DICOM instances) and ``masks/`` (DICOM SEGs, each over any of the
images, or image files named as their image: ``images/12.dcm`` and ``masks/12.png``); a folder of such folders is
one source each, as ``image-mask`` reads them. Any non-zero segment is foreground.

Samples are in the labels file's order (classification) or by file name (segmentation); each sample's group is its
patient (:func:`common.data.dicom_files.group_of`), so the splits keep a patient's images together.
"""

from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from .containers import DataError, LabelledImages, SegmentationImages, concat
from .dicom_files import dicom_files, group_of, headers_stay_here, is_seg, read_header, read_instance, rgb_pixels
from .image_files import IMAGE_SUFFIXES, by_stem, cached_arrays, read_mask, regular_file
from .image_mask import data_set_folders

LABELS_FILE = "labels.csv"
KEYS = ("sop_instance_uid", "path")


def _resized(rgb: np.ndarray, size: int) -> np.ndarray:
    """As :func:`common.data.image_files.read_rgb` resizes a decoded image file (bilinear), so a DICOM copy of a
    JPEG data set gives the same arrays."""
    if rgb.shape[:2] == (size, size):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((size, size), Image.BILINEAR), dtype=np.uint8)


def _mask_resized(mask: np.ndarray, size: int) -> np.ndarray:
    """A binary mask resized as :func:`common.data.image_files.read_mask` resizes a grey one (bilinear, > 127)."""
    image = Image.fromarray((mask > 0).astype(np.uint8) * 255)
    if image.size != (size, size):
        image = image.resize((size, size), Image.BILINEAR)
    return (np.asarray(image) > 127).astype(np.uint8)


def _inside(folder: Path, relative: str, where: str) -> Path:
    target = (folder / relative).resolve()
    if not relative or not target.is_relative_to(folder.resolve()):
        raise DataError(f"{where}: path {relative!r} is not a file under {folder}")
    return target


def read_labels(folder: Path) -> tuple[str, list[tuple[str, str, int]]]:
    """(key column, [(key, label, line)]) of ``labels.csv``: one key column, no key twice."""
    path = folder / LABELS_FILE
    if not path.exists():
        raise DataError(f"{path}: labels file not found (a DICOM classification folder holds {LABELS_FILE} with "
                        "columns sop_instance_uid or path, and label)")
    with regular_file(path, "labels file").open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = set(reader.fieldnames or [])
        keys = [k for k in KEYS if k in columns]
        if "label" not in columns or len(keys) != 1:
            raise DataError(f"{path}: needs a label column and one of {list(KEYS)} (found {sorted(columns)})")
        key, rows, seen = keys[0], [], {}
        for row in reader:
            value, label = (row[key] or "").strip(), (row["label"] or "").strip()
            if not value or not label:
                raise DataError(f"{path}, line {reader.line_num}: empty {key if not value else 'label'}")
            if value in seen:
                raise DataError(f"{path}, line {reader.line_num}: the {key} of line {seen[value]} again")
            seen[value] = reader.line_num
            rows.append((value, label, reader.line_num))
    if not rows:
        raise DataError(f"{path}: no rows")
    return key, rows


def labelled_files(folder: Path) -> tuple[list[tuple[Path, str]], Path]:
    """[(instance file, label)] in the labels file's order."""
    key, rows = read_labels(folder)
    labels_path = folder / LABELS_FILE
    if key == "path":
        return [(regular_file(_inside(folder, value, f"{labels_path}, line {line}"), "DICOM file"), label)
                for value, label, line in rows], labels_path
    by_uid: dict[str, Path] = {}
    for path in dicom_files(folder):
        uid = str(read_header(path).SOPInstanceUID)
        if uid in by_uid:
            raise DataError(f"{path}: the same SOP Instance UID as {by_uid[uid]} (one instance stored twice)")
        by_uid[uid] = path
    missing = [line for value, _, line in rows if value not in by_uid]
    if missing:
        raise DataError(f"{labels_path}, line {missing[0]}: no instance under {folder} has this sop_instance_uid "
                        f"({len(missing)} row(s) in all)")
    return [(by_uid[value], label) for value, label, _ in rows], labels_path


@headers_stay_here
def load_dicom_classification(folder: str | Path, image_size: int, classes: tuple[str, ...] = ()) -> LabelledImages:
    folder = Path(folder)
    files, labels_path = labelled_files(folder)
    class_names = tuple(classes) or tuple(sorted({label for _, label in files}))
    unknown = [(path, label) for path, label in files if label not in class_names]
    if unknown:
        raise DataError(f"{unknown[0][0]}: label {unknown[0][1]!r} is not one of the classes {list(class_names)} "
                        f"({labels_path})")

    def decode() -> dict[str, np.ndarray]:
        images, groups = [], []
        for path, _ in files:
            ds = read_instance(path)
            images.append(_resized(rgb_pixels(ds, path), image_size))
            groups.append(group_of(ds))
        return {"images": np.stack(images), "groups": np.array(groups)}

    arrays = cached_arrays([labels_path, *(path for path, _ in files)], f"dicom-class-{image_size}", decode)
    names = np.array([Path(os.path.relpath(path.resolve(), folder.resolve())).as_posix() for path, _ in files])
    labels = np.array([class_names.index(label) for _, label in files], dtype=np.int64)
    return LabelledImages(arrays["images"], labels, class_names, names, arrays["groups"])


# --- segmentation ---------------------------------------------------------------------------------------------------
def another_series(seg_path: Path) -> DataError:
    return DataError(f"{seg_path}: references an instance that is not an image of this data set (a SEG of another "
                     "series); keep a SEG with the series it segments")


def seg_masks(seg_path: Path, images: dict[str, Path]) -> dict[str, np.ndarray]:
    """{SOP Instance UID: (rows, columns) mask} of one SEG over ``images`` (uid -> file); a DataError naming the SEG
    when it references an instance that is not among them (a SEG of another series)."""
    import highdicom as hd

    try:
        seg = hd.seg.segread(seg_path)
        referenced = [uid for _, _, uid in seg.get_source_image_uids()]
    except (AttributeError, ValueError, KeyError, TypeError, OSError) as error:
        raise DataError(f"{seg_path}: not a readable DICOM SEG ({type(error).__name__})") from None
    if any(uid not in images for uid in referenced):
        raise another_series(seg_path)
    try:
        frames = seg.get_pixels_by_source_instance(referenced, combine_segments=True, skip_overlap_checks=True)
    except (ValueError, KeyError, RuntimeError) as error:
        raise DataError(f"{seg_path}: its frames do not map onto its source images ({type(error).__name__})") from None
    return {uid: (frame > 0).astype(np.uint8) for uid, frame in zip(referenced, frames)}


def segmentation_pairs(folder: Path) -> list[tuple[Path, Path]]:
    """(image, mask file) of every image of a data set folder, sorted by image name: the SEG that covers it, or the
    image file of the same stem. Only headers are read."""
    images = by_stem(dicom_files(folder / "images"))
    masks_dir = folder / "masks"
    if not masks_dir.is_dir():
        raise DataError(f"{masks_dir}: folder not found (a DICOM segmentation data set holds images/ and masks/)")
    files = sorted(p for p in masks_dir.iterdir() if not p.name.startswith("."))
    mask_files = by_stem([p for p in files if p.suffix.lower() in IMAGE_SUFFIXES])
    uids = {str(read_header(path).SOPInstanceUID): stem for stem, path in images.items()}
    covered: dict[str, Path] = {}
    for path in files:
        if path.suffix.lower() in IMAGE_SUFFIXES:
            continue
        header = read_header(path)
        if not is_seg(header):
            raise DataError(f"{path}: a DICOM file in masks/ that is not a SEG")
        for item in getattr(header, "ReferencedSeriesSequence", []):
            for instance in getattr(item, "ReferencedInstanceSequence", []):
                stem = uids.get(str(instance.ReferencedSOPInstanceUID))
                if stem is None:
                    raise another_series(path)
                covered.setdefault(stem, path)
    pairs = []
    for stem in sorted(images):
        mask = covered.get(stem, mask_files.get(stem))
        if mask is None:
            raise DataError(f"{images[stem]}: no mask (no SEG in {masks_dir} references it, no image file named "
                            f"{stem}.*)")
        pairs.append((images[stem], mask))
    return pairs


def load_dicom_segmentation_folder(folder: Path, image_size: int) -> SegmentationImages:
    pairs = segmentation_pairs(folder)

    def decode() -> dict[str, np.ndarray]:
        images, masks, groups = [], [], []
        instances = {path: read_instance(path) for path, _ in pairs}
        by_uid = {str(ds.SOPInstanceUID): path for path, ds in instances.items()}
        from_segs: dict[Path, dict[str, np.ndarray]] = {}
        for image_path, mask_path in pairs:
            ds = instances[image_path]
            rgb = rgb_pixels(ds, image_path)
            if mask_path.suffix.lower() in IMAGE_SUFFIXES:
                mask = read_mask(mask_path, None)
            else:
                if mask_path not in from_segs:
                    from_segs[mask_path] = seg_masks(mask_path, by_uid)
                mask = from_segs[mask_path][str(ds.SOPInstanceUID)]
            if mask.shape != rgb.shape[:2]:
                raise DataError(f"{mask_path}: mask of {mask.shape[1]}x{mask.shape[0]} over {image_path.name} of "
                                f"{rgb.shape[1]}x{rgb.shape[0]} pixels")
            images.append(_resized(rgb, image_size))
            masks.append(_mask_resized(mask, image_size))
            groups.append(group_of(ds))
        return {"images": np.stack(images), "masks": np.stack(masks), "groups": np.array(groups)}

    files = sorted({path for pair in pairs for path in pair})
    arrays = cached_arrays(files, f"dicom-seg-{image_size}", decode)
    source = folder.name
    return SegmentationImages(arrays["images"], arrays["masks"], np.array([image.name for image, _ in pairs]),
                              np.full(len(pairs), source), np.array([f"{source}/{g}" for g in arrays["groups"]]))


@headers_stay_here
def load_dicom_segmentation(folder: str | Path, image_size: int) -> SegmentationImages:
    """Every data set under ``folder`` (one source each)."""
    return concat([load_dicom_segmentation_folder(f, image_size) for f in data_set_folders(folder)])


# --- a hospital's folder of the same (fedmed partition) -------------------------------------------------------------
def write_dicom_classification(data: LabelledImages, folder: Path, source_folder: Path) -> None:
    """``data``'s instances copied (as they are: DICOM stays DICOM) under ``folder``, with a labels file by path."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LABELS_FILE).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label"])
        for name, label in zip(data.names, data.labels):
            target = folder / str(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source_folder / str(name), target)
            writer.writerow([str(name), data.class_names[label]])


def write_dicom_segmentation(data: SegmentationImages, folder: Path, source_root: Path) -> None:
    """``data``'s images and their masks copied into ``folder/<source>/{images,masks}``; a SEG goes with its images
    (a patient's, whom every split keeps together)."""
    pairs = {f.name: {image.name: (image, mask) for image, mask in segmentation_pairs(f)}
             for f in data_set_folders(source_root)}
    for name, source in zip(data.names, data.sources):
        image, mask = pairs[str(source)][str(name)]
        for sub, path in (("images", image), ("masks", mask)):
            target = folder / str(source) / sub / path.name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)


# --- segmentations out (fedmed segment) ----------------------------------------------------------------------------
def segment_instances(files: list[Path], out: Path, predict, algorithm) -> list[Path]:
    """A DICOM SEG of ``predict``'s masks (a list of RGB images -> a list of 0/1 masks of their sizes) over
    ``files``, identified by ``algorithm`` (:class:`common.data.dicom_write.Algorithm`): one SEG per series of
    instances in patient space (an MR or CT slice series), one per instance for images without patient geometry
    (photographs, endoscopy frames: highdicom puts one such frame in a SEG); named after its first file's stem."""
    from .dicom_write import write_seg

    units: dict[tuple[str, ...], list[tuple[Path, object]]] = {}
    for path in files:
        ds = read_instance(path)
        if is_seg(ds):
            continue
        spatial = "ImagePositionPatient" in ds and "FrameOfReferenceUID" in ds
        key = (str(ds.StudyInstanceUID), str(ds.SeriesInstanceUID)) if spatial else (str(path),)
        units.setdefault(key, []).append((path, ds))
    if not units:
        raise DataError(f"{files[0].parent if files else out}: no DICOM images to segment")
    out.mkdir(parents=True, exist_ok=True)
    masks = iter(predict([rgb_pixels(ds, path) for members in units.values() for path, ds in members]))  # batched
    written = []
    for members in units.values():
        target = out / f"{members[0][0].stem}.seg.dcm"
        written.append(write_seg([ds for _, ds in members], np.stack([next(masks) for _ in members]), ["polyp"],
                                 target, algorithm))
    return written
