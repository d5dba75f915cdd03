"""FedAvg under secure aggregation (also FedProx's and MOON's: their servers are FedAvg's): each hospital adds
(n_i/W) x its update, clipped to the round's norm bound, and n_i/W; the server moves the global model by the ratio
of the two sums, the sample-weighted mean update (docs/secure-aggregation.md, "What each method sums")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.trust.secure_aggregation.methods import (
    MethodPlan,
    SecureMethod,
    check_bounds,
    mean_update,
    stand_in,
    weighted_plan,
    weighted_update_contribution,
)

if TYPE_CHECKING:
    from common.config import JobConfig


def fedavg_plan(method, hospitals, settings, norm_bound) -> MethodPlan:
    return weighted_plan(method, hospitals, settings, norm_bound, method.global_arrays)


def fedavg_apply(method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
    """The checked mean update, then the method's own ``aggregate`` on it as the round's one update."""
    check_bounds(sums, plan, updates)
    return method.aggregate(rnd, [stand_in(updates, mean_update(sums, method.global_arrays))])


def fedavg_refuse(job: "JobConfig") -> str | None:
    if job.screening.robust_aggregate != "mean":
        return (f"screening.robust-aggregate={job.screening.robust_aggregate!r} needs every hospital's update; "
                "a secure sum gives the mean only")
    return None


SECURE = SecureMethod(fedavg_plan, weighted_update_contribution, fedavg_apply, refuse=fedavg_refuse,
                      distributed_dp=True)
