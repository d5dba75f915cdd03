"""What FedProto's training reply releases: its class means (prototypes) with their sample counts, and its own model.
Local DP cannot bound it: the model was never received, so there is no update to clip. Under min-samples k, the mean
of a class with fewer than k samples is not sent (count 0, the received global mean in its place)."""

from __future__ import annotations

from typing import Any

import numpy as np

from common.methods.privacy import PrivacyRules

from .server import PROTOTYPES


class FedProtoRules(PrivacyRules):
    def withhold_small(self, method, payload, reply, k: int, sigma: float | None, rng) -> dict[str, Any] | None:
        """Class means of fewer than ``k`` samples replaced by the received ones, their counts by 0."""
        if k <= 1:
            return None
        group = reply.arrays[PROTOTYPES]
        per_class = np.bincount(np.asarray(method.site.train.labels), minlength=len(group["count"]))
        small = per_class[:len(group["count"])] < k
        group["count"] = np.where(small, 0, group["count"]).astype(group["count"].dtype)
        group["mean"][small] = payload.arrays[PROTOTYPES]["mean"][small]
        return {"class-means-withheld": int(small.sum()), "of": int(small.size)}


RULES = FedProtoRules(
    no_local_dp="FedProto's reply is its class means and its own model, never a model it received, so there is no "
                "update to clip",
    no_patient_dp="FedProto's reply carries its class means, which DP-SGD's noise on the gradients does not cover")
