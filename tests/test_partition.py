"""Partitioners: sizes, determinism, non-IID-ness, natural sites, and the hospitals' data in a job."""

from __future__ import annotations

import numpy as np
import pytest

from common.data.containers import DataError
from common.data.partition import dirichlet_partition, iid_partition, source_partition, stratified_holdout


def labels(n=1000, classes=5, seed=0):
    return np.random.default_rng(seed).integers(0, classes, size=n)


def test_iid_partition_covers_everything_once():
    parts = iid_partition(103, 4, seed=1)
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(103))
    assert {len(p) for p in parts} <= {25, 26}


def test_dirichlet_partition_is_seeded_disjoint_and_respects_the_minimum():
    y = labels()
    first = dirichlet_partition(y, 10, alpha=0.5, min_size=10, seed=3)
    again = dirichlet_partition(y, 10, alpha=0.5, min_size=10, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    joined = np.concatenate(first)
    assert len(joined) == len(set(joined.tolist())) == len(y)
    assert min(len(p) for p in first) >= 10


def test_small_alpha_skews_class_mixes_more_than_iid():
    y = labels(2000, 5)

    def mean_skew(parts):  # mean total-variation distance of hospital class mix from the global mix
        overall = np.bincount(y, minlength=5) / len(y)
        return np.mean([0.5 * np.abs(np.bincount(y[p], minlength=5) / len(p) - overall).sum() for p in parts])

    assert mean_skew(dirichlet_partition(y, 8, 0.1, 10, seed=0)) > 3 * mean_skew(iid_partition(len(y), 8, seed=0))


def test_dirichlet_impossible_minimum_is_a_clear_error():
    with pytest.raises(DataError, match="cannot give 10 hospitals 50 each"):
        dirichlet_partition(labels(100), 10, 0.5, 50, seed=0)


def test_source_partition_gives_each_hospital_one_source_in_proportion():
    strata = np.array([0] * 998 + [1] * 399)
    parts = source_partition(strata, 5, seed=0)
    assert len(parts) == 5
    assert all(len(set(strata[p].tolist())) == 1 for p in parts)
    assert sorted(int(strata[p][0]) for p in parts) == [0, 0, 0, 0, 1]


def test_holdout_keeps_every_stratum_on_both_sides():
    y = labels(500, 4)
    kept, held = stratified_holdout(y, 0.2, seed=0)
    assert len(np.intersect1d(kept, held)) == 0 and len(kept) + len(held) == 500
    assert set(y[held].tolist()) == set(y[kept].tolist()) == {0, 1, 2, 3}
    assert 90 <= len(held) <= 110


def test_simulated_hospitals_split_the_pool_without_overlap(small_classification):
    from common.data.sources import simulated_hospital, simulation_split

    cfg = small_classification.model_copy(update={"partitioner": "dirichlet", "dirichlet_alpha": 0.3})
    parts = [simulated_hospital(cfg, pid, 3) for pid in range(3)]
    names = np.concatenate([p.names for p in parts])
    assert len(names) == len(set(names.tolist())) == len(simulation_split(cfg).pool)
    test_names = set(simulation_split(cfg).test.names.tolist())
    assert test_names.isdisjoint(names.tolist())  # generated test data has a seed of its own
    mixes = [np.bincount(p.labels, minlength=4) / len(p) for p in parts]
    assert max(np.abs(mixes[0] - mixes[1]).max(), np.abs(mixes[1] - mixes[2]).max()) > 0.1  # non-IID


def test_partitions_are_computed_once_per_pool_and_split_settings(small_classification):
    from common.data.sources import partition_indices, simulation_split

    cfg = small_classification
    pool = simulation_split(cfg).pool
    first = partition_indices(cfg, pool, 10)
    assert partition_indices(cfg, pool, 10) is first  # every virtual hospital's message reuses it
    other_pool = pool.subset(np.arange(len(pool) - 20))
    assert partition_indices(cfg, other_pool, 10) is not first
    assert sum(map(len, partition_indices(cfg, other_pool, 10))) == len(pool) - 20
    redrawn = partition_indices(cfg.model_copy(update={"seed": cfg.seed + 1}), pool, 10)
    assert redrawn is not first and any(not np.array_equal(a, b) for a, b in zip(redrawn, first))
