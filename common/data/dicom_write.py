"""Images as DICOM instances and masks as DICOM SEG (pydicom composes the instances, highdicom the SEGs).

What a PACS would hand a hospital, made from arrays: photographs (VL Photographic Image Storage), endoscopy frames
(VL Endoscopic Image Storage), MR series (MR Image Storage, one instance per slice) and segmentations over any of
them. ``benchmarks/dicom/make_dicom.py`` writes DICOM copies of the real data sets with these; the tests write small
ones; ``fedmed segment`` writes its SEGs with :func:`write_seg`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from .dicom_files import RAS_TO_LPS

VL_PHOTOGRAPHIC = "1.2.840.10008.5.1.4.1.1.77.1.4"
VL_ENDOSCOPIC = "1.2.840.10008.5.1.4.1.1.77.1.1"
MR_IMAGE = "1.2.840.10008.5.1.4.1.1.4"
MODALITY_OF = {VL_PHOTOGRAPHIC: "XC", VL_ENDOSCOPIC: "ES", MR_IMAGE: "MR"}


@dataclass(frozen=True)
class Study:
    """Who and which study an instance belongs to (the identifying tags a test must never see leave)."""

    patient_id: str
    patient_name: str = "Anonymous^Patient"
    study_uid: str = field(default_factory=generate_uid)
    study_date: str = "20240131"
    study_description: str = "fedmed test study"


def _base(sop_class: str, study: Study, series_uid: str, series_number: int, description: str,
          instance_number: int) -> Dataset:
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = sop_class
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID = sop_class
    ds.PatientID, ds.PatientName = study.patient_id, study.patient_name
    ds.PatientBirthDate, ds.PatientSex = "19700101", "O"
    ds.StudyInstanceUID, ds.StudyDate, ds.StudyTime = study.study_uid, study.study_date, "120000"
    ds.StudyDescription, ds.StudyID, ds.AccessionNumber = study.study_description, "1", "ACC1"
    ds.ReferringPhysicianName = "Referrer^Doctor"
    ds.SeriesInstanceUID, ds.SeriesNumber, ds.SeriesDescription = series_uid, series_number, description
    ds.SeriesDate = ds.ContentDate = study.study_date
    ds.ContentTime = "120000"
    ds.Modality = MODALITY_OF[sop_class]
    ds.InstanceNumber = instance_number
    ds.Manufacturer = "fedmed"
    return ds


def _save(ds: Dataset, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def write_rgb_image(rgb: np.ndarray, path: Path, study: Study, *, sop_class: str = VL_PHOTOGRAPHIC,
                    series_uid: str | None = None, instance_number: int = 1, description: str = "",
                    frame_of_reference: str | None = None) -> Dataset:
    """One single-frame colour instance (uncompressed RGB, the pixels exactly as given); a series' frames share
    ``series_uid`` and ``frame_of_reference`` (a SEG over several frames needs both)."""
    ds = _base(sop_class, study, series_uid or generate_uid(), 1, description, instance_number)
    ds.FrameOfReferenceUID = frame_of_reference or generate_uid()
    ds.ImageType = ["ORIGINAL", "PRIMARY"]
    ds.Rows, ds.Columns = int(rgb.shape[0]), int(rgb.shape[1])
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0

    ds.LossyImageCompression = "00"
    ds.PixelData = np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()
    _save(ds, path)
    return ds


def write_mr_series(volume: np.ndarray, affine: np.ndarray, folder: Path, study: Study, description: str,
                    series_number: int, frame_of_reference: str) -> list[Dataset]:
    """A 3D volume (as nibabel holds it: ``volume[i, j, k]`` at ``affine @ (i, j, k, 1)``, RAS) as an MR series of
    slices along k: slice k's pixel (row j, column i), so the series read back is ``volume`` on the same grid."""
    lps = RAS_TO_LPS @ np.asarray(affine, dtype=np.float64)
    column_step, row_step, slice_step = lps[:3, 0], lps[:3, 1], lps[:3, 2]  # per i, j, k
    spacing = [float(np.linalg.norm(row_step)), float(np.linalg.norm(column_step))]
    orientation = [*(column_step / spacing[1]), *(row_step / spacing[0])]
    series_uid = generate_uid()
    values = np.asarray(volume)
    signed = values.min() < 0
    written = []
    for k in range(values.shape[2]):
        ds = _base(MR_IMAGE, study, series_uid, series_number, description, k + 1)
        ds.FrameOfReferenceUID = frame_of_reference
        ds.ImageType = ["ORIGINAL", "PRIMARY", "OTHER"]
        ds.ScanningSequence, ds.SequenceVariant, ds.ScanOptions, ds.MRAcquisitionType = "SE", "NONE", "", "3D"
        ds.RepetitionTime, ds.EchoTime, ds.EchoTrainLength, ds.MagneticFieldStrength = 2000.0, 100.0, 1, 3.0
        ds.ImagePositionPatient = [float(v) for v in lps[:3, 3] + k * slice_step]
        ds.ImageOrientationPatient = [float(v) for v in orientation]
        ds.PixelSpacing = spacing
        ds.SliceThickness = float(np.linalg.norm(slice_step))
        ds.Rows, ds.Columns = int(values.shape[1]), int(values.shape[0])
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, int(signed)
        ds.PixelData = np.ascontiguousarray(values[:, :, k].T, dtype=np.int16 if signed else np.uint16).tobytes()
        _save(ds, folder / f"{k + 1:04d}.dcm")
        written.append(ds)
    return written


@dataclass(frozen=True)
class Algorithm:
    """Who made a segmentation: the method, the run and its checkpoint (a SEG's algorithm identification)."""

    method: str
    run: str
    checkpoint_sha256: str

    def identification(self):
        import highdicom as hd
        from pydicom.sr.codedict import codes

        return hd.AlgorithmIdentificationSequence(
            name=f"fedmed {self.method}"[:64], family=codes.cid7162.ArtificialIntelligence,
            version=self.checkpoint_sha256[:16], source="fedmed",
            parameters={"run": self.run, "checkpoint-sha256": self.checkpoint_sha256})


def write_seg(source_images: list[Dataset], masks: np.ndarray, labels: list[str], path: Path,
              algorithm: Algorithm | None = None, series_description: str = "fedmed segmentation") -> Path:
    """A binary DICOM SEG over ``source_images`` (one per frame, a series' slices in any order): ``masks`` is
    (frames, rows, columns) of segment numbers (0 background, i for ``labels[i - 1]``). Manual when ``algorithm``
    is None (a reference segmentation), else automatic and identified."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    automatic = algorithm is not None
    descriptions = [
        hd.seg.SegmentDescription(
            segment_number=number, segment_label=label,
            segmented_property_category=codes.SCT.MorphologicallyAbnormalStructure,
            segmented_property_type=codes.SCT.Neoplasm,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC if automatic
            else hd.seg.SegmentAlgorithmTypeValues.MANUAL,
            algorithm_identification=algorithm.identification() if automatic else None)
        for number, label in enumerate(labels, start=1)]
    seg = hd.seg.Segmentation(
        source_images=source_images, pixel_array=np.asarray(masks, dtype=np.uint8),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY, segment_descriptions=descriptions,
        series_instance_uid=generate_uid(), series_number=100, sop_instance_uid=generate_uid(), instance_number=1,
        manufacturer="fedmed", manufacturer_model_name=algorithm.method if automatic else "reference",
        software_versions=algorithm.checkpoint_sha256[:16] if automatic else "0", device_serial_number="fedmed",
        content_description=series_description[:64], omit_empty_frames=False)
    seg.SeriesDescription = series_description[:64]
    return _save(seg, path)
