"""DICOM copies of the real data sets, as a hospital's PACS would export them (``dataset='dicom'`` reads them).

    python -m benchmarks.dicom.make_dicom --out ../dicom-data            # all of ../shared/data
    python -m benchmarks.dicom.make_dicom --out ../dicom-data --ham10000 200 --cvc 60 --brats 3 --brats-step 2

- ``ham10000/``: each image a VL photograph (its pixels the decoded JPEG's), Patient ID = its lesion_id, one study
  per lesion; ``labels.csv`` by path in the metadata's order.
- ``polyp/cvc_clinicdb_256/``: each frame a VL endoscopic image, each video sequence (the groups ``image-mask``
  finds) one patient's study, its mask a DICOM SEG over the frame (highdicom puts one frame in a SEG of images
  without patient geometry, as endoscopy frames are).
- ``brats/<case>/``: each modality an MR series (descriptions as scanners name them: "AX T2 FLAIR", "AX T1 POST GD",
  ...), the tumour labels a DICOM SEG over the first series.

The same files in the same order: a run on a copy splits as on the original, and on the same seed scores the same
(``tests/test_dicom.py``). Header values (names, ids, dates, descriptions) are made up, so the leak test can look
for them.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
from pathlib import Path

import numpy as np
from PIL import Image

from common.data.brats import MODALITIES, find_cases, volume_path
from common.data.dicom_write import VL_ENDOSCOPIC, VL_PHOTOGRAPHIC, Study, write_mr_series, write_rgb_image, write_seg
from common.data.ham10000 import METADATA_FILE, read_metadata
from common.data.image_files import read_mask
from common.data.image_mask import data_set_folders, matched_pairs, pair_groups

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
#: how scanners name the series (the default series rule maps each to its modality)
SERIES_DESCRIPTIONS = {"flair": "AX T2 FLAIR", "t1ce": "AX T1 POST GD", "t1": "AX T1 PRE", "t2": "AX T2 FSE"}
#: BraTS label of each SEG segment (common.data.dicom_brain.SEGMENT_LABELS)
TUMOUR_SEGMENTS = ((1, "necrotic tumour core"), (2, "peritumoural oedema"), (4, "enhancing tumour"))


def _rgb(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def ham10000_to_dicom(source: Path, out: Path, image_ids: list[str] | None = None, key: str = "path") -> Path:
    """HAM10000 images (all, or ``image_ids``) as photographs with the lesion as patient; labels by ``key``."""
    rows = [row for row in read_metadata(source) if image_ids is None or row[0] in set(image_ids)]
    studies: dict[str, Study] = {}
    out.mkdir(parents=True, exist_ok=True)
    with (out / "labels.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([key, "label"])
        for image_id, dx, lesion in rows:
            study = studies.setdefault(lesion, Study(patient_id=lesion, patient_name=f"Patient^{lesion}",
                                                     study_description=f"dermoscopy of {lesion}"))
            ds = write_rgb_image(_rgb(source / "images" / f"{image_id}.jpg"), out / "images" / f"{image_id}.dcm",
                                 study, sop_class=VL_PHOTOGRAPHIC, description=f"lesion {lesion}")
            writer.writerow([f"images/{image_id}.dcm" if key == "path" else ds.SOPInstanceUID, dx])
    return out


def image_mask_to_dicom(source: Path, out: Path, names: list[str] | None = None) -> Path:
    """Each data set's frames (all, or those named) as endoscopic images, one study and one SEG per group."""
    from pydicom.uid import generate_uid

    for folder in data_set_folders(source):
        pairs = matched_pairs(folder)
        groups = pair_groups(folder, [image for image, _ in pairs])
        chosen: dict[str, list[tuple[Path, Path]]] = {}
        for pair, group in zip(pairs, groups):
            if names is None or pair[0].name in names:
                chosen.setdefault(group, []).append(pair)
        for group, members in chosen.items():
            patient = f"{folder.name}-{group}"
            study = Study(patient_id=patient, patient_name=f"Patient^{patient}",
                          study_description=f"colonoscopy {patient}")
            series, frame = None, generate_uid()
            for number, (image, mask) in enumerate(members, start=1):
                ds = write_rgb_image(_rgb(image), out / folder.name / "images" / f"{image.stem}.dcm", study,
                                     sop_class=VL_ENDOSCOPIC, series_uid=series, instance_number=number,
                                     description=f"video {group}", frame_of_reference=frame)
                series = ds.SeriesInstanceUID
                target = out / folder.name / "masks" / f"{image.stem}.dcm"
                write_seg([ds], read_mask(mask, None)[None], ["polyp"], target)
    return out


def brats_to_dicom(case: Path, out: Path, modalities: tuple[str, ...] = MODALITIES, step: int = 1) -> Path:
    """One BraTS case as a study of MR series (every ``step``-th voxel) and a SEG over its first series."""
    import nibabel as nib
    from pydicom.uid import generate_uid

    patient = "P" + hashlib.sha256(case.name.encode()).hexdigest()[:10]  # not the folder's name: a header value
    study = Study(patient_id=patient, patient_name=f"Patient^{patient}", study_description="MRI BRAIN W/WO")
    frame = generate_uid()
    first = None
    for number, modality in enumerate(modalities, start=1):
        image = nib.load(str(volume_path(case, modality)))
        affine = image.affine.copy()
        affine[:3, :3] *= step
        volume = np.asarray(image.dataobj)[::step, ::step, ::step]
        written = write_mr_series(volume, affine, out / case.name / modality, study, SERIES_DESCRIPTIONS[modality],
                                  number, frame)
        first = first or written
    seg = np.asarray(nib.load(str(volume_path(case, "seg"))).dataobj)[::step, ::step, ::step]
    numbers = np.zeros(seg.shape, dtype=np.uint8)
    for number, (label, _) in enumerate(TUMOUR_SEGMENTS, start=1):
        numbers[seg == label] = number
    write_seg(first, numbers.transpose(2, 1, 0), [name for _, name in TUMOUR_SEGMENTS],
              out / case.name / "seg" / "tumour.dcm")
    return out / case.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=SHARED, help="the real data (default ../shared/data)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ham10000", type=int, default=0, help="the first N images of the metadata (0: all)")
    parser.add_argument("--cvc", type=int, default=0, help="the first N CVC-ClinicDB frames by name (0: all)")
    parser.add_argument("--brats", type=int, default=0, help="the first N BraTS cases (0: all)")
    parser.add_argument("--brats-step", type=int, default=1, help="every N-th voxel (1: full resolution)")
    args = parser.parse_args()
    ham = args.data / "ham10000"
    ids = [row[0] for row in read_metadata(ham)][:args.ham10000 or None]
    ham10000_to_dicom(ham, args.out / "ham10000", ids)
    cvc = args.data / "polyp" / "cvc_clinicdb_256"
    names = [image.name for image, _ in matched_pairs(cvc)][:args.cvc or None]
    image_mask_to_dicom(cvc, args.out / "polyp", names)
    for case in find_cases(args.data / "brats")[:args.brats or None]:
        brats_to_dicom(case, args.out / "brats", step=args.brats_step)
    print(f"DICOM copies written under {args.out} ({METADATA_FILE} order, CVC by video, BraTS as MR series + SEG)")


if __name__ == "__main__":
    main()
