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

#: Most characters of a hospital's own text (a value, a key, an error it reports) that a log line, a refusal reason
#: or the history keeps: a hostile 100 MB string is cut, never copied.
MAX_TEXT = 200
#: Most entries of one metric list a reply may carry (FedProIn's influence matrix: classes x prototypes).
MAX_METRIC_ENTRIES = 100_000


def brief(value: Any, limit: int = MAX_TEXT) -> str:
    """``repr(value)``, cut to ``limit`` characters (with how long it was) when longer."""
    if isinstance(value, (list, tuple)) and len(value) > 20:
        return f"[{', '.join(repr(v) for v in value[:3])}, ... {len(value)} entries]"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def cut(text: str, limit: int = 4 * MAX_TEXT) -> str:
    """A reason (which may quote a hospital's text) cut to ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_count(value: Any) -> bool:
    """A whole, finite number of at least 1 (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return math.isfinite(value) and value >= 1 and float(value).is_integer()


def sample_count_problem(reported: Any, declared: int, key: str = "num-examples") -> str | None:
    """A reply's sample count (``key``) must be a whole number of at least 1, no larger than the count the hospital
    declared when it joined (it weighs the hospital's update in every average; 0.5 on every reply would make the
    shares 0/0)."""
    if isinstance(reported, bool) or not isinstance(reported, (int, float, np.integer, np.floating)):
        return f"{key}={brief(reported)} is not a number"
    if not is_count(reported):
        return f"{key}={brief(reported)} is not a whole number of samples of at least 1"
    if reported > declared:
        return f"{key}={reported!r} is more than the {declared} training samples it declared when it joined"
    return None


def metrics_problem(metrics: Mapping[str, Any], list_metrics: frozenset[str] = frozenset()) -> str | None:
    """Every metric is a number, and only the metrics the method reads as lists (``list_metrics``, e.g. FedProIn's
    influence matrix) may be lists of numbers, of at most :data:`MAX_METRIC_ENTRIES` entries: a method reads every
    other metric as a number (FedMEPD averages ``val-*``), and a list there would end the round."""
    for key, value in metrics.items():
        if not isinstance(key, str) or len(key) > MAX_TEXT:
            return f"a metric name is not a short text ({brief(key)})"
        if isinstance(value, (list, tuple)):
            if key not in list_metrics:
                return f"metric {key!r} is a list ({brief(value)}), not a number"
            if len(value) > MAX_METRIC_ENTRIES:
                return f"metric {key!r} holds {len(value)} entries, more than the {MAX_METRIC_ENTRIES} allowed"
            values = value
        else:
            values = [value]
        if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
            return f"metric {key!r}={brief(value)} is not a number" + (" list" if isinstance(value, list) else "")
        bounds = metric_bounds(key)
        if bounds is not None and not isinstance(value, (list, tuple)) and math.isfinite(value) \
                and not bounds[0] <= value <= bounds[1]:
            return f"metric {key!r}={brief(value)} is outside [{bounds[0]:g}, {bounds[1]:g}], the range of such metrics"
    return None


#: The ranges of the metrics we know by name (a NaN, e.g. HD95 of an empty mask, is no score and is left out of means).
METRIC_BOUNDS = {"accuracy": (0.0, 1.0), "dice": (0.0, 1.0), "iou": (0.0, 1.0), "f1": (0.0, 1.0),
                 "precision": (0.0, 1.0), "recall": (0.0, 1.0), "auc": (0.0, 1.0), "mcc": (-1.0, 1.0),
                 "loss": (0.0, math.inf), "hd95": (0.0, math.inf)}


def metric_bounds(key: str) -> tuple[float, float] | None:
    """The range of a metric we know by its name (``val-accuracy``, ``dice/kvasir``, ``global.val-w-f1``), else
    None: a hospital's own metrics are any number."""
    base = key.split("/")[0].rsplit(".", 1)[-1]
    for name, bounds in METRIC_BOUNDS.items():
        if base == name or base.endswith("-" + name) or base.startswith(name + "_"):
            return bounds
    return None


def declared_count_problem(declared: Any, limit: int) -> str | None:
    """What a hospital declares when it joins: a whole number of samples of at least 1, at most ``limit``
    (``screening.max-samples``)."""
    if not is_count(declared) or isinstance(declared, float):
        return f"num-examples={brief(declared)} is not a whole number of samples of at least 1"
    if declared > limit:
        return (f"num-examples={declared} is more than screening.max-samples={limit}, the most any hospital of this "
                "consortium may declare")
    return None


def ratio_capped_weights(counts: list[float], limit: float) -> tuple[list[float], list[int]]:
    """Each count cut to ``limit`` times the median of the others' (``screening.sample-ratio-limit``; 0: off):
    the weights, and the indices that were cut."""
    if limit <= 0 or len(counts) < 2:
        return list(counts), []
    weights, cut_index = [], []
    for i, count in enumerate(counts):
        ceiling = limit * float(np.median([c for j, c in enumerate(counts) if j != i]))
        weights.append(min(count, ceiling))
        if count > ceiling:
            cut_index.append(i)
    return weights, cut_index


def relative_norms(norms: Mapping[str, float]) -> dict[str, float]:
    """Each hospital's update norm over the median of the others' (1: a typical update; 0: it did not move, a
    free-rider), recorded every round."""
    if len(norms) < 2:
        return {}
    ratios = {}
    for name, norm in norms.items():
        others = float(np.median([n for other, n in norms.items() if other != name]))
        if others > 0 and math.isfinite(norm):
            ratios[name] = round(norm / others, 4)
    return ratios


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
        difference = value.astype(np.float64)
        difference -= ref  # (as ref.astype(np.float64) would, without that copy)
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
    shares = np.asarray([float(w) for w in weights], dtype=np.float64)  # Python ints first: no int64 overflow
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


#: Values of each hospital's tensor a coordinate-wise rule takes at once (float64): the rule holds hospitals x this
#: many values, not every hospital's whole tensor.
