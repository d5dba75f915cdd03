"""Reading DICOM files at the hospital (pydicom, highdicom), with errors that name the file and never a header value.

A DICOM header holds who the patient is (name, id, birth date), when and where they were seen and free-text
descriptions. The loaders read headers here, at the hospital, and keep of them only what a split needs: each
instance's *group*, a one-way digest of its Patient ID (its Study Instance UID when it has none), so one patient's
images stay on one side of every split. A sample's name is its file's path under the data folder, as for image
files. No header value goes into a container, a DataError (which the hospital reports to the server) or a log line.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

from .containers import DataError
from .image_files import regular_file

#: files under a DICOM data folder that are not instances (the labels, the series rules, masks as image files)
NOT_DICOM_SUFFIXES = (".csv", ".json", ".txt", ".md", ".nii", ".gz", ".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff")
SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"
#: a NIfTI affine is RAS, DICOM's patient coordinates LPS
RAS_TO_LPS = np.diag([-1.0, -1.0, 1.0, 1.0])


def headers_stay_here(read):
    """``read(folder_or_file, ...)`` with any error other than our DataErrors (whose messages hold no header value)
    turned into a DataError naming its first argument and the error's kind only: a pydicom or highdicom message
    may quote a tag's value, and a hospital's error reaches the server."""

    @functools.wraps(read)
    def wrapped(where, *args, **kwargs):
        try:
            return read(where, *args, **kwargs)
        except DataError:
            raise
        except Exception as error:
            raise DataError(f"{where}: cannot be read as DICOM ({type(error).__name__}; the error's text is not "
                            "passed on, as it may quote a header: read it at the hospital with pydicom)") from None

    return wrapped


def dicom_files(folder: Path) -> list[Path]:
    """Every file under ``folder`` that may be a DICOM instance (hidden files, DICOMDIR and the data folder's own
    CSV/JSON/NIfTI/image files left out), sorted."""
    if not folder.is_dir():
        raise DataError(f"{folder}: {'is a file, not' if folder.exists() else 'no such'} folder of DICOM files")
    found = []
    for path in sorted(folder.rglob("*")):
        if path.name.startswith(".") or path.name.upper() == "DICOMDIR" or path.is_dir():
            continue
        if path.suffix.lower() not in NOT_DICOM_SUFFIXES:
            found.append(regular_file(path, "DICOM file"))
    return found


def _dcmread(path: Path, **options):
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        return pydicom.dcmread(regular_file(path, "DICOM file"), **options)
    except (InvalidDicomError, EOFError, OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{path}: not a readable DICOM file ({type(error).__name__})") from None


def _no_codec(path: Path, syntax) -> DataError:
    return DataError(f"{path}: pixels compressed as {syntax.name}, which no codec installed here decodes (pip install "
                     "pylibjpeg pylibjpeg-libjpeg pylibjpeg-openjpeg, or store it uncompressed)")


def read_header(path: Path):
    """The instance's header (no pixels); a DataError naming the file when it is not DICOM."""
    return _dcmread(path, stop_before_pixels=True)


def read_instance(path: Path):
    """The whole instance, an image whose transfer syntax some installed codec decodes (else a DataError naming the
    file)."""
    from pydicom.pixels import get_decoder

    ds = _dcmread(path)
    if "PixelData" not in ds:
        raise DataError(f"{path}: a DICOM instance without pixel data (not an image)")
    syntax = ds.file_meta.TransferSyntaxUID
    if syntax.is_compressed:
        try:
            available = get_decoder(syntax).is_available
        except NotImplementedError:
            available = False
        if not available:
            raise _no_codec(path, syntax)
    return ds


def pixels(ds, path: Path) -> np.ndarray:
    """The instance's pixel array (one frame); a DataError naming the file when it does not decode (a codec that
    refuses this bit depth, truncated data)."""
    try:
        array = ds.pixel_array
    except Exception as error:  # pydicom's decoders raise RuntimeError, ValueError, their plugins' own kinds
        syntax = ds.file_meta.TransferSyntaxUID
        raise (_no_codec(path, syntax) if syntax.is_compressed else
               DataError(f"{path}: pixels do not decode ({type(error).__name__})")) from None
    if int(getattr(ds, "NumberOfFrames", 1) or 1) > 1:
        raise DataError(f"{path}: a multi-frame instance ({int(ds.NumberOfFrames)} frames); a 2D sample is one "
                        "single-frame instance")
    return array


def rgb_pixels(ds, path: Path) -> np.ndarray:
    """(H, W, 3) uint8: colour as RGB (pydicom converts YBR), grey repeated, deeper grey scaled to 0..255."""
    array = pixels(ds, path)
    photometric = str(getattr(ds, "PhotometricInterpretation", "")).upper()
    if array.ndim == 2:
        if array.dtype != np.uint8:
            low, high = float(array.min()), float(array.max())
            array = ((array - low) / (high - low or 1.0) * 255).round()
        if photometric == "MONOCHROME1":
            array = 255 - array
        array = np.repeat(array.astype(np.uint8)[..., None], 3, axis=-1)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise DataError(f"{path}: pixel array of shape {array.shape} is neither grey nor colour (H, W, 3)")
    return np.ascontiguousarray(array, dtype=np.uint8)


def group_of(ds) -> str:
    """The instance's group: a digest of its Patient ID (its Study Instance UID when it has none), so the value
    itself is never kept."""
    key = str(getattr(ds, "PatientID", "") or "").strip()
    kind = "patient"
    if not key:
        key, kind = str(getattr(ds, "StudyInstanceUID", "") or ""), "study"
    return f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def is_seg(ds) -> bool:
    return str(getattr(ds, "SOPClassUID", "")) == SEG_STORAGE
