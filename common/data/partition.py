"""Seeded splits of one data set into hospitals (IID, Dirichlet non-IID, by source) and held-out parts.

All functions take the stratum of every sample (class for classification, source for
segmentation) and return index arrays, so they work for any container.

Every split keeps *groups* whole (``groups``: one label per sample; the images of one lesion, the frames of one
video): the unit that is shuffled and dealt is the group, so no group has samples on two sides. A group is
stratified by its most common stratum (the smallest on a tie); in the data sets we read a group never mixes
strata (a lesion has one diagnosis, a video one source). Sizes and class mixes follow the targets as closely as
whole groups allow. Without ``groups`` (or with one group per sample) every split is the sample-wise split it
always was: the same seed gives the same indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .containers import DataError


@dataclass(frozen=True)
class _Groups:
    """The groups of a data set, numbered in order of their first sample."""

    members: list[np.ndarray]  # each group's sample indices, ascending
    sizes: np.ndarray  # (G,) samples per group
    strata: np.ndarray  # (G,) each group's stratum (its most common one)

    def indices(self, chosen) -> np.ndarray:
        chosen = list(chosen)
        if not chosen:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate([self.members[g] for g in chosen])).astype(np.int64)


def _groups(strata: np.ndarray, groups: np.ndarray | None) -> _Groups:
    strata = np.asarray(strata)
    n = len(strata)
    if groups is None:
        return _Groups([np.array([i], dtype=np.int64) for i in range(n)], np.ones(n, dtype=np.int64), strata)
    groups = np.asarray(groups)
    if len(groups) != n:
        raise DataError(f"{len(groups)} group labels for {n} samples")
    if n == 0:
        return _Groups([], np.zeros(0, dtype=np.int64), strata)
    _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))  # number groups by their first sample
    codes = rank[inverse.reshape(-1)]
    sizes = np.bincount(codes, minlength=len(first))
    members = np.split(np.argsort(codes, kind="stable").astype(np.int64), np.cumsum(sizes)[:-1])
    values, strata_codes = np.unique(strata, return_inverse=True)
    counts = np.bincount(codes * len(values) + strata_codes.reshape(-1), minlength=len(first) * len(values))
    return _Groups(members, sizes, values[counts.reshape(len(first), len(values)).argmax(axis=1)])


def stratified_holdout(strata: np.ndarray, fraction: float, seed: int,
                       groups: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held_out) indices, holding out ``fraction`` of every stratum (at least one group of a stratum that has
    two or more, never its last), whole groups only.

    Per stratum the groups are shuffled; a group is held out when that brings the held-out count at least as close
    to ``fraction`` of the stratum's samples as leaving it (smaller groups later in the order may still fit).
    """
    units = _groups(strata, groups)
    rng = np.random.default_rng(seed)
    held: list[int] = []
    for value in np.unique(units.strata):
        candidates = rng.permutation(np.flatnonzero(units.strata == value))
        if len(candidates) < 2:
            continue
        target = max(1, int(round(fraction * int(units.sizes[candidates].sum()))))
        taken: list[int] = []
        count = 0
        for group in candidates:
            if count >= target or len(taken) == len(candidates) - 1:
                break
            size = int(units.sizes[group])
            if count + size - target <= target - count:
                taken.append(int(group))
                count += size
        if not taken:  # every group is larger than twice the target: hold out the smallest (the first of those)
            taken.append(int(candidates[np.argmin(units.sizes[candidates])]))
        held.extend(taken)
    held_out = units.indices(held)
    kept = np.setdiff1d(np.arange(len(strata)), held_out)
    return kept, held_out


def _deal(sizes: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Which part each of a row of groups (in dealing order) joins: the part whose stretch of the sample order
    [cuts[j-1], cuts[j]) holds the group's middle. One sample per group is exactly ``np.split`` at ``cuts``."""
    ends = np.cumsum(sizes)
    middles = ends - sizes / 2
    return np.searchsorted(cuts, middles, side="right")


def iid_partition(num_samples: int, num_partitions: int, seed: int,
                  groups: np.ndarray | None = None) -> list[np.ndarray]:
    """Shuffled groups dealt into ``num_partitions`` parts of (as nearly as whole groups allow) equal size."""
    units = _groups(np.zeros(num_samples, dtype=np.int64), groups)
    count = len(units.sizes)
    if count < num_partitions:
        what = "samples" if count == num_samples else f"groups ({num_samples} samples)"
        raise DataError(f"{count} {what} cannot be split across {num_partitions} hospitals")
    order = np.random.default_rng(seed).permutation(count)
    sizes = units.sizes[order]
    cuts = np.cumsum([len(part) for part in np.array_split(np.arange(num_samples), num_partitions)])[:-1]
    owner = _deal(sizes, cuts)
    if len(np.unique(owner)) < num_partitions:  # large groups: fill the smallest part first instead
        owner = np.zeros(count, dtype=np.int64)
        load = np.zeros(num_partitions, dtype=np.int64)
        for position in np.argsort(-sizes, kind="stable"):
            owner[position] = int(np.argmin(load))
            load[owner[position]] += sizes[position]
    return [units.indices(order[owner == j]) for j in range(num_partitions)]


def dirichlet_partition(strata: np.ndarray, num_partitions: int, alpha: float, min_size: int, seed: int,
                        max_tries: int = 1000, groups: np.ndarray | None = None) -> list[np.ndarray]:
    """Non-IID split: per stratum, Dirichlet(alpha) proportions across hospitals, dealt in whole groups.

    As in the FedProIn/NIID-Bench protocol, a hospital that already holds N/K samples gets no more
    of later strata, and the draw repeats until every hospital holds at least ``min_size``.
    """
    n = len(strata)
    if n < num_partitions * min_size:
        raise DataError(f"{n} samples cannot give {num_partitions} hospitals {min_size} each")
    units = _groups(strata, groups)
    rng = np.random.default_rng(seed)
    classes = np.unique(units.strata)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        held = np.zeros(num_partitions, dtype=np.int64)
        for value in classes:
            members = rng.permutation(np.flatnonzero(units.strata == value))
            proportions = rng.dirichlet(np.full(num_partitions, alpha))
            proportions = proportions * (held < n / num_partitions)
            if proportions.sum() == 0:
                proportions = np.full(num_partitions, 1.0)
            proportions = proportions / proportions.sum()
            sizes = units.sizes[members]
            cuts = (np.cumsum(proportions) * int(sizes.sum())).astype(int)[:-1]
            for group, owner in zip(members, _deal(sizes, cuts)):
                parts[owner].append(int(group))
                held[owner] += units.sizes[group]
        if held.min() >= min_size:
            return [units.indices(p) for p in parts]
    raise DataError(
        f"Dirichlet(alpha={alpha}) could not give each of {num_partitions} hospitals {min_size} samples "
        f"in {max_tries} draws; raise dirichlet-alpha or lower min-partition-size"
    )


def source_partition(strata: np.ndarray, num_partitions: int, seed: int,
                     groups: np.ndarray | None = None) -> list[np.ndarray]:
    """Natural sites: every hospital's samples come from one source; large sources feed several hospitals.

    Sources get hospitals in proportion to their size (at least one each), then each source's
    samples are split IID (in whole groups) among its hospitals.
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
        inner = None if groups is None else np.asarray(groups)[members]
        try:
            chunks = iid_partition(len(members), int(share), seed + index, groups=inner)
        except DataError as error:
            raise DataError(f"source {value}: {error}") from None
        for chunk in chunks:
            parts.append(members[chunk])
    return parts


def partition(strata: np.ndarray, num_partitions: int, kind: str, *, alpha: float = 0.5, min_size: int = 1,
              seed: int = 0, groups: np.ndarray | None = None) -> list[np.ndarray]:
    if kind == "iid":
        return iid_partition(len(strata), num_partitions, seed, groups=groups)
    if kind == "dirichlet":
        return dirichlet_partition(strata, num_partitions, alpha, min_size, seed, groups=groups)
    if kind == "by-source":
        return source_partition(strata, num_partitions, seed, groups=groups)
    raise DataError(f"partitioner: unknown kind {kind!r}")
