"""BraTS case folders of NIfTI volumes: ``<case>/<case>_{flair,t1,t1ce,t2,seg}.nii.gz``, read with nibabel.

Each case is z-scored per modality inside the brain (voxels non-zero in any loaded modality),
cropped to the brain's bounding box, optionally downsampled, and its labels {0, 1, 2, 4} remapped
to {0, 1, 2, 3}. A hospital loads only the modalities it declares.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .containers import DataError
from .image_files import cached_arrays

#: Modality order of every multimodal tensor in the project (the RFNet/FedMEPD order).
MODALITIES = ("flair", "t1ce", "t1", "t2")
BRATS_LABELS = (0, 1, 2, 4)


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
        if path.is_file():
            return path
    raise DataError(f"{case_dir / f'{case_dir.name}_{kind}.nii.gz'}: missing {kind} volume")


def read_volume(path: Path) -> np.ndarray:
    import nibabel as nib

    try:
        return np.asarray(nib.load(str(path)).dataobj)
    except (OSError, EOFError, ValueError, zlib.error, gzip.BadGzipFile, nib.filebasedimages.ImageFileError) as error:
        raise DataError(f"{path}: cannot read NIfTI volume ({type(error).__name__}: {error})") from None


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
    volumes = {}
    for modality in modalities:
        path = volume_path(case_dir, modality)
        volumes[modality] = read_volume(path).astype(np.float32)
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
    if with_label:
        seg_path = volume_path(case_dir, "seg")
        seg = read_volume(seg_path)
        if seg.shape != brain.shape:
            raise DataError(f"{seg_path}: shape {seg.shape} differs from the images' {brain.shape}")
        _check_seg_labels(seg_path, seg)
        label = seg[crop].astype(np.uint8)
        label[label == 4] = 3
        arrays["label"] = _downsample(label, downsample, nearest=True)
    return arrays


def load_case(case_dir: str | Path, modalities: tuple[str, ...] = MODALITIES, with_label: bool = True,
              downsample: int = 1) -> BratsCase:
    """Read, normalise and crop one case (cached on disk after the first read)."""
    case_dir = Path(case_dir)
    files = [volume_path(case_dir, m) for m in modalities] + ([volume_path(case_dir, "seg")] if with_label else [])
    arrays = cached_arrays(files, f"brats-{','.join(modalities)}-{with_label}-{downsample}",
                           lambda: _decode_case(case_dir, modalities, with_label, downsample))
    return BratsCase(case_dir.name, arrays["image"], arrays.get("label"), modalities)


def load_cases(folder: str | Path, modalities: tuple[str, ...] = MODALITIES, downsample: int = 1) -> list[BratsCase]:
    return [load_case(case, modalities, downsample=downsample) for case in find_cases(folder)]
