"""The sample-weighted mean of the hospitals' models: FedAvg's server step, which FedProx and MOON share (their terms
are the hospitals' own)."""

from __future__ import annotations

from typing import Any

from common.arrays import robust_average, weighted_average
from common.methods.base import HospitalUpdate, SecureMean, ServerMethod


class SampleWeightedAverage(ServerMethod):
    """The global model is the sample-weighted mean of the hospitals' trained models. A subclass that changes
    :meth:`aggregate` says what it makes of a secure sum too (:meth:`aggregate_secure_mean`): else a server step of
    its own (FedDyn's correction, a count of hospitals) would be skipped under secure aggregation without a word."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "aggregate" in vars(cls) and "aggregate_secure_mean" not in vars(cls):
            raise TypeError(f"{cls.__name__} changes aggregate but not aggregate_secure_mean: say what its server "
                            "does with a secure round's mean update (common.methods.base.SecureMean)")

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

    def aggregate_secure_mean(self, rnd: int, mean: SecureMean) -> dict[str, Any]:
        """The secure sum's mean update is the sample-weighted mean: it becomes the global model."""
        self.global_arrays = dict(mean.arrays)
        return {}
