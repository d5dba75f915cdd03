"""A round's record, built in one place for every round."""

from __future__ import annotations

import math


def weighted_mean_metrics(items: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Per-key mean weighted by the first element (sample counts); keys missing somewhere are skipped."""
    if not items:
        return {}
    keys = set.intersection(*(set(m) for _, m in items))
    total = sum(w for w, _ in items) or 1.0
    return {k: float(sum(w * m[k] for w, m in items) / total) for k in sorted(keys)
            if all(isinstance(m[k], (int, float)) and math.isfinite(m[k]) for _, m in items)}
