"""dataset='dicom': DICOM copies of the real data (benchmarks/dicom/make_dicom.py) read as the originals are, split
by patient, trained on; SEGs read back as the masks they were made from; no header value in any message or server
log line; bad files named in one line. pydicom's own test files cover the odd instances.

The real-data tests read ../shared/data and skip without it; small subsets are written to tmp_path.
"""

from __future__ import annotations

import csv
import logging
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file

from benchmarks.dicom.make_dicom import brats_to_dicom, ham10000_to_dicom, image_mask_to_dicom
from common.config import JobConfig, load_job_config
from common.data import sources
from common.data.brats import MODALITIES, load_case
from common.data.containers import DataError
from common.data.dicom_brain import load_study
from common.data.dicom_images import load_dicom_classification, load_dicom_segmentation, seg_masks
from common.data.ham10000 import METADATA_FILE, load_ham10000
from common.data.image_files import read_mask
from common.data.image_mask import GROUPS_FILE, load_image_mask, matched_pairs, pair_groups
from common.engine.inprocess import run_rounds, simulated_sites

from .conftest import shared_data

IDENTIFYING = ("PatientID", "PatientName", "PatientBirthDate", "StudyInstanceUID", "SeriesInstanceUID",
               "SOPInstanceUID", "FrameOfReferenceUID", "StudyDate", "StudyDescription", "SeriesDescription",
               "AccessionNumber", "ReferringPhysicianName")


def ham_subset(folder: Path, out: Path, per_class: int = 12) -> list[str]:
    """The first ``per_class`` images of each diagnosis as a HAM10000 folder (the metadata's order kept)."""
    with (folder / METADATA_FILE).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    taken: dict[str, int] = {}
    kept = [row for row in rows if taken.setdefault(row["dx"], 0) < per_class and not taken.update(
        {row["dx"]: taken[row["dx"]] + 1})]
    (out / "images").mkdir(parents=True)
    with (out / METADATA_FILE).open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(kept)
    for row in kept:
        shutil.copy2(folder / "images" / f"{row['image_id']}.jpg", out / "images")
    return [row["image_id"] for row in kept]


@pytest.fixture(scope="module")
def ham(tmp_path_factory):
    root = tmp_path_factory.mktemp("ham")
    ids = ham_subset(shared_data("ham10000"), root / "jpeg")
    ham10000_to_dicom(root / "jpeg", root / "dicom", ids)
    return root


def header_values(folder: Path) -> set[str]:
    values = set()
    for path in folder.rglob("*.dcm"):
        ds = pydicom.dcmread(path, stop_before_pixels=True)
        values.update(str(ds[keyword].value) for keyword in IDENTIFYING if keyword in ds and str(ds[keyword].value))
    return values


def ham_config(ham: Path, dataset: str, **extra) -> JobConfig:
    data = ham / ("dicom" if dataset == "dicom" else "jpeg")
    return load_job_config({
        "run-name": "t", "dataset": dataset, "data-dir": str(data), "model": "small-cnn", "image-size": 16,
        "batch-size": 16, "local-epochs": 1, "num-server-rounds": 1, "min-partition-size": 5, "device": "cpu",
        "dataset-args": '{"classes": ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]}' if dataset == "dicom" else "",
        **extra})


def test_a_dicom_copy_of_ham10000_splits_and_scores_as_the_original(ham, tmp_path):
    """Same images, labels and lesion groups (Patient ID = lesion_id), so the same split and, on one seed, the
    same metrics after a round of two hospitals."""
    original = load_ham10000(ham / "jpeg", 16)
    copy = load_dicom_classification(ham / "dicom", 16, ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"))
    assert np.array_equal(copy.images, original.images) and np.array_equal(copy.labels, original.labels)
    lesion_of_patient = dict(zip(copy.groups.tolist(), original.groups.tolist()))
    assert len(set(lesion_of_patient.values())) == len(lesion_of_patient)  # one patient group per lesion
    assert [lesion_of_patient[g] for g in copy.groups] == original.groups.tolist()
    assert len(np.unique(copy.groups)) < len(copy)  # lesions with several images: the grouping matters here
    histories = {}
    for dataset in ("ham10000", "dicom"):
        cfg = ham_config(ham, dataset)
        split = sources.simulation_split(cfg)
        histories[dataset] = (split, run_rounds(cfg, simulated_sites(cfg, 2)).history)
    (jpeg_split, jpeg_history), (dicom_split, dicom_history) = histories["ham10000"], histories["dicom"]
    assert [Path(n).stem for n in dicom_split.test.names] == jpeg_split.test.names.tolist()
    assert [Path(n).stem for n in dicom_split.pool.names] == jpeg_split.pool.names.tolist()
    assert not set(dicom_split.test.groups) & set(dicom_split.pool.groups)  # no patient on both sides
    assert dicom_history[0]["test"] == jpeg_history[0]["test"] and dicom_history[0]["test"]


def test_labels_keyed_by_sop_instance_uid_read_the_same_samples(ham, tmp_path):
    ids = [p.stem for p in sorted((ham / "jpeg" / "images").iterdir())][:10]
    ham10000_to_dicom(ham / "jpeg", tmp_path / "by-uid", ids, key="sop_instance_uid")
    by_uid = load_dicom_classification(tmp_path / "by-uid", 16)
    by_path = load_dicom_classification(ham / "dicom", 16)
    index = [by_path.names.tolist().index(name) for name in by_uid.names]
    assert np.array_equal(by_uid.images, by_path.images[index])
    assert by_uid.groups.tolist() == by_path.groups[index].tolist()


def test_partition_keeps_dicom_as_dicom_and_patients_in_one_folder(ham, tmp_path):
    from common.data.export import export_partitions

    cfg = ham_config(ham, "dicom", partitioner="iid")
    export_partitions(cfg, 2, tmp_path / "sites")
    whole = sources.simulation_split(cfg)
    owner: dict[str, str] = {}
    for site in ("test", "hospital-00", "hospital-01"):
        folder = tmp_path / "sites" / site
        assert all(pydicom.dcmread(p).SOPClassUID == "1.2.840.10008.5.1.4.1.1.77.1.4"
                   for p in (folder / "images").iterdir())
        part = load_dicom_classification(folder, 16, ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"))
        for group in set(part.groups.tolist()):
            assert owner.setdefault(group, site) == site
    assert len(owner) == len(set(whole.pool.groups) | set(whole.test.groups))


def test_the_header_values_of_a_dicom_run_reach_no_message_and_no_server_log_line(ham, tmp_path, caplog):
    """A FakeGrid run on the DICOM copy, two simulated hospitals and a deployed one whose folder holds an instance
    compressed without its codec: every message both ways (config values, metric and array names, array bytes,
    error reasons) and every log line, searched for every identifying header value of the files."""
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, hospital_node, simulated_hospitals

    broken = tmp_path / "broken"
    ham10000_to_dicom(ham / "jpeg", broken, [p.stem for p in sorted((ham / "jpeg" / "images").iterdir())][:8])
    shutil.copy2(get_testdata_file("JPEG-lossy.dcm"), broken / "images")
    with (broken / "labels.csv").open("a") as handle:
        handle.write("images/JPEG-lossy.dcm,nv\n")
    values = header_values(ham / "dicom") | header_values(broken)
    assert len(values) > 50
    config = {**ham_config(ham, "dicom").to_flat(), "state-dir": str(tmp_path / "state"),
              "results-dir": str(tmp_path / "results")}
    nodes = simulated_hospitals(config, 2)
    nodes[201] = hospital_node(config, {"hospital": "h-broken", "data-dir": str(broken),
                                        "state-dir": str(tmp_path / "state-broken")}, 201)
    grid = FakeGrid(nodes)
    with caplog.at_level(logging.DEBUG):
        FedAvgStrategy(min_train_nodes=2, run_config=config).start(grid, num_rounds=1)
    refusals = [reply.error.reason for reply in grid.replies if reply.has_error()]
    assert any("JPEG-lossy.dcm" in reason and "JPEG Extended" in reason for reason in refusals), refusals
    assert sum(not reply.has_error() for reply in grid.replies) >= 4  # the two others joined and trained
    texts, blobs = [record.getMessage() for record in caplog.records], []
    for message in grid.sent + grid.replies:
        if message.has_error():
            texts.append(message.error.reason)
            continue
        for name, record in message.content.items():
            texts.append(name)
            for key, value in record.items():
                texts.append(key)
                if hasattr(value, "data"):
                    blobs.append(bytes(value.data))
                else:
                    texts.append(repr(value))
    texts += [path.read_text(errors="replace") for path in (tmp_path / "results").rglob("*")
              if path.is_file() and path.suffix in (".json", ".jsonl", ".md", ".csv", ".txt")]
    assert len(texts) > 20 and blobs
    for value in values:
        assert not any(value in text for text in texts), f"header value {value!r} left the hospital"
        assert not any(value.encode() in blob for blob in blobs), f"header value {value!r} in an array's bytes"


# --- 2D segmentation: endoscopy frames and their SEGs ----------------------------------------------------------
@pytest.fixture(scope="module")
def cvc(tmp_path_factory):
    root = tmp_path_factory.mktemp("cvc")
    source = shared_data("polyp", "cvc_clinicdb_256")
    pairs = matched_pairs(source)
    names = [image.name for image, _ in pairs][::13]  # frames of many videos
    subset = root / "jpeg" / "cvc_clinicdb_256"
    for sub in ("images", "masks"):
        (subset / sub).mkdir(parents=True)
        for name in names:
            shutil.copy2(source / sub / name, subset / sub)
    groups = dict(zip((image.name for image, _ in pairs), pair_groups(source, [image for image, _ in pairs])))
    (subset / GROUPS_FILE).write_text("image,group\n" + "".join(f"{n},{groups[n]}\n" for n in names))  # the videos
    image_mask_to_dicom(source, root / "dicom", names)
    return root


def test_a_seg_reads_back_as_the_mask_it_was_made_from_over_its_own_frame(cvc):
    folder = cvc / "dicom" / "cvc_clinicdb_256"
    images = {str(pydicom.dcmread(p, stop_before_pixels=True).SOPInstanceUID): p for p in (folder / "images").iterdir()}
    for seg_path in sorted((folder / "masks").iterdir()):
        masks = seg_masks(seg_path, images)
        (uid, mask), = masks.items()
        image = pydicom.dcmread(images[uid])
        assert images[uid].stem == seg_path.stem
        seg = pydicom.dcmread(seg_path)
        assert (seg.Rows, seg.Columns) == (image.Rows, image.Columns) == mask.shape
        assert seg.FrameOfReferenceUID == image.FrameOfReferenceUID
        assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == image.SeriesInstanceUID
        original = read_mask(cvc / "jpeg" / "cvc_clinicdb_256" / "masks" / f"{seg_path.stem}.jpg", None)
        assert np.array_equal(mask, original)


def test_endoscopy_frames_group_by_patient_as_their_videos_and_train(cvc, tmp_path):
    original = load_image_mask(cvc / "jpeg", 16)
    copy = load_dicom_segmentation(cvc / "dicom", 16)
    assert np.array_equal(copy.images, original.images)
    pairs = dict(zip(copy.groups.tolist(), original.groups.tolist()))
    assert len(set(pairs.values())) == len(pairs) > 1 and [pairs[g] for g in copy.groups] == original.groups.tolist()
    cfg = load_job_config({"run-name": "t", "task": "polyp-segmentation", "dataset": "dicom",
                                    "data-dir": str(cvc / "dicom"), "image-size": 16, "batch-size": 8,
                                    "num-server-rounds": 1, "min-partition-size": 2, "device": "cpu",
                                    "strategy": "fedavg", "partitioner": "iid"})
    history = run_rounds(cfg, simulated_sites(cfg, 2)).history
    assert 0.0 <= history[0]["test"]["dice"] <= 1.0
    assert set(sources.simulation_split(cfg).test.groups).isdisjoint(sources.simulation_split(cfg).pool.groups)


def test_partition_of_endoscopy_keeps_frames_with_their_segs_and_videos_whole(cvc, tmp_path):
    from common.data.export import export_partitions

    cfg = load_job_config({"run-name": "t", "task": "polyp-segmentation", "dataset": "dicom", "image-size": 16,
                           "data-dir": str(cvc / "dicom"), "partitioner": "iid", "min-partition-size": 2})
    export_partitions(cfg, 2, tmp_path / "sites")
    owner: dict[str, str] = {}
    whole = load_dicom_segmentation(cvc / "dicom", 16)
    for site in ("test", "hospital-00", "hospital-01"):
        part = load_dicom_segmentation(tmp_path / "sites" / site, 16)  # each image's SEG came with it
        for name, group, mask in zip(part.names, part.groups, part.masks):
            assert owner.setdefault(group, site) == site
            assert np.array_equal(mask, whole.masks[whole.names.tolist().index(name)])
    assert set(owner) == set(whole.groups.tolist())


# --- brain tumour studies ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def brats(tmp_path_factory):
    """Two BraTS cases (every 4th voxel) as DICOM studies and as the NIfTI folders they were made from."""
    import nibabel as nib

    from common.data.brats import find_cases, volume_path

    root = tmp_path_factory.mktemp("brats")
    for case in find_cases(shared_data("brats"))[:2]:
        brats_to_dicom(case, root / "dicom", step=4)
        (root / "nifti" / case.name).mkdir(parents=True)
        for kind in (*MODALITIES, "seg"):
            image = nib.load(str(volume_path(case, kind)))
            affine = image.affine.copy()
            affine[:3, :3] *= 4
            nib.save(nib.Nifti1Image(np.asarray(image.dataobj)[::4, ::4, ::4], affine),
                     str(root / "nifti" / case.name / f"{case.name}_{kind}.nii.gz"))
    return root


def test_a_study_reads_as_the_nifti_case_it_was_made_from(brats):
    """The same arrays (volumes and labels), and the same cases to split."""
    from common.data.brain_sources import case_names

    def brain(dataset: str) -> JobConfig:
        return load_job_config({"task": "brain-tumour-segmentation", "strategy": "fedmepd", "dataset": dataset,
                                "data-dir": str(brats / ("dicom" if dataset == "dicom" else "nifti"))})

    assert case_names(brain("dicom")) == case_names(brain("brats"))
    for study in sorted((brats / "dicom").iterdir()):
        case = load_case(brats / "nifti" / study.name)
        read = load_study(study)
        assert np.array_equal(read.image, case.image) and np.array_equal(read.label, case.label)
        assert set(np.unique(read.label).tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("description,modality", [
    ("AX T2 FLAIR", "flair"), ("t2_tirm_tra_dark-fluid FLAIR", "flair"), ("AX T1 POST GD", "t1ce"), ("T1C", "t1ce"),
    ("t1_mprage_sag_Gd", "t1ce"), ("T1+C AX", "t1ce"), ("AX T1 PRE", "t1"), ("t1_se_tra", "t1"),
    ("AX T2 FSE", "t2"), ("t2_tse_tra", "t2"), ("DWI b1000", None), ("3-plane localizer", None)])
def test_the_default_series_rule_maps_the_usual_names(description, modality):
    from common.data.dicom_brain import DEFAULT_RULES, modality_of

    assert modality_of(description, DEFAULT_RULES) == modality


def test_partial_modalities_a_hospital_rule_and_another_grid(brats, tmp_path):
    """A hospital with T1c and T2 only, which names its T1c series its own way, and whose T2 series is stored
    flipped (another grid, resampled onto the first)."""
    study = sorted((brats / "dicom").iterdir())[0]
    case = load_case(brats / "nifti" / study.name, ("t1ce", "t2"))
    mine = tmp_path / "site" / study.name
    shutil.copytree(study, mine, ignore=shutil.ignore_patterns("flair", "t1"))
    for path in (mine / "t1ce").iterdir():
        ds = pydicom.dcmread(path)
        ds.SeriesDescription = "MPRAGE GADO"
        ds.save_as(path)
    (tmp_path / "site" / "series-rules.json").write_text('{"t1ce": ["*gado*"]}')
    with pytest.raises(DataError, match=f"{mine}: no series for t1ce"):
        _without_rule(mine)
    for path in (mine / "t2").iterdir():  # the series written bottom slice last, rows mirrored
        ds = pydicom.dcmread(path)
        pixels = ds.pixel_array[::-1]
        ds.PixelData = np.ascontiguousarray(pixels).tobytes()
        orientation = [float(v) for v in ds.ImageOrientationPatient]
        spacing = float(ds.PixelSpacing[0])
        position = np.array(ds.ImagePositionPatient, dtype=float) + (ds.Rows - 1) * spacing * np.array(orientation[3:])
        ds.ImageOrientationPatient = orientation[:3] + [-v for v in orientation[3:]]
        ds.ImagePositionPatient = position.tolist()
        ds.save_as(path)
    (mine / "seg").rename(tmp_path / "seg-elsewhere")  # labels from a NIfTI beside the series instead
    shutil.copy2(brats / "nifti" / study.name / f"{study.name}_seg.nii.gz", mine / "tumour_seg.nii.gz")
    read = load_study(mine, ("t1ce", "t2"))
    assert read.modalities == ("t1ce", "t2")
    assert np.allclose(read.image, case.image, atol=1e-5) and np.array_equal(read.label, case.label)


def _without_rule(study: Path):
    rules = study.parent / "series-rules.json"
    saved = rules.read_text()
    rules.unlink()
    try:
        return load_study(study, ("t1ce", "t2"), with_label=False)
    finally:
        rules.write_text(saved)


def test_fedmepd_trains_on_dicom_studies(brats, tmp_path):
    """Three studies (two more copied under other names), one round of FedMEPD's local baseline."""
    data = tmp_path / "studies"
    for index, study in enumerate(sorted((brats / "dicom").iterdir()) * 2):
        shutil.copytree(study, data / f"{study.name}-{index}")
    cfg = load_job_config({
        "run-name": "t", "task": "brain-tumour-segmentation", "dataset": "dicom", "data-dir": str(data),
        "strategy": "fedmepd-local", "num-server-rounds": 1, "batch-size": 1, "brain.widths": "4,8,16,32",
        "brain.crop-size": 16, "brain.downsample": 2, "brain.hospital-modalities": "t1ce,t2", "test-fraction": 0.25,
        "brain.server-fraction": 0.25, "device": "cpu"})
    history = run_rounds(cfg, simulated_sites(cfg, 1)).history
    assert history and history[0]["test"]


# --- bad files: one line naming the file ---------------------------------------------------------------------------
def one_line_naming(error: pytest.ExceptionInfo, path: Path, values: set[str] = frozenset()) -> str:
    text = str(error.value)
    assert "\n" not in text and str(path) in text, text
    assert not any(value in text for value in values), text
    return text


def classification_folder(tmp_path: Path, *files: str) -> Path:
    folder = tmp_path / "odd"
    folder.mkdir()
    with (folder / "labels.csv").open("w") as handle:
        handle.write("path,label\n" + "".join(f"{Path(f).name},a\n" for f in files))
    for name in files:
        shutil.copy2(get_testdata_file(name), folder)
    return folder


def test_pydicoms_odd_instances_grey_16_bit_and_rle_read_as_images(tmp_path):
    folder = classification_folder(tmp_path, "CT_small.dcm", "MR_small_RLE.dcm", "SC_rgb_jpeg_dcmtk.dcm")
    data = load_dicom_classification(folder, 32)
    assert data.images.shape == (3, 32, 32, 3) and data.images.dtype == np.uint8
    assert data.images[0].std() > 0 and np.array_equal(data.images[0][..., 0], data.images[0][..., 2])


def test_a_compressed_instance_without_its_codec_is_named(tmp_path):
    folder = classification_folder(tmp_path, "CT_small.dcm", "JPEG-lossy.dcm")
    with pytest.raises(DataError) as error:
        load_dicom_classification(folder, 32)
    assert "JPEG Extended" in one_line_naming(error, folder / "JPEG-lossy.dcm", header_values(folder))


def test_a_file_that_is_not_dicom_is_named(tmp_path):
    folder = classification_folder(tmp_path, "CT_small.dcm")
    (folder / "notes.dcm").write_bytes(b"not a DICOM file")
    (folder / "labels.csv").write_text("path,label\nCT_small.dcm,a\nnotes.dcm,a\n")
    with pytest.raises(DataError) as error:
        load_dicom_classification(folder, 32)
    one_line_naming(error, folder / "notes.dcm")


def test_a_seg_of_another_series_is_named(cvc, tmp_path):
    folder = tmp_path / "mixed" / "cvc"
    shutil.copytree(cvc / "dicom" / "cvc_clinicdb_256", folder)
    first = sorted((folder / "images").iterdir())[0]
    first.unlink()  # its SEG now references an instance that is not an image here
    with pytest.raises(DataError) as error:
        load_dicom_segmentation(folder.parent, 16)
    one_line_naming(error, folder / "masks" / f"{first.stem}.dcm", header_values(folder))


def test_an_unforeseen_error_of_the_dicom_libraries_reaches_the_server_without_its_text(cvc, brats, monkeypatch):
    """Whatever pydicom or highdicom raise, and whatever their message quotes, a loader's error names the folder and
    the error's kind only."""
    import highdicom as hd

    folder = cvc / "dicom"
    patient = pydicom.dcmread(next((folder / "cvc_clinicdb_256" / "images").iterdir())).PatientID

    def quoting(*args, **kwargs):
        raise RuntimeError(f"unexpected value in the header of patient {patient}")

    monkeypatch.setattr(hd.seg, "segread", quoting)
    monkeypatch.setattr(hd, "get_volume_from_series", quoting)
    with pytest.raises(DataError) as error:
        load_dicom_segmentation(folder, 17)  # a size not cached yet
    assert "RuntimeError" in one_line_naming(error, folder, {patient})
    study = sorted((brats / "dicom").iterdir())[0]
    with pytest.raises(DataError) as error:
        load_study(study, downsample=3)
    assert "RuntimeError" in one_line_naming(error, study, header_values(study))


def test_a_missing_series_and_a_series_of_mixed_grids_are_named(brats, tmp_path):
    study = tmp_path / "site" / "case"
    shutil.copytree(sorted((brats / "dicom").iterdir())[0], study)
    values = header_values(study)
    shutil.rmtree(study / "flair")
    with pytest.raises(DataError) as error:
        load_study(study)
    assert "no series for flair" in one_line_naming(error, study, values)
    stray = sorted((study / "t1").iterdir())[3]
    ds = pydicom.dcmread(stray)
    ds.Rows, ds.Columns = ds.Rows - 1, ds.Columns - 1
    ds.PixelData = np.zeros((ds.Rows, ds.Columns), np.int16).tobytes()
    ds.save_as(stray)
    with pytest.raises(DataError) as error:
        load_study(study, ("t1ce", "t1", "t2"))
    one_line_naming(error, sorted((study / "t1").iterdir())[0], values)


# --- DICOM SEG out --------------------------------------------------------------------------------------------------
def red_above_half(images: list[np.ndarray]) -> list[np.ndarray]:
    """A stand-in segmenter: the pixels whose red is above 128."""
    return [(rgb[..., 0] > 128).astype(np.uint8) for rgb in images]


def test_a_seg_out_covers_each_frame_or_a_whole_series_and_names_the_algorithm(cvc, brats, tmp_path):
    """SEGs over the DICOM frames (one each: no patient geometry) and over an MR series (one for all its slices):
    each references its source, on its frame of reference and grid, holds the masks it was given and is identified
    by method, run and checkpoint hash."""
    import highdicom as hd

    from cli.int8_export import dicom_images
    from common.data.dicom_images import segment_instances
    from common.data.dicom_write import Algorithm

    algorithm = Algorithm("fedavg", "run-1", "ab" * 32)
    frames = dicom_images(cvc / "dicom")
    written = segment_instances(frames, tmp_path / "frames", red_above_half, algorithm)
    images = {str(pydicom.dcmread(p, stop_before_pixels=True).SOPInstanceUID): p for p in frames}
    assert len(written) == len(frames) == len(images)
    for path in written:
        (uid, mask), = seg_masks(path, images).items()
        image, seg = pydicom.dcmread(images[uid]), pydicom.dcmread(path)
        assert path.name == f"{images[uid].stem}.seg.dcm" and seg.FrameOfReferenceUID == image.FrameOfReferenceUID
        assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == image.SeriesInstanceUID
        assert np.array_equal(mask, red_above_half([image.pixel_array])[0])
        segment = seg.SegmentSequence[0]
        assert segment.SegmentAlgorithmType == "AUTOMATIC"
        named = hd.AlgorithmIdentificationSequence.from_sequence(segment.SegmentationAlgorithmIdentificationSequence)
        assert named.name == "fedmed fedavg" and named.parameters == {"run": "run-1", "checkpoint-sha256": "ab" * 32}
    series = sorted((sorted((brats / "dicom").iterdir())[0] / "flair").iterdir())
    (written,) = segment_instances(series, tmp_path / "mr", lambda images: [np.ones(i.shape[:2], np.uint8)
                                                                             for i in images], algorithm)
    seg = hd.seg.segread(written)
    assert {uid for _, _, uid in seg.get_source_image_uids()} == {
        str(pydicom.dcmread(p, stop_before_pixels=True).SOPInstanceUID) for p in series}
    volume = seg.get_volume()
    assert volume.geometry_equal(hd.get_volume_from_series([pydicom.dcmread(p) for p in series]))
    assert volume.array.all()


@pytest.mark.slow
def test_fedmed_segment_on_dicom_writes_the_masks_it_writes_for_the_jpegs(cvc, tmp_path, capsys):
    """`fedmed segment` of an exported run: SEGs over the DICOM copy hold the masks of the PNGs it writes for the
    JPEG frames, identified by the run's method, name and checkpoint SHA-256 (an ONNX export: ~30 s on 2 cores)."""
    import hashlib

    import highdicom as hd

    from cli.main import main as fedmed

    from .test_qfedpolyp_int8 import saved_run

    saved_run(tmp_path)
    checkpoint = next((tmp_path / "run").rglob("round-00001.npz"))
    model = tmp_path / "polyp-int8.onnx"
    assert fedmed(["export-int8", "--run", str(tmp_path / "run"), "--out", str(model), "--calibration-images",
                   "8"]) == 0
    for images, out in (("jpeg", "png"), ("dicom", "seg")):
        assert fedmed(["segment", "--model", str(model), "--images", str(cvc / images), "--out",
                       str(tmp_path / out)]) == 0
    images = {str(pydicom.dcmread(p).SOPInstanceUID): p
              for p in (cvc / "dicom" / "cvc_clinicdb_256" / "images").iterdir()}
    segs = sorted((tmp_path / "seg").iterdir())
    assert len(segs) == len(images) and f"{len(segs)} masks written" in capsys.readouterr().out
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    for path in segs:
        (uid, mask), = seg_masks(path, images).items()
        png = np.asarray(Image.open(tmp_path / "png" / f"{images[uid].stem}.png")) > 0
        assert np.array_equal(mask.astype(bool), png)
        named = hd.AlgorithmIdentificationSequence.from_sequence(
            pydicom.dcmread(path).SegmentSequence[0].SegmentationAlgorithmIdentificationSequence)
        assert named.name == "fedmed qfedpolyp" and named.parameters == {"run": "q", "checkpoint-sha256": digest}
