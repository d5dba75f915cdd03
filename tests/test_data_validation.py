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
