"""FedBN under secure aggregation: the FedAvg sums over the shared part only; the normalisation layers never leave
the hospitals (not even for the server's per-hospital scoring, as they do without it)."""

from __future__ import annotations

from typing import Any

from common.trust.secure_aggregation.methods import (
    MeanUpdate,
    MethodPlan,
    check_bounds,
    mean_update,
    refuse_robust_aggregate,
    weighted_plan,
)

from .norm_layers import NORM_GROUP


class FedBNSecure(MeanUpdate):
    """FedAvg's sums over the shared part only."""

    def plan(self, method, hospitals, settings, norm_bound) -> MethodPlan:
        return weighted_plan(method, hospitals, settings, norm_bound, method.shared())

    def apply(self, method, rnd, sums, plan, updates) -> dict[str, Any]:
        """The shared part moves by the mean update; the server scores the shared weights with the initial
        normalisation layers (a new site's model)."""
        check_bounds(sums, plan, updates)
        shared = mean_update(sums, method.shared())
        method.global_arrays = {k: shared.get(k, v) for k, v in method.global_arrays.items()}
        return {}

    def refuse(self, job) -> str | None:
        return refuse_robust_aggregate(job)  # its own apply: no aggregate_secure_mean asked of its server

    def personal(self, reply) -> dict[str, set[str]]:
        """The received model's arrays a FedBN hospital keeps its own values of: its normalisation layers, which its
        training reply names (its hospital half never loads the server's, :class:`~.hospital.FedBNHospital`)."""
        return {"model": set(reply.arrays.get(NORM_GROUP, {}))}


SECURE = FedBNSecure()
