"""QFedPolyp under secure aggregation: each hospital's b_i-bit model re-coded on a dyadic grid the round plan sets per
tensor (the same for all), lifted to the round's finest grid and weighted by its own weight (its samples under the
plan's cap), summed as integers modulo 2^(B + ceil(log2 H) + 1) with the weight itself as one more integer; the
server's weighted mean is low + sum of codes / sum of weights x the grid's step (docs/secure-aggregation.md, "What
each method sums"). Works with ``quantise='weights'`` and a model downlink."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from common.payload import Payload
from common.trust.secure_aggregation.messages import NORM_BOUND_KEY, PREFIX, WEIGHT_CAP_KEY
from common.trust.secure_aggregation.methods import (
    Contribution,
    MethodPlan,
    SecureMethod,
    clip_update,
    common_weight_cap,
    float_names,
    model_change,
    own_weight,
)
from common.trust.secure_aggregation.vector import INTEGER, Entry, Layout

if TYPE_CHECKING:
    from common.config import JobConfig

GRID_BITS_KEY = PREFIX + "grid-bits"  #: B, the round's finest grid
RANGE_LOW_KEY = PREFIX + "range-low"  #: per float tensor, the low end of its shared code range
RANGE_HIGH_KEY = PREFIX + "range-high"
FLOAT_GRID_BITS = 24  #: the shared grid of a hospital that sends plain floats (bit-width 32)


def grid_bits(bits: int) -> int:
    return FLOAT_GRID_BITS if bits >= 32 else int(bits)


def is_statistic(name: str) -> bool:
    return name.endswith(("running_mean", "running_var"))


def code_ranges(arrays: Mapping[str, np.ndarray], margin: float) -> tuple[list[float], list[float]]:
    """The shared range of each float tensor: its global [min, max] widened by ``margin`` x its span (at least
    ``margin`` x its largest magnitude, or 0.1); BatchNorm statistics four times as much (at least 4 x ``margin``:
    the first round's are the initial 0 and 1), variances above 0."""
    lows, highs = [], []
    for name in float_names(arrays):
        value = np.asarray(arrays[name], dtype=np.float64)
        low, high = float(value.min()), float(value.max())
        floor, factor = (1.0, 4) if is_statistic(name) else (0.1, 1)  # BatchNorm: init 0 and 1, data decides
        wide = margin * max(high - low, float(np.abs(value).max()), floor) * factor
        low, high = low - wide, high + wide
        if name.endswith("running_var"):
            low = max(low, float(value.min()) / 4)
        lows.append(low)
        highs.append(high)
    return lows, highs


class QFedPolypSecure(SecureMethod):
    """QFedPolyp's sums: each hospital's weights as codes on a shared grid, weighted by its own weight."""

    own_config = frozenset({"qfedpolyp.bit-width"})  # messages.BIT_WIDTH_KEY (its import needs torch)

    def refuse(self, job: "JobConfig") -> str | None:
        settings = job.qfedpolyp
        if settings.quantise != "weights" or settings.downlink != "model" or settings.downlink_bit_width != 32:
            return ("QFedPolyp sums codes of the hospitals' weights on a shared grid: it needs qfedpolyp.quantise="
                    "'weights', downlink='model' and downlink-bit-width=32 (updates, deltas and quantised downlinks "
                    "are left for later)")
        return None

    def plan(self, method, hospitals, settings, norm_bound) -> MethodPlan:
        """Each hospital's weights as codes at its own bit-width b_i on a shared dyadic grid per tensor, lifted to
        the round's finest grid B (code << (B - b_i)) and weighted by its own w_i in (0, 1] (stochastic rounding), w_i
        itself as one more code, so the sum stays below 2^(B + ceil(log2 H)) and is taken modulo
        2^(B + ceil(log2 H) + 1)."""
        bits = {h.name: int(method.assigned[h.name]) for h in hospitals}
        finest = max(grid_bits(b) for b in bits.values())
        count = len(hospitals)
        modulus = 2 ** (finest + math.ceil(math.log2(count)) + 1)
        arrays = method.global_arrays
        lows, highs = code_ranges(arrays, settings.code_range_margin)
        layout = Layout((Entry("weight", (), INTEGER, 2 ** finest - 1),
                         *(Entry(f"code/{name}", tuple(np.shape(arrays[name])), INTEGER, 2 ** finest - 1)
                           for name in float_names(arrays))))
        common = {GRID_BITS_KEY: finest, RANGE_LOW_KEY: lows, RANGE_HIGH_KEY: highs, NORM_BOUND_KEY: float(norm_bound),
                  WEIGHT_CAP_KEY: common_weight_cap(method.cfg, hospitals)}
        return MethodPlan(layout, modulus, 2 ** finest, common,
                          {"lows": lows, "highs": highs, "grid-bits": finest, "bits": bits})

    def contribution(self, received: Payload, reply: Payload, params: Mapping[str, Any],
                               layout: Layout) -> Contribution:
        from common.quantization.codec import check_bit_width, decode_model  # torch: QFedPolyp's hospitals have it
        from strategies.qfedpolyp.messages import BIT_WIDTH_KEY, PACKED

        model_in = decode_model(received.arrays[PACKED], expected_content="weights")
        model_out = decode_model(reply.arrays[PACKED], reference=model_in, expected_content="weights")
        names = [name.removeprefix("code/") for name in layout.names if name.startswith("code/")]
        change, clipped = clip_update(model_change(model_in, model_out, names), float(params[NORM_BOUND_KEY]))
        finest = int(params[GRID_BITS_KEY])
        own = check_bit_width(received.config.get(BIT_WIDTH_KEY), BIT_WIDTH_KEY, content="weights")
        bits = min(grid_bits(own), finest)
        weight = own_weight(reply, params)
        lows, highs = list(params[RANGE_LOW_KEY]), list(params[RANGE_HIGH_KEY])
        if len(lows) != len(names) or len(highs) != len(names):
            raise ValueError("the code ranges do not fit the layout")
        from common.trust.local_dp import noise_rng

        rng = noise_rng()  # the hospital's own randomness, which the server cannot reproduce
        top = 2 ** finest - 1
        values, outside, total = {"weight": np.asarray(min(top, np.floor(weight * top + rng.random())))}, 0, 0
        for name, low, high in zip(names, lows, highs):
            weights_sent = np.asarray(model_in[name], dtype=np.float64) + change[name]
            scaled = (weights_sent - low) / (high - low) * 2 ** bits
            outside += int(((scaled < 0) | (scaled > 2 ** bits)).sum())
            total += scaled.size
            codes = np.clip(np.rint(scaled), 0, 2 ** bits - 1) * 2 ** (finest - bits) * weight  # code at b_i, lifted
            values[f"code/{name}"] = np.clip(np.floor(codes + rng.random(codes.shape)), 0, 2 ** finest - 1)
        return values, {"secagg-clipped": int(clipped), "secagg-out-of-range": round(outside / max(total, 1), 6)}

    def apply(self, method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
        """The weighted mean of the hospitals' weights: low + (sum of codes / sum of weights) x the finest grid's
        step."""
        context, hospitals = plan.context, [u.hospital for u in updates]
        weight = float(sums["weight"]) / (2 ** context["grid-bits"] - 1)
        if not weight > 0:
            raise ValueError(f"the hospitals' weights sum to {weight:.3g}: nothing to average")
        step = 2.0 ** -context["grid-bits"]
        arrays = dict(method.global_arrays)
        for name, low, high in zip(float_names(arrays), context["lows"], context["highs"]):
            mean_code = np.asarray(sums[f"code/{name}"], dtype=np.float64) / weight
            arrays[name] = (low + mean_code * step * (high - low)).astype(arrays[name].dtype)
        method.global_arrays = arrays
        method._decoded.clear()
        return {"bit-widths": {h.name: context["bits"][h.name] for h in hospitals}, "grid-bits": context["grid-bits"]}


SECURE = QFedPolypSecure()
