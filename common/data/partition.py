"""Seeded splits of one data set into hospitals (IID, Dirichlet non-IID, by source) and held-out parts.

All functions take the stratum of every sample (class for classification, source for
segmentation) and return index arrays, so they work for any container.
"""

from __future__ import annotations

import numpy as np

from .containers import DataError


def stratified_holdout(strata: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held_out) indices, holding out ``fraction`` of every stratum (at least one per stratum)."""
    rng = np.random.default_rng(seed)
    held = []
    for value in np.unique(strata):
        members = rng.permutation(np.flatnonzero(strata == value))
        take = max(1, int(round(fraction * len(members)))) if len(members) > 1 else 0
        held.extend(members[:take].tolist())
    held_out = np.sort(np.array(held, dtype=np.int64))
    kept = np.setdiff1d(np.arange(len(strata)), held_out)
    return kept, held_out


def iid_partition(num_samples: int, num_partitions: int, seed: int) -> list[np.ndarray]:
    if num_samples < num_partitions:
        raise DataError(f"{num_samples} samples cannot be split across {num_partitions} hospitals")
    order = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(part) for part in np.array_split(order, num_partitions)]


def dirichlet_partition(strata: np.ndarray, num_partitions: int, alpha: float, min_size: int, seed: int,
                        max_tries: int = 1000) -> list[np.ndarray]:
    """Non-IID split: per stratum, Dirichlet(alpha) proportions across hospitals.

    As in the FedProIn/NIID-Bench protocol, a hospital that already holds N/K samples gets no more
    of later strata, and the draw repeats until every hospital holds at least ``min_size``.
    """
    n = len(strata)
    if n < num_partitions * min_size:
        raise DataError(f"{n} samples cannot give {num_partitions} hospitals {min_size} each")
    rng = np.random.default_rng(seed)
    classes = np.unique(strata)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for value in classes:
            members = rng.permutation(np.flatnonzero(strata == value))
            proportions = rng.dirichlet(np.full(num_partitions, alpha))
            proportions = proportions * np.array([len(p) < n / num_partitions for p in parts])
            if proportions.sum() == 0:
                proportions = np.full(num_partitions, 1.0)
            proportions = proportions / proportions.sum()
            cuts = (np.cumsum(proportions) * len(members)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(members, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise DataError(
        f"Dirichlet(alpha={alpha}) could not give each of {num_partitions} hospitals {min_size} samples "
        f"in {max_tries} draws; raise dirichlet-alpha or lower min-partition-size"
    )


def source_partition(strata: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Natural sites: every hospital's samples come from one source; large sources feed several hospitals.

    Sources get hospitals in proportion to their size (at least one each), then each source's
    samples are split IID among its hospitals.
    """
    sources, counts = np.unique(strata, return_counts=True)
    if num_partitions < len(sources):
        raise DataError(f"{len(sources)} sources need at least {len(sources)} hospitals, got {num_partitions}")
    quotas = num_partitions * counts / counts.sum()
    shares = np.maximum(1, np.floor(quotas).astype(int))
    while shares.sum() < num_partitions:  # largest remainder first
        shares[np.argmax(quotas - shares)] += 1
    while shares.sum() > num_partitions:
        candidates = np.flatnonzero(shares > 1)
        shares[candidates[np.argmin(counts[candidates] / shares[candidates])]] -= 1
    parts = []
    for index, (value, share) in enumerate(zip(sources, shares)):
        members = np.flatnonzero(strata == value)
        for chunk in iid_partition(len(members), int(share), seed + index):
            parts.append(members[chunk])
    return parts


def partition(strata: np.ndarray, num_partitions: int, kind: str, *, alpha: float = 0.5, min_size: int = 1,
              seed: int = 0) -> list[np.ndarray]:
    if kind == "iid":
        return iid_partition(len(strata), num_partitions, seed)
    if kind == "dirichlet":
        return dirichlet_partition(strata, num_partitions, alpha, min_size, seed)
    if kind == "by-source":
        return source_partition(strata, num_partitions, seed)
    raise DataError(f"partitioner: unknown kind {kind!r}")
