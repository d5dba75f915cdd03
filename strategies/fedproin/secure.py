"""FedProIn under secure aggregation: the encoder as FedAvg (each hospital weighs its update by its own sample
count); the influence counts I_i exactly, as integers; for normalised influence aggregation the influence-weighted
prototype updates I_i[c, k] x (P_i - P)[c, k] / W_I, W_I in the round plan, the same for all, so the server's NIA is
the ratio of two sums (docs/secure-aggregation.md, "What each method sums")."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from common.payload import Payload
from common.trust.secure_aggregation.messages import NORM_BOUND_KEY, PREFIX
from common.trust.secure_aggregation.methods import (
    Contribution,
    MethodPlan,
    SecureMethod,
    clip_update,
    float_names,
    mean_update,
    model_change,
    own_weight,
    weighted_plan,
)
from common.trust.secure_aggregation.vector import INTEGER, Entry, Layout
from strategies.fedproin.messages import INFLUENCE

INFLUENCE_BOUND_KEY = PREFIX + "influence-bound"  #: W_I, the largest count a hospital may add


class FedProInSecure(SecureMethod):
    """FedProIn's sums: the encoder as FedAvg's, the influence counts, NIA's prototype sums."""

    hidden_metrics = frozenset({INFLUENCE})

    def plan(self, method, hospitals, settings, norm_bound) -> MethodPlan:
        """FedProIn: the encoder as FedAvg; the influence counts I_i (exactly, as integers) and, for NIA, the
        influence-weighted prototype updates I_i[c, k] x (P_i - P)[c, k] / W_I, W_I the largest declared count."""
        prototypes = method.global_arrays["prototypes"]
        influence_bound = max(int(h.num_examples) for h in hospitals)
        nia = method.cfg.fedproin.aggregation == "nia"
        extra = [Entry(INFLUENCE, tuple(prototypes.shape[:2]), INTEGER, influence_bound)]
        if nia:
            extra.append(Entry("prototype-sum", tuple(prototypes.shape)))
        plan = weighted_plan(method, hospitals, settings, norm_bound, method.global_arrays, tuple(extra),
                             skip=("prototypes",) if nia else (), extra_common={INFLUENCE_BOUND_KEY: influence_bound})
        plan.context["influence-bound"] = influence_bound
        return plan

    def contribution(self, received: Payload, reply: Payload, params: Mapping[str, Any],
                              layout: Layout) -> Contribution:
        model_in, model_out = received.arrays.get("model", {}), reply.arrays.get("model", {})
        names = float_names(model_in)
        change = model_change(model_in, model_out, names)
        change, clipped = clip_update(change, float(params[NORM_BOUND_KEY]))
        weight = own_weight(reply, params)
        entries = {e.name: e for e in layout.entries}
        raw = reply.metrics.get(INFLUENCE)
        if not isinstance(raw, (list, tuple, np.ndarray)) or np.size(raw) != entries[INFLUENCE].size:
            raise ValueError(f"the reply carries no influence matrix of {entries[INFLUENCE].size} counts")
        bound = float(params[INFLUENCE_BOUND_KEY])
        counts = np.clip(np.rint(np.asarray(raw, dtype=np.float64)), 0, bound).reshape(entries[INFLUENCE].shape)
        values = {"weight": np.asarray(weight), INFLUENCE: counts}
        values.update({name: weight * change[name.removeprefix("model/")] for name in entries
                       if name.startswith("model/")})
        if "prototype-sum" in entries:
            values["prototype-sum"] = counts[..., None] * change["prototypes"] / bound
        return values, {"secagg-clipped": int(clipped)}

    def apply(self, method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
        """Encoder by the mean update; prototypes by NIA from the two sums: P + (sum I D / W_I) W_I / sum I where
        sum I > 0, the previous prototype where it is 0; then FedProIn's bookkeeping on the summed counts (``settle``:
        unused prototypes, re-seeding)."""
        nia = "prototype-sum" in sums
        arrays = mean_update(sums, method.global_arrays, skip=("prototypes",) if nia else ())
        counts = np.asarray(sums[INFLUENCE], dtype=np.int64)
        if nia:
            previous = method.global_arrays["prototypes"]
            moved = previous.astype(np.float64).copy()
            used = counts > 0
            moved[used] += sums["prototype-sum"][used] * plan.context["influence-bound"] / counts[used][:, None]
            arrays["prototypes"] = moved.astype(previous.dtype)
        return method.settle(rnd, arrays, counts)


SECURE = FedProInSecure()
