"""BraTS case folders of NIfTI volumes: ``<case>/<case>_{flair,t1,t1ce,t2,seg}.nii.gz``, read with nibabel.

Each case is z-scored per modality inside the brain (voxels non-zero in any loaded modality),
cropped to the brain's bounding box, optionally downsampled, and its labels {0, 1, 2, 4} remapped
to {0, 1, 2, 3}. A hospital loads only the modalities it declares.

A case is used voxel by voxel across its files, so before anything is decoded every file's header must agree with
the case's first file: the same shape, voxel size and orientation, and the same affine (voxel-to-world mapping)
within :data:`AFFINE_TOLERANCE`. A case whose modalities were resampled or reoriented separately is refused,
naming the file and how it differs, instead of being trained on misaligned.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .containers import DataError
from .image_files import cached_arrays, regular_file

#: Modality order of every multimodal tensor in the project (the RFNet/FedMEPD order).
MODALITIES = ("flair", "t1ce", "t1", "t2")
BRATS_LABELS = (0, 1, 2, 4)
#: How far (mm, per entry) two files' affines and voxel sizes may differ and still be one grid (header rounding).
AFFINE_TOLERANCE = 1e-3
#: The most voxels one volume may have (checked in its header before it is decompressed): BraTS has 8.9 million.
MAX_VOLUME_VOXELS = 100_000_000


@dataclass
class BratsCase:
    """One preprocessed case: ``image`` (4, D, H, W) float32 with absent modalities all zero."""

    name: str
    image: np.ndarray
    label: np.ndarray | None  # (D, H, W) uint8 in {0, 1, 2, 3}
    modalities: tuple[str, ...]

    @property
    def present(self) -> np.ndarray:
        """(4,) bool: which of :data:`MODALITIES` this case carries."""
        return np.array([m in self.modalities for m in MODALITIES])


def parse_modalities(text: str | tuple[str, ...] | list[str], where: str = "modalities") -> tuple[str, ...]:
    items = [m.strip().lower() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    aliases = {"t1c": "t1ce", "t1gd": "t1ce"}
    items = [aliases.get(m, m) for m in items]
    unknown = [m for m in items if m not in MODALITIES]
    if unknown or not items:
        raise DataError(f"{where}: {text!r} must be a comma-separated subset of {', '.join(MODALITIES)}")
    return tuple(m for m in MODALITIES if m in items)


def find_cases(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: BraTS folder not found")
    cases = sorted(p for p in folder.iterdir() if p.is_dir() and any(p.glob(f"{p.name}_*.nii*")))
    if not cases:
        raise DataError(f"{folder}: no case folders holding <case>_<modality>.nii.gz files")
    return cases


def volume_path(case_dir: Path, kind: str) -> Path:
    for suffix in (".nii.gz", ".nii"):
        path = case_dir / f"{case_dir.name}_{kind}{suffix}"
        if path.exists():
            return regular_file(path, f"{kind} volume")
    raise DataError(f"{case_dir / f'{case_dir.name}_{kind}.nii.gz'}: missing {kind} volume")


def _nifti(path: Path):
    """The NIfTI image with its header read and its voxels not yet (nibabel reads them on demand)."""
    import nibabel as nib

    try:
        return nib.load(str(regular_file(path, "NIfTI volume")))
    except (OSError, EOFError, ValueError, zlib.error, gzip.BadGzipFile, nib.filebasedimages.ImageFileError) as error:
        raise DataError(f"{path}: cannot read NIfTI volume ({type(error).__name__}: {error})") from None


def read_volume(path: Path) -> np.ndarray:
    import nibabel as nib

    try:
        return np.asarray(_nifti(path).dataobj)
    except (OSError, EOFError, ValueError, zlib.error, gzip.BadGzipFile, nib.filebasedimages.ImageFileError) as error:
        if isinstance(error, DataError):
            raise
        raise DataError(f"{path}: cannot read NIfTI volume ({type(error).__name__}: {error})") from None


def _mm(values) -> str:
    return "x".join(f"{float(v):g}" for v in values)


def check_alignment(files: list[Path]) -> None:
    """Every file's header against the first's: shape, voxel size, orientation, then the whole affine (origin and
    direction) within :data:`AFFINE_TOLERANCE`; a DataError naming the file that differs and how. Volumes over
    :data:`MAX_VOLUME_VOXELS` are refused too. Only headers are read."""
    import nibabel as nib

    reference = None
    for path in files:
        image = _nifti(path)
        shape = tuple(int(s) for s in image.shape)
        if int(np.prod(shape, dtype=np.float64)) > MAX_VOLUME_VOXELS:
            raise DataError(f"{path}: {shape} is {np.prod(shape, dtype=np.float64) / 1e6:.0f} million voxels, over "
                            f"the limit of {MAX_VOLUME_VOXELS // 10**6} million for one volume")
        zooms = tuple(float(z) for z in image.header.get_zooms()[:3])
        affine = np.asarray(image.affine, dtype=np.float64)
        if reference is None:
            reference = (path, shape, zooms, affine)
            continue
        first, first_shape, first_zooms, first_affine = reference
        where = f"{path}: differs from {first.name}:"
        if shape != first_shape:
            raise DataError(f"{where} shape {shape} against {first_shape}; every file of a case must be on one grid "
                            "(resample it onto the others')")
        if not np.allclose(zooms, first_zooms, rtol=0, atol=AFFINE_TOLERANCE):
            raise DataError(f"{where} voxel size {_mm(zooms)} mm against {_mm(first_zooms)} mm; every file of a case "
                            "must be on one grid (resample it onto the others')")
        axes, first_axes = "".join(nib.aff2axcodes(affine)), "".join(nib.aff2axcodes(first_affine))
        if axes != first_axes:
            raise DataError(f"{where} orientation {axes} against {first_axes} (its voxel axes are flipped or swapped "
                            "against the others'); reorient it onto the others' grid")
        difference = float(np.abs(affine - first_affine).max())
        if difference > AFFINE_TOLERANCE:
            raise DataError(f"{where} affine (voxel-to-world mapping) by up to {difference:g} (origin "
                            f"{_mm(affine[:3, 3])} mm against {_mm(first_affine[:3, 3])} mm); the volumes are not "
                            "voxel-aligned: resample it onto the others' grid")


def _check_seg_labels(path: Path, seg: np.ndarray) -> None:
    """Segmentation labels must be whole numbers in :data:`BRATS_LABELS`: ``int()`` would quietly turn 1.5
    into 1. Label 3 is refused too: BraTS 2023 files use it for enhancing tumour, which here must be 4."""
    values = np.unique(seg)
    bad = [v for v in values.tolist() if not (np.isfinite(v) and v == int(v) and int(v) in BRATS_LABELS)]
    if bad:
        shown = ", ".join(str(int(v)) if np.isfinite(v) and v == int(v) else str(v) for v in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise DataError(f"{path}: label(s) [{shown}]{more} outside the BraTS set {list(BRATS_LABELS)} "
                        "(labels are whole numbers; BraTS 2023's enhancing tumour 3 must be relabelled 4)")


def _downsample(volume: np.ndarray, factor: int, nearest: bool) -> np.ndarray:
    if factor == 1:
        return volume
    d, h, w = (s // factor * factor for s in volume.shape)
    if nearest:  # the centre voxel of each block
        return volume[factor // 2:d:factor, factor // 2:h:factor, factor // 2:w:factor]
    v = volume[:d, :h, :w]
    return v.reshape(d // factor, factor, h // factor, factor, w // factor, factor).mean(axis=(1, 3, 5))


def _decode_case(case_dir: Path, modalities: tuple[str, ...], with_label: bool, downsample: int) -> dict:
    volumes = {modality: read_volume(volume_path(case_dir, modality)).astype(np.float32) for modality in modalities}
    label = None
    if with_label:
        seg_path = volume_path(case_dir, "seg")
        label = (seg_path, read_volume(seg_path))
    return preprocess(case_dir, volumes, label, downsample)


def preprocess(case_dir: Path, volumes: dict[str, np.ndarray], label: tuple[Path, np.ndarray] | None,
               downsample: int) -> dict[str, np.ndarray]:
    """A case's volumes (one grid) z-scored inside the brain, cropped to it and downsampled; its label (the file it
    came from, BraTS labels) checked, remapped and cropped the same way."""
    shapes = {m: v.shape for m, v in volumes.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 3:
        raise DataError(f"{case_dir}: modality volumes differ in shape or are not 3D: {shapes}")
    brain = np.zeros(next(iter(shapes.values())), dtype=bool)
    for v in volumes.values():
        brain |= v != 0
    if not brain.any():
        raise DataError(f"{case_dir}: every loaded modality is empty")
    lo = [int(ix.min()) for ix in np.nonzero(brain)]
    hi = [int(ix.max()) + 1 for ix in np.nonzero(brain)]
    crop = tuple(slice(a, b) for a, b in zip(lo, hi))
    image = np.zeros((len(MODALITIES), *[b - a for a, b in zip(lo, hi)]), dtype=np.float32)
    for modality, volume in volumes.items():
        inside = volume[brain]
        std = float(inside.std()) or 1.0
        normalised = np.where(brain, (volume - float(inside.mean())) / std, 0.0)
        image[MODALITIES.index(modality)] = normalised[crop]
    arrays = {"image": np.stack([_downsample(ch, downsample, nearest=False) for ch in image])}
    if label is not None:
        seg_path, seg = label
        if seg.shape != brain.shape:
            raise DataError(f"{seg_path}: shape {seg.shape} differs from the images' {brain.shape}")
        _check_seg_labels(seg_path, seg)
        cropped = seg[crop].astype(np.uint8)
        cropped[cropped == 4] = 3
        arrays["label"] = _downsample(cropped, downsample, nearest=True)
    return arrays


def load_case(case_dir: str | Path, modalities: tuple[str, ...] = MODALITIES, with_label: bool = True,
              downsample: int = 1) -> BratsCase:
    """Read, normalise and crop one case (cached on disk after the first read)."""
    case_dir = Path(case_dir)
    files = [volume_path(case_dir, m) for m in modalities] + ([volume_path(case_dir, "seg")] if with_label else [])
    check_alignment(files)
    arrays = cached_arrays(files, f"brats-{','.join(modalities)}-{with_label}-{downsample}",
                           lambda: _decode_case(case_dir, modalities, with_label, downsample))
    return BratsCase(case_dir.name, arrays["image"], arrays.get("label"), modalities)


def load_cases(folder: str | Path, modalities: tuple[str, ...] = MODALITIES, downsample: int = 1) -> list[BratsCase]:
    return [load_case(case, modalities, downsample=downsample) for case in find_cases(folder)]
