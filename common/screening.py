"""Screening hospital replies before they are aggregated: what one hostile or broken hospital could
otherwise do to everyone's model.

Shape and NaN checks (``ServerMethod.check``) only say that a reply *fits* the model. These rules say
that it is *plausible*: a sample count no larger than the hospital declared when it joined, metrics that
are numbers, BatchNorm variances that are positive, and an update whose distance from the model the
hospital received is not far outside the round's other updates. Each returns the reason to refuse
(``None``: fine), which the round engine logs and records in the round's ``refused``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from common.payload import NamedArrays


def sample_count_problem(reported: Any, declared: int, key: str = "num-examples") -> str | None:
    """A reply's sample count (``key``) must be a positive finite number no larger than the count the hospital
    declared when it joined (it weighs the hospital's update in every average)."""
    if isinstance(reported, bool) or not isinstance(reported, (int, float, np.integer, np.floating)):
        return f"{key}={reported!r} is not a number"
    if not math.isfinite(reported) or reported <= 0:
        return f"{key}={reported!r} is not a positive finite number"
    if reported > declared:
        return f"{key}={reported!r} is more than the {declared} training samples it declared when it joined"
    return None


def metrics_problem(metrics: Mapping[str, Any]) -> str | None:
    """Every metric is a number or a flat list of numbers (what Flower's MetricRecord carries)."""
    for key, value in metrics.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
            return f"metric {key!r}={value!r} is not a number or a list of numbers"
    return None


def batchnorm_problem(arrays: Mapping[str, np.ndarray]) -> str | None:
    """BatchNorm's running variances divide the activations: zero or negative ones wreck the model."""
    for name, value in arrays.items():
        if name.endswith("running_var") and value.size and not (value > 0).all():
            return f"{name} holds a variance of {float(value.min()):.3g}; variances must be positive"
    return None


def update_distance(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float | None:
    """L2 distance over the float arrays both hold (``None`` when they share none): how far a hospital moved."""
    total, shared = 0.0, False
    for name, value in arrays.items():
        ref = reference.get(name)
        if ref is None or value.dtype.kind != "f" or ref.shape != value.shape:
            continue
        difference = value.astype(np.float64) - ref.astype(np.float64)
        total += float(np.dot(difference.ravel(), difference.ravel()))
        shared = True
    return math.sqrt(total) if shared else None


def norm_outliers(distances: Mapping[str, float], limit: float) -> dict[str, str]:
    """Hospitals whose update distance is more than ``limit`` times the median of the *other* updates'.

    The median of the others, not of all, so the rule also works with two hospitals; a round where the
    others did not move at all (median 0) refuses nobody. ``limit <= 0`` turns the rule off.
    """
    if limit <= 0 or len(distances) < 2:
        return {}
    refused = {}
    for name, distance in distances.items():
        others = float(np.median([d for other, d in distances.items() if other != name]))
        if not math.isfinite(distance):
            refused[name] = f"its update has an infinite norm ({distance})"
        elif others > 0 and distance > limit * others:
            refused[name] = (f"its update norm {distance:.4g} is {distance / others:.3g}x the median of the others' "
                             f"({others:.4g}), above screening.update-norm-limit={limit:g}")
    return refused


def capped_shares(weights: list[float], cap: float) -> np.ndarray:
    """Normalised weights in which no share exceeds ``cap``; what is cut is spread over the others in
    proportion to their weights (water-filling). A cap below 1/n gives equal shares."""
    shares = np.asarray(weights, dtype=np.float64)
    shares = shares / shares.sum()
    if cap >= 1.0 or len(shares) == 0:
        return shares
    if cap * len(shares) <= 1.0:
        return np.full(len(shares), 1.0 / len(shares))
    capped = np.zeros(len(shares), dtype=bool)
    while True:
        over = (shares > cap + 1e-12) & ~capped
        if not over.any():
            return shares
        capped |= over
        free = 1.0 - cap * capped.sum()
        rest = shares[~capped]
        shares = np.where(capped, cap, shares * free / rest.sum() if rest.sum() > 0 else 0.0)


def robust_average(arrays: list[Mapping[str, np.ndarray]], rule: str, trim_fraction: float = 0.2) -> NamedArrays:
    """Coordinate-wise median (Flower's FedMedian) or trimmed mean (Flower's FedTrimmedAvg, its ``trim_mean``)
    of named arrays, unweighted; integer arrays take the median."""
    result: NamedArrays = {}
    for name, first in arrays[0].items():
        stacked = np.stack([np.asarray(item[name]) for item in arrays])
        if rule == "trimmed-mean" and first.dtype.kind == "f":
            from flwr.serverapp.strategy.fedtrimmedavg import trim_mean  # Flower's own rule, where Flower is

            value = trim_mean(stacked.astype(np.float64), trim_fraction)
        else:
            value = np.median(stacked, axis=0)
        result[name] = np.asarray(value).astype(first.dtype)
    return result
