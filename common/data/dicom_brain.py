"""Brain tumour studies as DICOM (``task='brain-tumour-segmentation' dataset='dicom'``): one folder per study, its
MR series mapped to the task's modalities by their Series Description, put on one grid, the tumour labels from a
DICOM SEG in the folder or a NIfTI beside the series.

The series rule: a series belongs to the first modality (in the order flair, t1ce, t1, t2) one of whose patterns
matches its Series Description (its Protocol Name when it has none), case-insensitively, ``*`` for any run of
characters; series matching none (localisers, diffusion, ...) are left alone. The defaults are :data:`DEFAULT_RULES`;
a hospital names its own in ``<data-dir>/series-rules.json`` (``{"t1ce": ["*mprage*gad*"], ...}``; a modality it
names takes those patterns in place of the defaults). Two series of one study matching one modality is an error.

Each series becomes a volume (highdicom, oriented LPS: the voxel order of BraTS's NIfTI files, so a DICOM copy of a
BraTS case reads as the same arrays); the first loaded modality's grid is the case's, and a series on another grid is
resampled onto it (trilinear; labels nearest). The SEG's segments 1, 2, 3 are necrotic core, oedema and enhancing
tumour (BraTS labels 1, 2, 4); a NIfTI label file (``*seg*.nii.gz``) holds BraTS labels. Then the case is normalised
and cropped exactly as a NIfTI case (:func:`common.data.brats.preprocess`).
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import numpy as np

from .brats import MODALITIES, BratsCase, preprocess
from .containers import DataError
from .dicom_files import RAS_TO_LPS, dicom_files, headers_stay_here, is_seg, read_header, read_instance
from .image_files import cached_arrays, regular_file

RULES_FILE = "series-rules.json"
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "flair": ("*flair*",),
    "t1ce": ("*t1*ce*", "*t1*gd*", "*t1*gad*", "*t1*c+*", "*t1*+c*", "*t1*contrast*", "*t1*post*", "*t1c*"),
    "t1": ("*t1*",),
    "t2": ("*t2*",),
}
#: BraTS label of each SEG segment number
SEGMENT_LABELS = {1: 1, 2: 2, 3: 4}


def read_rules(data_dir: Path) -> dict[str, tuple[str, ...]]:
    """The hospital's series rules over the defaults."""
    path = data_dir / RULES_FILE
    if not path.exists():
        return dict(DEFAULT_RULES)
    try:
        given = json.loads(regular_file(path, "series rules").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: not JSON ({error})") from None
    if not isinstance(given, dict) or any(m not in MODALITIES for m in given) or not all(
            isinstance(p, list) and p and all(isinstance(x, str) and x for x in p) for p in given.values()):
        raise DataError(f"{path}: must map modalities ({', '.join(MODALITIES)}) to lists of patterns, e.g. "
                        '{"t1ce": ["*mprage*gad*"]}')
    return {**DEFAULT_RULES, **{m: tuple(p) for m, p in given.items()}}


def modality_of(description: str, rules: dict[str, tuple[str, ...]]) -> str | None:
    text = description.strip().lower()
    for modality in MODALITIES:
        if any(fnmatch.fnmatchcase(text, pattern.lower()) for pattern in rules[modality]):
            return modality
    return None


def find_studies(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: folder of DICOM studies not found")
    studies = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not studies:
        raise DataError(f"{folder}: no study folders (one folder of DICOM files per study)")
    return studies


def study_series(study: Path, rules: dict[str, tuple[str, ...]]) -> tuple[dict[str, list[Path]], list[Path]]:
    """({modality: the files of its series}, the study's SEG files), from the headers alone."""
    series: dict[str, list[Path]] = {}
    modality: dict[str, str | None] = {}
    segs = []
    for path in dicom_files(study):
        header = read_header(path)
        if is_seg(header):
            segs.append(path)
            continue
        uid = str(getattr(header, "SeriesInstanceUID", ""))
        if uid not in modality:
            description = str(getattr(header, "SeriesDescription", "") or getattr(header, "ProtocolName", "") or "")
            modality[uid] = modality_of(description, rules)
        series.setdefault(uid, []).append(path)
    mapped: dict[str, list[Path]] = {}
    for uid, files in series.items():
        name = modality[uid]
        if name is None:
            continue
        if name in mapped:
            raise DataError(f"{study}: two series match the {name} rule (the series of {mapped[name][0].name} and of "
                            f"{files[0].name}); remove one or narrow the rule in {RULES_FILE}")
        mapped[name] = files
    return mapped, segs


def _volume(files: list[Path], dtype=np.float32):
    """The series as a highdicom Volume oriented LPS; a DataError naming its first file when its slices are not one
    grid (mixed sizes, orientations, gaps)."""
    import highdicom as hd

    datasets = [read_instance(path) for path in files]
    try:
        return hd.get_volume_from_series(datasets, dtype=dtype).to_patient_orientation("LPS")
    except (ValueError, RuntimeError, AttributeError, KeyError) as error:
        raise DataError(f"{files[0]}: its series ({len(files)} files) is not one grid of slices "
                        f"({type(error).__name__}); export the series again or remove the stray files") from None


def on_grid(array: np.ndarray, affine: np.ndarray, shape: tuple[int, ...], reference: np.ndarray,
            nearest: bool) -> np.ndarray:
    """``array`` (voxels at ``affine``) resampled onto the grid ``shape`` at ``reference`` (zero outside)."""
    from scipy.ndimage import affine_transform

    if array.shape == tuple(shape) and np.allclose(affine, reference, atol=1e-3):
        return array
    mapping = np.linalg.inv(affine) @ reference
    return affine_transform(array, mapping[:3, :3], offset=mapping[:3, 3], output_shape=tuple(shape),
                            order=0 if nearest else 1, mode="constant", cval=0.0)


def _seg_label(seg_path: Path, series_uids: set[str], shape, affine) -> np.ndarray:
    import highdicom as hd

    try:
        seg = hd.seg.segread(seg_path)
        referenced = {series for _, series, _ in seg.get_source_image_uids()}
    except (AttributeError, ValueError, KeyError, TypeError, OSError) as error:
        raise DataError(f"{seg_path}: not a readable DICOM SEG ({type(error).__name__})") from None
    if not referenced <= series_uids:
        raise DataError(f"{seg_path}: references a series that is not one of this study's mapped series (a SEG of "
                        "another study or series); keep a SEG with the series it segments")
    numbers = seg.get_segment_numbers()
    if not set(numbers) <= set(SEGMENT_LABELS):
        raise DataError(f"{seg_path}: segments {numbers}; a tumour SEG has segments 1 (necrotic core), 2 (oedema) and "
                        "3 (enhancing tumour)")
    try:
        volume = seg.get_volume(combine_segments=True, skip_overlap_checks=True).to_patient_orientation("LPS")
    except (ValueError, RuntimeError, KeyError) as error:
        raise DataError(f"{seg_path}: its frames are not one volume ({type(error).__name__})") from None
    lookup = np.array([0] + [SEGMENT_LABELS.get(n, 0) for n in range(1, 4)], dtype=np.uint8)
    return on_grid(lookup[volume.array.astype(np.int64)], volume.affine, shape, affine, nearest=True)


def _nifti_label(path: Path, shape, affine) -> np.ndarray:
    from .brats import _nifti, read_volume

    lps = RAS_TO_LPS @ np.asarray(_nifti(path).affine, dtype=np.float64)
    return on_grid(read_volume(path), lps, shape, affine, nearest=True)


def label_files(study: Path, segs: list[Path]) -> list[Path]:
    niftis = sorted(p for p in study.iterdir() if "seg" in p.name.lower() and p.name.lower().endswith((".nii",
                                                                                                        ".nii.gz")))
    found = segs + niftis
    if len(found) > 1:
        raise DataError(f"{found[1]}: a second label file in {study} (beside {found[0].name}); keep one")
    if not found:
        raise DataError(f"{study}: no labels (a DICOM SEG of the study, or a *seg*.nii.gz beside its series)")
    return found


@headers_stay_here
def load_study(study: str | Path, modalities: tuple[str, ...] = MODALITIES, with_label: bool = True,
               downsample: int = 1) -> BratsCase:
    """One study as a case of ``modalities`` (a missing series is an error naming the study folder)."""
    study = Path(study)
    rules = read_rules(study.parent)
    mapped, segs = study_series(study, rules)
    missing = [m for m in modalities if m not in mapped]
    if missing:
        raise DataError(f"{study}: no series for {', '.join(missing)} by the series rule (its Series Descriptions "
                        f"match none of {', '.join(f'{m}: {list(rules[m])}' for m in missing)}); name the hospital's "
                        f"own in {study.parent / RULES_FILE}")
    labels = label_files(study, segs) if with_label else []
    files = [path for m in modalities for path in mapped[m]] + labels
    rules_file = [study.parent / RULES_FILE] if (study.parent / RULES_FILE).exists() else []

    def decode() -> dict[str, np.ndarray]:
        reference = None
        volumes = {}
        for modality in modalities:
            volume = _volume(mapped[modality])
            if reference is None:
                reference = volume
            volumes[modality] = on_grid(volume.array, volume.affine, reference.spatial_shape, reference.affine,
                                        nearest=False).astype(np.float32)
        label = None
        if labels:
            path = labels[0]
            uids = {str(read_header(mapped[m][0]).SeriesInstanceUID) for m in mapped}
            array = (_seg_label(path, uids, reference.spatial_shape, reference.affine) if path in segs
                     else _nifti_label(path, reference.spatial_shape, reference.affine))
            label = (path, array)
        return preprocess(study, volumes, label, downsample)

    arrays = cached_arrays(files + rules_file, f"dicom-brain-{','.join(modalities)}-{with_label}-{downsample}", decode)
    return BratsCase(study.name, arrays["image"], arrays.get("label"), modalities)
