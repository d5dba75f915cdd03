"""Groups (one lesion's images, one video's frames) stay whole in every split: the server's test set, a hospital's
validation split, the partitioners, ``fedmed partition``; and the loaders fill them (HAM10000's lesion_id, video
frames grouped into sequences, groups.csv, npz ``<split>_groups``).

The real-data tests read ../shared/data and skip without it; the others write tiny data sets of their own.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.data import sources
from common.data.containers import DataError, LabelledImages, SegmentationImages, concat
from common.data.ham10000 import HAM10000_CLASSES, METADATA_FILE, load_ham10000, read_metadata
from common.data.image_mask import GROUPS_FILE, frame_sequences, load_image_mask
from common.data.medmnist_npz import load_npz, write_npz
from common.data.partition import partition, stratified_holdout

from .conftest import shared_data


def grouped_labels(num_groups=300, seed=0, classes=5):
    """Labels and group ids: groups of 1 to 6 samples, each group one class (as a lesion has one diagnosis)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 7, size=num_groups)
    group_class = rng.integers(0, classes, size=num_groups)
    groups = np.repeat(np.array([f"g{i}" for i in range(num_groups)]), sizes)
    labels = np.repeat(group_class, sizes)
    order = rng.permutation(len(labels))  # a group's samples are scattered through the data set, as in HAM10000
    return labels[order], groups[order]


def assert_groups_apart(groups, *index_sets):
    seen: dict[str, int] = {}
    for side, index in enumerate(index_sets):
        for group in set(np.asarray(groups)[index].tolist()):
            assert seen.setdefault(group, side) == side, f"group {group} is on sides {seen[group]} and {side}"


# --- the splits ---------------------------------------------------------------------------------------------------

def test_holdout_keeps_groups_whole_stratified_and_seeded():
    labels, groups = grouped_labels()
    kept, held = stratified_holdout(labels, 0.2, seed=3, groups=groups)
    assert sorted(np.concatenate([kept, held]).tolist()) == list(range(len(labels)))
    assert_groups_apart(groups, kept, held)
    per_class = np.bincount(labels[held], minlength=5) / np.bincount(labels, minlength=5)
    assert np.all(np.abs(per_class - 0.2) < 0.05), per_class  # stratified as closely as whole groups allow
    again = stratified_holdout(labels, 0.2, seed=3, groups=groups)
    assert np.array_equal(again[1], held)
    assert not np.array_equal(stratified_holdout(labels, 0.2, seed=4, groups=groups)[1], held)


def test_holdout_never_takes_a_strata_last_group_and_takes_one_when_all_are_large():
    labels = np.zeros(30, dtype=np.int64)
    groups = np.repeat(["a", "b", "c"], 10)  # every group is over twice the 20% target (6 samples)
    kept, held = stratified_holdout(labels, 0.2, seed=0, groups=groups)
    assert len(held) == 10 and len(set(groups[held].tolist())) == 1 and len(kept) == 20
    kept, held = stratified_holdout(np.zeros(12, dtype=np.int64), 0.8, seed=0, groups=np.repeat(["a", "b"], 6))
    assert len(kept) == 6 and len(held) == 6  # not both groups, however large the fraction


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "by-source"])
def test_partitioners_deal_whole_groups(kind):
    labels, groups = grouped_labels(400, seed=1, classes=2)
    parts = partition(labels, 6, kind, alpha=0.5, min_size=5, seed=2, groups=groups)
    assert len(parts) == 6 and all(len(p) > 0 for p in parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))
    assert_groups_apart(groups, *parts)
    again = partition(labels, 6, kind, alpha=0.5, min_size=5, seed=2, groups=groups)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    if kind == "iid":
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 6  # equal up to one group
    if kind == "by-source":
        assert all(len(set(labels[p].tolist())) == 1 for p in parts)


def test_one_group_per_sample_is_the_sample_wise_split():
    """Data without groups (npz, generated) splits exactly as before groups existed: same seed, same indices."""
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 4, size=257)
    names = np.array([f"s{i}" for i in range(257)])
    for kind in ("iid", "dirichlet", "by-source"):
        plain = partition(labels, 5, kind, min_size=3, seed=7)
        grouped = partition(labels, 5, kind, min_size=3, seed=7, groups=names)
        assert all(np.array_equal(a, b) for a, b in zip(plain, grouped))
    kept, held = stratified_holdout(labels, 0.2, seed=1)
    assert np.array_equal(held, stratified_holdout(labels, 0.2, seed=1, groups=names)[1])
    # the sample-wise rule: per class, shuffled, the first round(20%) held out
    rng = np.random.default_rng(1)
    expected = []
    for value in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == value))
        expected += members[:max(1, round(0.2 * len(members)))].tolist()
    assert held.tolist() == sorted(expected)


def test_fewer_groups_than_hospitals_is_a_clear_error():
    with pytest.raises(DataError, match=r"3 groups \(30 samples\) cannot be split across 4 hospitals"):
        partition(np.zeros(30, dtype=np.int64), 4, "iid", groups=np.repeat(["a", "b", "c"], 10))


def test_containers_carry_groups_through_subset_and_concat():
    data = LabelledImages(np.zeros((4, 2, 2, 3), np.uint8), np.array([0, 1, 0, 1]), ("a", "b"),
                          np.array(["i0", "i1", "i2", "i3"]), np.array(["L1", "L1", "L2", "L3"]))
    assert data.subset(np.array([3, 1])).groups.tolist() == ["L3", "L1"]
    assert concat([data, data.subset(np.array([0]))]).groups.tolist() == ["L1", "L1", "L2", "L3", "L1"]
    assert LabelledImages(data.images, data.labels, ("a", "b"), data.names).groups.tolist() == data.names.tolist()
    seg = SegmentationImages(np.zeros((2, 2, 2, 3), np.uint8), np.zeros((2, 2, 2), np.uint8),
                             np.array(["1.jpg", "1.jpg"]), np.array(["site-a", "site-b"]))
    assert seg.groups.tolist() == ["site-a/1.jpg", "site-b/1.jpg"]  # one per pair, even for equal names
    with pytest.raises(DataError, match="one group per sample"):
        LabelledImages(data.images, data.labels, ("a", "b"), data.names, np.array(["x"]))


def test_a_hospitals_validation_split_keeps_groups_whole():
    labels, groups = grouped_labels(120, seed=2, classes=3)
    data = LabelledImages(np.zeros((len(labels), 2, 2, 3), np.uint8), labels, ("a", "b", "c"),
                          np.array([f"i{i}" for i in range(len(labels))]), groups)
    train, val = sources.train_val(data, 0.2, seed=9)
    assert len(val) > 0 and len(train) + len(val) == len(data)
    assert not set(train.groups.tolist()) & set(val.groups.tolist())


def test_npz_groups_are_written_and_read(tmp_path):
    data = LabelledImages(np.zeros((3, 8, 8, 3), np.uint8), np.array([0, 1, 1]), ("a", "b"),
                          np.array(["x", "y", "z"]), np.array(["p1", "p1", "p2"]))
    write_npz(tmp_path / "part.npz", {"train": data})
    assert load_npz(tmp_path / "part.npz", 8)["train"].groups.tolist() == ["p1", "p1", "p2"]
    ids = np.array(["a", "b"])  # the same ids in both splits: still one group per sample
    np.savez(tmp_path / "plain.npz", train_images=np.zeros((2, 8, 8), np.uint8), train_labels=np.array([[0], [1]]),
             train_ids=ids, test_images=np.zeros((2, 8, 8), np.uint8), test_labels=np.array([[0], [1]]), test_ids=ids)
    plain = load_npz(tmp_path / "plain.npz", 8)
    assert plain["train"].groups.tolist() == ["plain.npz:train[0]", "plain.npz:train[1]"]
    assert plain["test"].groups.tolist() == ["plain.npz:test[0]", "plain.npz:test[1]"]


def test_npz_whose_test_split_shares_a_declared_group_with_training_is_refused(tmp_path):
    def part(groups):
        return LabelledImages(np.zeros((2, 8, 8, 3), np.uint8), np.array([0, 1]), ("a", "b"), np.array(["x", "y"]),
                              np.array(groups))
    write_npz(tmp_path / "leaky.npz", {"train": part(["p1", "p2"]), "test": part(["p3", "p1"])})
    with pytest.raises(DataError, match=r"leaky.npz: the npz file's test split shares 1 group\(s\) with its "
                                        r"train/val splits \(e.g. 'p1'\)"):
        sources._split.__wrapped__("classification", "npz", str(tmp_path / "leaky.npz"), 8, 0, 0, 0.2, 0)


# --- HAM10000: lesion_id ------------------------------------------------------------------------------------------

def lesion_folder(folder: Path, lesions: int = 24, per_lesion: int = 3) -> Path:
    """A HAM10000 layout whose lesions have ``per_lesion`` images each (rows of a lesion not adjacent)."""
    (folder / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for k in range(per_lesion):
        for lesion in range(lesions):
            image_id = f"ISIC_{lesion:03d}_{k}"
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / "images" / f"{image_id}.jpg")
            rows.append([f"HAM_{lesion:03d}", image_id, ("nv", "mel", "bkl")[lesion % 3]])
    with (folder / METADATA_FILE).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["lesion_id", "image_id", "dx"])
        writer.writerows(rows)
    return folder


def test_ham10000_groups_are_the_lesion_ids(tmp_path):
    data = load_ham10000(lesion_folder(tmp_path / "ham", lesions=4, per_lesion=2), 8)
    assert data.groups.tolist()[:5] == ["HAM_000", "HAM_001", "HAM_002", "HAM_003", "HAM_000"]
    no_lesions = tmp_path / "plain"
    (no_lesions / "images").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(no_lesions / "images" / "ISIC_1.jpg")
    (no_lesions / METADATA_FILE).write_text("image_id,dx\nISIC_1,nv\n")
    assert load_ham10000(no_lesions, 8).groups.tolist() == ["ISIC_1"]  # no lesion_id column: one group per image


def test_simulation_and_fedmed_partition_keep_a_lesion_in_one_place(tmp_path, small_classification):
    from common.data.export import export_partitions

    folder = lesion_folder(tmp_path / "ham")
    cfg = small_classification.model_copy(update={"dataset": "ham10000", "data_dir": str(folder), "image_size": 8,
                                                  "min_partition_size": 2, "partitioner": "dirichlet"})
    split = sources.simulation_split(cfg)
    assert len(split.test) > 0 and not set(split.test.groups.tolist()) & set(split.pool.groups.tolist())
    parts = [sources.simulated_hospital(cfg, pid, 3) for pid in range(3)]
    assert_groups_apart(np.concatenate([p.groups for p in parts]),
                        *np.split(np.arange(sum(map(len, parts))), np.cumsum([len(p) for p in parts])[:-1]))

    manifest = export_partitions(cfg, 3, tmp_path / "sites")
    lesions = {}
    for site in manifest["sites"]:
        with (tmp_path / "sites" / site / METADATA_FILE).open() as handle:
            lesions[site] = {row["lesion_id"] for row in csv.DictReader(handle)}
        assert manifest["sites"][site]["groups"] == len(lesions[site])
        assert load_ham10000(tmp_path / "sites" / site, 8).groups.tolist()[0] in lesions[site]
    sites = list(lesions)
    assert all(not lesions[a] & lesions[b] for a in sites for b in sites if a < b)
    assert set().union(*lesions.values()) == {f"HAM_{i:03d}" for i in range(24)}


def test_real_ham10000_test_set_shares_no_lesion_with_the_hospitals(monkeypatch):
    """The default split (test-fraction 0.2, seed 42) of the real HAM10000: by image, 755 of 2003 test images had
    another image of their lesion among the hospitals'; by lesion, none. Images are not decoded (only the split is
    measured): the loader's decode step returns blank arrays here, outside the cache."""
    from common.config import JobConfig
    from common.data import ham10000

    folder = shared_data("ham10000")
    size = 8
    monkeypatch.setattr(ham10000, "cached_arrays",
                        lambda files, tag, build: {"images": np.zeros((len(files) - 1, size, size, 3), np.uint8)})
    fields = JobConfig.model_fields
    seed, fraction = fields["seed"].default, fields["test_fraction"].default
    assert (seed, fraction) == (42, 0.2)
    split = sources._split.__wrapped__("classification", "ham10000", str(folder), size, 0, seed, fraction, 0)

    rows = read_metadata(folder)
    labels = np.array([HAM10000_CLASSES.index(dx) for _, dx, _ in rows])
    lesions = np.array([lesion for _, _, lesion in rows])
    kept, held = stratified_holdout(labels, fraction, seed)  # the old rule: image by image
    before = int(np.isin(lesions[held], lesions[kept]).sum())
    after = int(np.isin(split.test.groups, split.pool.groups).sum())
    print(f"\nHAM10000 test images sharing a lesion_id with the pool: by image {before} of {len(held)}, "
          f"by lesion {after} of {len(split.test)}")
    assert before > 500 and after == 0
    assert len(split.test) + len(split.pool) == len(rows) == 10015
    per_class = split.test.class_counts() / (split.test.class_counts() + split.pool.class_counts())
    assert np.all(np.abs(per_class - fraction) < 0.015), per_class  # still stratified by diagnosis
    train, val = sources.train_val(split.pool.subset(np.arange(2000)), 0.1, seed=1)
    assert len(val) > 0 and not set(train.groups.tolist()) & set(val.groups.tolist())


# --- video frames -------------------------------------------------------------------------------------------------

def frame_folder(folder: Path, videos: list[tuple[list[int], tuple[int, int, int]]], flash: int | None = None):
    """images/<id>.png and masks/<id>.png: each video a colour with a drifting texture; ``flash`` one white frame."""
    (folder / "images").mkdir(parents=True)
    (folder / "masks").mkdir()
    rng = np.random.default_rng(0)
    for ids, colour in videos:
        base = np.clip(np.array(colour) + rng.integers(-20, 20, (32, 32, 3)), 0, 255)
        for step, frame_id in enumerate(ids):
            pixels = np.roll(base, step, axis=1).astype(np.uint8)
            if frame_id == flash:
                pixels = np.full((32, 32, 3), 250, np.uint8)
            Image.fromarray(pixels).save(folder / "images" / f"{frame_id}.png")
            mask = np.zeros((32, 32), np.uint8)
            mask[8:16, 8:16] = 255
            Image.fromarray(mask).save(folder / "masks" / f"{frame_id}.png")
    return folder


def test_numbered_frames_are_grouped_into_their_videos(tmp_path):
    videos = [(list(range(1, 9)), (200, 80, 60)), (list(range(9, 17)), (60, 60, 60)),
              ([17, 18, 20, 21, 22], (60, 60, 60)),  # same look, but a gap of 2 ids is still one video
              (list(range(40, 46)), (60, 60, 60))]  # ids 22 -> 40: a gap is always a cut
    folder = frame_folder(tmp_path / "clinic", videos, flash=5)
    data = load_image_mask(folder, 16)
    by_group: dict[str, list[int]] = {}
    for name, group in zip(data.names, data.groups):
        by_group.setdefault(str(group), []).append(int(Path(name).stem))
    assert sorted(sorted(v) for v in by_group.values()) == [
        list(range(1, 9)), list(range(9, 19)) + [20, 21, 22], list(range(40, 46))]
    assert "clinic/frames-1-8" in by_group  # the flash at frame 5 stays in its video


def test_frame_sequences_merge_a_short_run_into_the_closer_neighbour():
    # ten frames: 0-3 look alike, 4 unlike anything (a flash), 5-9 alike; the flash joins one side, not a group
    small = np.zeros((10, 16, 16, 3), np.float32)
    small[5:] = 120.0
    small[4] = 255.0
    hist = np.zeros((10, 3, 16), np.float32)
    hist[:, :, 0] = 1.0
    hist[5:, :, 0], hist[5:, :, 7] = 0.0, 1.0
    hist[4, :, 0], hist[4, :, 15] = 0.0, 1.0
    assert frame_sequences(list(range(1, 11)), {"small": small, "hist": hist}) == [
        [0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]


def test_groups_file_sets_the_groups_and_is_checked(tmp_path):
    folder = frame_folder(tmp_path / "site", [([1, 2, 3, 4], (100, 100, 100))])
    (folder / GROUPS_FILE).write_text("image,group\n1.png,a\n2.png,a\n3.png,b\n4.png,b\n")
    assert load_image_mask(folder, 16).groups.tolist() == ["site/a", "site/a", "site/b", "site/b"]
    (folder / GROUPS_FILE).write_text("image,group\n1.png,a\n2.png,a\n9.png,b\n")
    with pytest.raises(DataError, match=r"groups.csv, line 4: '9.png' is not an image of"):
        load_image_mask(folder, 16)
    (folder / GROUPS_FILE).write_text("image,group\n1.png,a\n")
    with pytest.raises(DataError, match=r"groups.csv: 3 image\(s\) have no group, e.g. '2.png'"):
        load_image_mask(folder, 16)


def test_real_cvc_clinicdb_sequences_and_kvasir_images_stay_whole_in_every_split(tmp_path, small_classification):
    """The polyp collection (Kvasir-SEG + CVC-ClinicDB) as the simulation splits it: no CVC video sequence (nor
    Kvasir image) is on two sides of the test split, the partition into hospitals, or a hospital's validation
    split; ``fedmed partition`` writes the same groups beside the copied frames."""
    from common.data.export import export_partitions

    folder = shared_data("polyp")
    data = load_image_mask(folder, 16)
    cvc = data.sources == "cvc_clinicdb_256"
    cvc_groups = np.unique(data.groups[cvc])
    print(f"\nCVC-ClinicDB: {cvc.sum()} frames in {len(cvc_groups)} sequences")
    assert 18 <= len(cvc_groups) <= 35
    for group in cvc_groups:  # every group is a run of consecutive frame ids
        ids = sorted(int(Path(name).stem) for name in data.names[data.groups == group])
        assert group == f"cvc_clinicdb_256/frames-{ids[0]}-{ids[-1]}" and ids[-1] - ids[0] <= len(ids)
    assert len(np.unique(data.groups[~cvc])) == (~cvc).sum() == 998  # Kvasir-SEG: one group per image

    split = sources._split.__wrapped__("polyp-segmentation", "image-mask", str(folder), 16, 0, 42, 0.2, 0)
    test_cvc = split.test.groups[split.test.sources == "cvc_clinicdb_256"]
    assert len(test_cvc) > 0 and not set(test_cvc.tolist()) & set(split.pool.groups.tolist())
    assert 0.12 < len(test_cvc) / cvc.sum() < 0.28  # close to test-fraction, in whole sequences
    parts = partition(split.pool.strata, 5, "by-source", seed=42, groups=split.pool.groups)
    assert_groups_apart(split.pool.groups, *parts)
    hospital = split.pool.subset(max(parts, key=lambda p: split.pool.sources[p[0]] == "cvc_clinicdb_256"))
    assert set(hospital.sources.tolist()) == {"cvc_clinicdb_256"}
    train, val = sources.train_val(hospital, 0.1, seed=0)
    assert len(val) > 0 and not set(train.groups.tolist()) & set(val.groups.tolist())

    cfg = small_classification.model_copy(update={"task": "polyp-segmentation", "dataset": "image-mask",
                                                  "data_dir": str(folder), "image_size": 16,
                                                  "partitioner": "by-source", "strategy": "fedavg"})
    export_partitions(cfg, 3, tmp_path / "sites")
    site = tmp_path / "sites" / "test" / "cvc_clinicdb_256"
    reread = load_image_mask(site, 16)
    exported = sources.simulation_split(cfg).test
    expected = dict(zip(exported.names[exported.sources == "cvc_clinicdb_256"],
                        exported.groups[exported.sources == "cvc_clinicdb_256"]))
    assert (site / GROUPS_FILE).is_file() and dict(zip(reread.names, reread.groups)) == expected
