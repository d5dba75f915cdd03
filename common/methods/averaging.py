"""The sample-weighted mean of the hospitals' models: FedAvg's server step, which FedProx and MOON share (their terms
are the hospitals' own)."""

from __future__ import annotations

from typing import Any

from common.arrays import robust_average, weighted_average
from common.methods.base import HospitalUpdate, ServerMethod


class SampleWeightedAverage(ServerMethod):
    """The global model is the sample-weighted mean of the hospitals' trained models."""

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        """The sample-weighted mean, or (``screening.robust-aggregate``) Flower's coordinate-wise median or
        trimmed mean, which one hostile hospital among several cannot drag far."""
        models = [u.payload.arrays["model"] for u in updates]
        rule = self.cfg.screening.robust_aggregate
        if rule == "mean":
            self.global_arrays = weighted_average(models, [u.weight for u in updates])
        else:
            self.global_arrays = robust_average(models, rule, self.cfg.screening.trim_fraction)
        return {}
