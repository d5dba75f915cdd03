"""Loaders on the real files in ../shared/data (copied in part to temporary folders) and their errors."""

from __future__ import annotations

import csv
import shutil

import numpy as np
import pytest

from common.data.brats import MODALITIES, load_case, parse_modalities
from common.data.containers import DataError
from common.data.ham10000 import HAM10000_CLASSES, load_ham10000
from common.data.image_mask import load_image_mask
from common.data.medmnist_npz import load_npz

from .conftest import shared_data


def small_ham(tmp_path, rows: int = 12):
    source = shared_data("ham10000")
    with (source / "HAM10000_metadata.csv").open() as handle:
        reader = csv.DictReader(handle)
        chosen = [row for _, row in zip(range(rows), reader)]
    (tmp_path / "images").mkdir()
    with (tmp_path / "HAM10000_metadata.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(chosen[0]))
        writer.writeheader()
        writer.writerows(chosen)
    for row in chosen:
        shutil.copy(source / "images" / f"{row['image_id']}.jpg", tmp_path / "images")
    return tmp_path, chosen


def test_ham10000_layout_loads_images_and_labels(tmp_path):
    folder, rows = small_ham(tmp_path)
    data = load_ham10000(folder, image_size=24)
    assert data.images.shape == (len(rows), 24, 24, 3) and data.images.dtype == np.uint8
    assert [HAM10000_CLASSES[i] for i in data.labels] == [row["dx"] for row in rows]
    assert list(data.names) == [row["image_id"] for row in rows]
    assert data.images.std() > 10  # real photographs, not blank arrays


def test_ham10000_label_outside_the_class_set_names_the_file_and_line(tmp_path):
    folder, rows = small_ham(tmp_path, rows=3)
    text = (folder / "HAM10000_metadata.csv").read_text().replace(f",{rows[1]['dx']},", ",melanoma?,", 1)
    (folder / "HAM10000_metadata.csv").write_text(text)
    with pytest.raises(DataError, match=r"HAM10000_metadata.csv, line \d.*melanoma\?"):
        load_ham10000(folder, 16)


def test_ham10000_unreadable_image_is_named(tmp_path):
    folder, rows = small_ham(tmp_path, rows=3)
    (folder / "images" / f"{rows[2]['image_id']}.jpg").write_bytes(b"\xff\xd8 truncated jpeg")
    with pytest.raises(DataError, match=f"{rows[2]['image_id']}.jpg: cannot read image"):
        load_ham10000(folder, 16)


def test_ham10000_missing_image_is_named(tmp_path):
    folder, rows = small_ham(tmp_path, rows=3)
    (folder / "images" / f"{rows[0]['image_id']}.jpg").unlink()
    with pytest.raises(DataError, match=f"{rows[0]['image_id']}.jpg: image listed"):
        load_ham10000(folder, 16)


def test_blood_cell_npz_has_its_three_splits():
    splits = load_npz(shared_data("blood", "pbc_blood_28.npz"), image_size=28)
    assert set(splits) == {"train", "val", "test"}
    assert len(splits["train"]) == 11965 and len(splits["test"]) == 3417
    assert splits["train"].class_names[0] == "basophil" and len(splits["train"].class_names) == 8
    assert splits["test"].images.shape[1:] == (28, 28, 3)


def test_npz_label_outside_the_task_is_named(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, train_images=np.zeros((3, 8, 8, 3), np.uint8), train_labels=np.array([[0], [1], [9]]))
    with pytest.raises(DataError, match=r"bad.npz.*label 9 is outside"):
        load_npz(path, image_size=8, num_classes=3)


def polyp_subset(tmp_path, count: int = 4):
    source = shared_data("polyp", "kvasir_seg_256")
    names = sorted(p.name for p in (source / "images").iterdir())[:count]
    for sub in ("images", "masks"):
        (tmp_path / "kvasir" / sub).mkdir(parents=True)
        for name in names:
            shutil.copy(source / sub / name, tmp_path / "kvasir" / sub / name)
    return tmp_path / "kvasir", names


def test_image_mask_pairs_are_matched_and_thresholded(tmp_path):
    folder, names = polyp_subset(tmp_path)
    data = load_image_mask(folder, image_size=32)
    assert data.images.shape == (len(names), 32, 32, 3) and data.masks.shape == (len(names), 32, 32)
    assert set(np.unique(data.masks)) <= {0, 1} and data.masks.mean() > 0.01
    assert list(data.names) == names and set(data.sources) == {"kvasir"}


def test_image_mask_collection_of_two_real_sites():
    data = load_image_mask(shared_data("polyp"), image_size=16)
    assert set(data.sources) == {"kvasir_seg_256", "cvc_clinicdb_256"}
    assert len(data) == 998 + 399


def test_image_without_mask_is_named(tmp_path):
    folder, names = polyp_subset(tmp_path)
    (folder / "masks" / names[1]).unlink()
    with pytest.raises(DataError, match=f"{names[1]}: no mask with the same name"):
        load_image_mask(folder, 16)


def test_mask_of_another_size_is_named(tmp_path):
    from PIL import Image

    folder, names = polyp_subset(tmp_path)
    Image.new("L", (100, 80)).save(folder / "masks" / names[0], format="JPEG")
    with pytest.raises(DataError, match=f"{names[0]}: size .* does not match"):
        load_image_mask(folder, 16)


def test_brats_case_is_normalised_cropped_and_relabelled():
    case_dir = shared_data("brats", "Brats18_2013_3_1")
    case = load_case(case_dir, ("flair", "t2"), downsample=2)
    assert case.image.shape[0] == len(MODALITIES) and case.image.dtype == np.float32
    assert case.present.tolist() == [True, False, False, True]
    assert not case.image[1].any() and not case.image[2].any()  # absent modalities are zero
    brain = case.image[0] != 0
    assert abs(float(case.image[0][brain].mean())) < 0.2  # z-scored inside the brain
    assert case.label.shape == case.image.shape[1:]
    assert set(np.unique(case.label)) <= {0, 1, 2, 3} and 3 in np.unique(case.label)
    assert max(case.image.shape[1:]) < 240 // 2  # cropped to the brain, then halved


def test_brats_missing_modality_and_corrupt_volume_are_named(tmp_path):
    source = shared_data("brats", "Brats18_2013_3_1")
    case = tmp_path / source.name
    case.mkdir()
    for kind in ("flair", "seg"):
        shutil.copy(source / f"{source.name}_{kind}.nii.gz", case)
    with pytest.raises(DataError, match="Brats18_2013_3_1_t1ce.nii.gz: missing t1ce volume"):
        load_case(case, ("flair", "t1ce"))
    (case / f"{source.name}_flair.nii.gz").write_bytes(b"\x1f\x8b\x08 not really gzip")
    with pytest.raises(DataError, match="Brats18_2013_3_1_flair.nii.gz: cannot read NIfTI"):
        load_case(case, ("flair",))


def test_modalities_are_parsed_and_checked():
    assert parse_modalities("T2, flair") == ("flair", "t2")
    assert parse_modalities("t1c") == ("t1ce",)
    with pytest.raises(DataError, match="modalities"):
        parse_modalities("flair,pet")
