"""Loaders refuse silently-wrong data (duplicate ids, paths out of the folder, non-integer or gapped labels,
colour masks, two files of one name, bad BraTS labels, a stale partition folder) with an error naming the file.

Every test writes a tiny folder of its own in tmp_path; none reads ../shared/data.
"""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest
from PIL import Image

from common.data.brats import load_case
from common.data.containers import DataError, LabelledImages
from common.data.ham10000 import METADATA_FILE, load_ham10000
from common.data.image_mask import load_image_mask
from common.data.medmnist_npz import load_npz, write_npz

RNG = np.random.default_rng(0)


def tiny_rgb(path, size=8, mode="RGB"):
    Image.fromarray(RNG.integers(0, 256, (size, size, 3), dtype=np.uint8)).convert(mode).save(path)


# --- HAM10000 ---------------------------------------------------------------------------------------------------

def ham_folder(folder, ids, dx="nv"):
    """A HAM10000 layout with one tiny image per distinct id and one metadata row per id (repeats kept)."""
    (folder / "images").mkdir(parents=True)
    for image_id in set(ids):
        if image_id and "/" not in image_id and ".." not in image_id:
            tiny_rgb(folder / "images" / f"{image_id}.jpg")
    with (folder / METADATA_FILE).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["lesion_id", "image_id", "dx"])
        writer.writerows([f"HAM_{i}", image_id, dx] for i, image_id in enumerate(ids))
    return folder


def test_tiny_ham10000_folder_loads(tmp_path):
    data = load_ham10000(ham_folder(tmp_path, ["ISIC_1", "ISIC_2"]), image_size=8)
    assert data.images.shape == (2, 8, 8, 3) and list(data.names) == ["ISIC_1", "ISIC_2"]


def test_ham10000_duplicate_image_id_names_the_file_and_both_lines(tmp_path):
    folder = ham_folder(tmp_path, ["ISIC_1", "ISIC_2", "ISIC_3", "ISIC_2"])
    with pytest.raises(DataError, match=r"HAM10000_metadata.csv, line 5: image_id 'ISIC_2' appears twice "
                                        r"\(lines 3 and 5\)"):
        load_ham10000(folder, 8)


@pytest.mark.parametrize("image_id", ["../../outside", "../images/ISIC_1", "/etc/passwd", "sub\\ISIC_1", ""])
def test_ham10000_image_id_that_is_a_path_is_refused(tmp_path, image_id):
    tiny_rgb(tmp_path / "outside.jpg")  # what '../../outside' would reach from site/images/
    folder = ham_folder(tmp_path / "site", ["ISIC_1", image_id])
    with pytest.raises(DataError, match=r"HAM10000_metadata.csv, line 3: image_id .* is not a plain file name"):
        load_ham10000(folder, 8)


def test_ham10000_image_linking_out_of_the_folder_is_refused(tmp_path):
    tiny_rgb(tmp_path / "outside.jpg")
    folder = ham_folder(tmp_path / "site", ["ISIC_1"])
    os.symlink(tmp_path / "outside.jpg", folder / "images" / "ISIC_2.jpg")
    with (folder / METADATA_FILE).open("a", newline="") as handle:
        csv.writer(handle).writerow(["HAM_9", "ISIC_2", "mel"])
    with pytest.raises(DataError, match=r"HAM10000_metadata.csv, line 3: images/ISIC_2.jpg resolves to .*outside"):
        load_ham10000(folder, 8)


# --- npz ----------------------------------------------------------------------------------------------------------

def npz_file(path, labels, **extra):
    labels = np.asarray(labels)
    np.savez(path, train_images=np.zeros((len(labels), 8, 8, 3), np.uint8), train_labels=labels.reshape(-1, 1),
             **extra)
    return path


def test_npz_float_labels_with_fractions_are_refused(tmp_path):
    path = npz_file(tmp_path / "soft.npz", np.array([0.0, 1.0, 2.7], np.float32))
    with pytest.raises(DataError, match=r"soft.npz: train_labels\[2\] is 2.7, not a whole number"):
        load_npz(path, 8)


def test_npz_whole_float_labels_load_as_integers(tmp_path):
    data = load_npz(npz_file(tmp_path / "whole.npz", np.array([0.0, 1.0, 2.0])), 8)["train"]
    assert data.labels.dtype == np.int64 and data.labels.tolist() == [0, 1, 2] and len(data.class_names) == 3


def test_npz_inferred_class_count_with_a_gap_names_the_missing_classes(tmp_path):
    path = npz_file(tmp_path / "gap.npz", [0, 1, 2, 3, 99])
    with pytest.raises(DataError, match=r"gap.npz: labels are 0\.\.3, 99, so class\(es\) 4\.\.98 have no sample"):
        load_npz(path, 8)
    assert len(load_npz(path, 8, num_classes=100)["train"].class_names) == 100  # declared: gaps are allowed


def test_npz_declared_class_names_give_the_class_count(tmp_path):
    part = LabelledImages(np.zeros((2, 8, 8, 3), np.uint8), np.array([0, 3]), ("a", "b", "c", "d"))
    write_npz(tmp_path / "part.npz", {"train": part})  # a hospital without classes 1 and 2
    assert load_npz(tmp_path / "part.npz", 8)["train"].class_names == ("a", "b", "c", "d")
    with pytest.raises(DataError, match=r"part.npz: declares 4 classes in class_names, but num-classes=5"):
        load_npz(tmp_path / "part.npz", 8, num_classes=5)
    npz_file(tmp_path / "over.npz", [0, 4], class_names=np.array(["a", "b", "c", "d"]))
    with pytest.raises(DataError, match=r"over.npz.*label 4 is outside the task's 4 classes"):
        load_npz(tmp_path / "over.npz", 8)


# --- image/mask folders -------------------------------------------------------------------------------------------

def polyp_folder(folder, masks):
    """images/<i>.png (tiny RGB) with masks/<i>.<ext> from ``masks``: a list of (array, ext, mode)."""
    (folder / "images").mkdir(parents=True)
    (folder / "masks").mkdir()
    for i, (pixels, ext, mode) in enumerate(masks):
        tiny_rgb(folder / "images" / f"{i}.png")
        Image.fromarray(pixels).convert(mode).save(folder / "masks" / f"{i}.{ext}")
    return folder


def disc(levels_of_grey=True):
    y, x = np.mgrid[:8, :8]
    distance = np.hypot(y - 3.5, x - 3.5)
    return np.clip(255 * (3.5 - distance), 0, 255).astype(np.uint8) if levels_of_grey else \
        np.where(distance < 3, 255, 0).astype(np.uint8)


def test_grey_masks_with_many_levels_are_thresholded_and_equal_channel_rgb_is_grey(tmp_path):
    folder = polyp_folder(tmp_path / "site", [(disc(), "jpg", "L"), (disc(False), "png", "RGB")])
    assert len(np.unique(np.asarray(Image.open(folder / "masks" / "0.jpg")))) > 2  # anti-aliased JPEG mask
    data = load_image_mask(folder, 8)
    assert set(np.unique(data.masks)) == {0, 1}
    assert data.masks[1].tolist() == (disc(False) > 127).astype(np.uint8).tolist()


def test_colour_mask_is_refused_naming_the_file(tmp_path):
    red = np.zeros((8, 8, 3), np.uint8)
    red[2:6, 2:6, 0] = 255
    folder = polyp_folder(tmp_path / "site", [(disc(), "png", "L"), (red, "png", "RGB")])
    with pytest.raises(DataError, match=r"masks/1.png: colour mask \(pixel x=2, y=2 is RGB \(255, 0, 0\)\)"):
        load_image_mask(folder, 8)


@pytest.mark.parametrize("sub", ["images", "masks"])
def test_two_files_with_one_stem_are_named(tmp_path, sub):
    folder = polyp_folder(tmp_path / "site", [(disc(), "png", "L"), (disc(), "png", "L")])
    tiny_rgb(folder / sub / "1.jpg")
    with pytest.raises(DataError, match=rf"{sub}/1.jpg and 1.png: two files with the name '1' in .*{sub}"):
        load_image_mask(folder, 8)


# --- BraTS --------------------------------------------------------------------------------------------------------

def brats_case(folder, seg):
    import nibabel as nib

    case = folder / "Case_1"
    case.mkdir()
    flair = np.zeros((6, 6, 6), np.float32)
    flair[1:5, 1:5, 1:5] = RNG.random((4, 4, 4)) + 1
    for kind, volume in (("flair", flair), ("seg", seg)):
        nib.save(nib.Nifti1Image(volume, np.eye(4)), case / f"Case_1_{kind}.nii.gz")
    return case


def seg_with(value, dtype=np.float32):
    seg = np.zeros((6, 6, 6), dtype)
    seg[2, 2, 2], seg[3, 3, 3], seg[2, 3, 2] = 1, 4, value
    return seg


def test_brats_labels_0_1_2_4_load_and_4_becomes_3(tmp_path):
    case = load_case(brats_case(tmp_path, seg_with(2, np.int16)), ("flair",))
    assert set(np.unique(case.label).tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("value, shown", [(1.5, r"\[1.5\]"), (7, r"\[7\]"), (3, r"\[3\]")])
def test_brats_seg_label_that_is_not_a_brats_label_names_the_file(tmp_path, value, shown):
    case = brats_case(tmp_path, seg_with(value))
    with pytest.raises(DataError, match=rf"Case_1_seg.nii.gz: label\(s\) {shown} outside the BraTS set \[0, 1, 2, 4\]"):
        load_case(case, ("flair",))


# --- fedmed partition ---------------------------------------------------------------------------------------------

def test_partition_into_a_folder_that_is_not_empty_is_refused(tmp_path, small_classification):
    from common.data.export import export_partitions

    out = tmp_path / "sites"
    out.mkdir()  # an empty folder is fine, as is a missing one
    export_partitions(small_classification, 3, out)
    export_partitions(small_classification, 2, tmp_path / "new" / "sites")
    with pytest.raises(DataError, match=r"sites: output folder exists and is not empty"):
        export_partitions(small_classification, 2, out)  # hospital-02 of the first export would stay
    assert sorted(p.name for p in out.iterdir()) == ["hospital-00", "hospital-01", "hospital-02", "manifest.json",
                                                     "test"]


# --- BraTS: modalities on different grids -------------------------------------------------------------------------

def aligned_case(folder, affines=None, shapes=None):
    """Case_1 with flair, t1 and seg on one 6x6x6 grid, unless ``affines`` / ``shapes`` give a file its own."""
    import nibabel as nib

    case = folder / "Case_1"
    case.mkdir(parents=True)
    affines, shapes = affines or {}, shapes or {}
    for kind in ("flair", "t1", "seg"):
        shape = shapes.get(kind, (6, 6, 6))
        volume = np.zeros(shape, np.float32)
        volume[1:5, 1:5, 1:5] = 1.0 if kind == "seg" else RNG.random((4, 4, 4)) + 1
        nib.save(nib.Nifti1Image(volume, affines.get(kind, np.eye(4))), case / f"Case_1_{kind}.nii.gz")
    return case


def test_brats_case_on_one_grid_loads_within_the_tolerance(tmp_path):
    nearly = np.eye(4)
    nearly[0, 3] = 1e-5  # header rounding
    case = load_case(aligned_case(tmp_path, {"t1": nearly}), ("flair", "t1"))
    assert case.image.shape[0] == 4 and case.present.tolist() == [True, False, True, False]


def scaled(x, y, z):
    return np.diag([x, y, z, 1.0])


def flipped():
    affine = np.eye(4)
    affine[0, 0], affine[0, 3] = -1.0, 5.0
    return affine


def shifted():
    affine = np.eye(4)
    affine[:3, 3] = (0.0, 2.0, 0.0)
    return affine


@pytest.mark.parametrize("kind, affine, shape, message", [
    ("t1", None, (6, 6, 5), r"Case_1_t1.nii.gz: differs from Case_1_flair.nii.gz: shape \(6, 6, 5\) against "
                            r"\(6, 6, 6\)"),
    ("t1", scaled(1, 1, 2), None, r"Case_1_t1.nii.gz: differs from Case_1_flair.nii.gz: voxel size 1x1x2 mm "
                                  r"against 1x1x1 mm"),
    ("t1", flipped(), None, r"Case_1_t1.nii.gz: differs from Case_1_flair.nii.gz: orientation LAS against RAS"),
    ("t1", shifted(), None, r"Case_1_t1.nii.gz: differs from Case_1_flair.nii.gz: affine .* by up to 2 \(origin "
                            r"0x2x0 mm against 0x0x0 mm\); the volumes are not voxel-aligned"),
    ("seg", shifted(), None, r"Case_1_seg.nii.gz: differs from Case_1_flair.nii.gz: affine"),
])
def test_brats_modalities_on_different_grids_are_refused_naming_the_file(tmp_path, kind, affine, shape, message):
    case = aligned_case(tmp_path, {kind: affine} if affine is not None else None, {kind: shape} if shape else None)
    with pytest.raises(DataError, match=message):
        load_case(case, ("flair", "t1"))


def test_brats_volume_too_large_in_its_header_is_refused_before_reading(tmp_path):
    import nibabel as nib

    case = aligned_case(tmp_path)
    header = nib.Nifti1Header()
    header.set_data_shape((2000, 2000, 2000))
    header.set_data_dtype(np.uint8)
    (case / "Case_1_t1.nii.gz").unlink()
    (case / "Case_1_t1.nii").write_bytes(header.binaryblock + b"\0" * 4)  # the header only: 8 GB it does not hold
    with pytest.raises(DataError, match=r"Case_1_t1.nii: \(2000, 2000, 2000\) is 8000 million voxels, over the limit"):
        load_case(case, ("flair", "t1"))


# --- images too large to decode -----------------------------------------------------------------------------------

def no_decoding(monkeypatch):
    """Make any decode of pixel data fail the test: sizes must be refused from the header alone."""
    from PIL import ImageFile

    load = ImageFile.ImageFile.load

    def refuse_large(self):
        if self.size[0] * self.size[1] > 10**6:
            raise AssertionError(f"{self.filename}: {self.size} pixels decoded")
        return load(self)
    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse_large)


def big_png(path, width=12000, height=12000):
    Image.new("1", (width, height)).save(path)  # 144 megapixels of one colour: a few kB of PNG
    return path


def test_a_144_megapixel_png_is_refused_before_decoding(tmp_path, monkeypatch):
    folder = polyp_folder(tmp_path / "site", [(disc(), "png", "L"), (disc(), "png", "L")])
    big_png(folder / "images" / "1.png")
    assert (folder / "images" / "1.png").stat().st_size < 100_000
    no_decoding(monkeypatch)
    with pytest.raises(DataError, match=r"images/1.png: refused as a decompression bomb .*over 50 megapixels"):
        load_image_mask(folder, 8)


def test_an_image_over_the_limit_but_under_pillows_is_refused_from_its_header(tmp_path, monkeypatch):
    folder = ham_folder(tmp_path, ["ISIC_1", "ISIC_2"])
    big_png(folder / "images" / "ISIC_2.jpg", 8000, 7000)  # 56 megapixels: Pillow would decode it silently
    no_decoding(monkeypatch)
    with pytest.raises(DataError, match=r"ISIC_2.jpg: 8000x7000 pixels \(56 megapixels\) is over the limit of 50 "
                                        r"megapixels for one image"):
        load_ham10000(folder, 8)


def test_pillows_decompression_bomb_error_names_the_file(tmp_path, monkeypatch):
    from common.data import image_files

    monkeypatch.setattr(image_files, "MAX_IMAGE_PIXELS", 10**12)  # only Pillow's own limit is left
    big_png(tmp_path / "huge.png", 14000, 14000)  # 196 megapixels: over twice Pillow's limit, an error there
    with pytest.raises(DataError, match=r"huge.png: refused as a decompression bomb \(Image size"):
        image_files.read_rgb(tmp_path / "huge.png", 8)


def test_npz_array_too_large_in_its_header_is_refused_before_reading(tmp_path):
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False,
                                                  "shape": (100_000, 1000, 1000)})
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w") as archive:  # 100 GB declared, nothing behind it
        archive.writestr("train_images.npy", header.getvalue())
        archive.writestr("train_labels.npy", b"")
    with pytest.raises(DataError, match=r"bomb.npz: array 'train_images' \(100000, 1000, 1000\) uint8 would take "
                                        r"93.1 GiB"):
        load_npz(tmp_path / "bomb.npz", 8)


# --- bad inputs, said clearly ---------------------------------------------------------------------------------------

def test_an_all_foreground_polyp_mask_is_refused_naming_it(tmp_path):
    full = np.full((8, 8), 255, np.uint8)
    folder = polyp_folder(tmp_path / "site", [(disc(), "png", "L"), (full, "jpg", "L")])
    with pytest.raises(DataError, match=r"masks/1.jpg: every pixel of the mask is foreground .* check whether it is "
                                        r"inverted or not the mask of 1.png"):
        load_image_mask(folder, 8)
    big = np.zeros((64, 64), np.uint8)
    big[:, 1:] = 255  # nearly all foreground: full once shrunk to 4x4, but not in the file; it loads
    Image.fromarray(big).save(folder / "masks" / "1.jpg")
    tiny_rgb(folder / "images" / "1.png", size=64)
    assert load_image_mask(folder, 4).masks[1].all()


def with_timeout(seconds=10):
    """Fail instead of hanging forever if a FIFO is opened."""
    import signal

    def expired(signum, frame):
        raise AssertionError("blocked reading a FIFO")
    signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)


def test_a_fifo_as_the_npz_file_is_refused_naming_it(tmp_path):
    import signal

    os.mkfifo(tmp_path / "data.npz")
    with_timeout()
    try:
        with pytest.raises(DataError, match=r"data.npz: is a FIFO \(named pipe\), not a regular file; give the npz "
                                            r"file itself"):
            load_npz(tmp_path / "data.npz", 8)
        with pytest.raises(DataError, match=r"data.npz: is a FIFO"):
            load_npz(tmp_path, 8)  # the folder's one .npz is the FIFO: np.load would wait for a writer forever
    finally:
        signal.alarm(0)


def test_a_fifo_among_the_images_is_refused_naming_it(tmp_path):
    import signal

    folder = polyp_folder(tmp_path / "site", [(disc(), "png", "L")])
    os.mkfifo(folder / "images" / "2.png")
    os.mkfifo(folder / "masks" / "2.png")
    with_timeout()
    try:
        with pytest.raises(DataError, match=r"images/2.png: is a FIFO \(named pipe\), not a regular file"):
            load_image_mask(folder, 8)
    finally:
        signal.alarm(0)


def test_ham10000_data_dir_that_is_the_metadata_file_names_its_folder(tmp_path):
    folder = ham_folder(tmp_path / "ham", ["ISIC_1"])
    with pytest.raises(DataError, match=rf"{METADATA_FILE}: is a file, not a folder; a HAM10000 data-dir is the "
                                        rf"folder that holds {METADATA_FILE} and images/: give its folder .*ham$"):
        load_ham10000(folder / METADATA_FILE, 8)
    with pytest.raises(DataError, match=r"0.png: is a file, not a folder; an image/mask data set is a folder"):
        load_image_mask(polyp_folder(tmp_path / "site", [(disc(), "png", "L")]) / "images" / "0.png", 8)
