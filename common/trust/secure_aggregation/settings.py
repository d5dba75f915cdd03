"""``[secure-aggregation]``: the run config's table (no Flower, no NumPy: ``common.config`` imports it everywhere)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.settings import Section

#: Hospitals refuse a threshold of this fraction of the shares or less (more than half: two groups told different
#: survivor sets cannot both reach it); their policy may ask for more (``min-threshold-fraction``).
MIN_THRESHOLD_FRACTION = 0.5


class SecureAggregationSettings(Section):
    """``[secure-aggregation]``: SecAgg+ over each round's hospitals (docs/secure-aggregation.md). The server learns
    the sum of the hospitals' contributions only; each hospital bounds its own update before masking it."""

    enabled: bool = Field(False, description=(
        "Run every training round as SecAgg+ (setup, share keys, collect masked vectors, consistency check, unmask): "
        "the server sees sums, never one hospital's update. Methods: every one whose package declares what "
        "it sums (its MethodSpec.secure); the others are refused before round 1, naming why."))
    num_shares: float = Field(1.0, gt=0.0, description=(
        "How many hospitals (itself included) each hospital shares its secrets with: a fraction (<= 1) of the "
        "round's hospitals, or a count (> 1, whole). 1.0: every hospital of the round (SecAgg); fewer: SecAgg+."))
    reconstruction_threshold: float = Field(MIN_THRESHOLD_FRACTION, gt=0.0, description=(
        "Shares needed to rebuild a secret: as a fraction f (0.5 <= f <= 1), the fewest shares that are more than f "
        "of num-shares (at least 2); or a count (> 1, whole). Hospitals refuse half the shares or fewer: two groups "
        "the server told different stories could then each reach it. A round survives hospitals dropping out after "
        "sharing keys while each hospital keeps this many live neighbours."))
    clipping_range: float = Field(8.0, gt=0.0, description=(
        "Float contributions are clipped to [-clipping-range, clipping-range] before quantisation (Flower's "
        "default 8). The quantisation step is 2 x clipping-range / quantization-range."))
    quantization_range: int = Field(2**22, ge=2, description=(
        "Float contributions are quantised to integers in [0, quantization-range] (Flower's default 2^22)."))
    modulus_range: int = Field(2**32, ge=4, description=(
        "The sums are taken modulo this power of 2 (Flower's default 2^32); round hospitals x quantization-range "
        "must stay below it. QFedPolyp sums its codes modulo 2^(b + ceil(log2 H) + 1) instead."))
    update_norm_bound: float = Field(0.0, ge=0.0, description=(
        "L2 bound every hospital clips its model update to before masking it (what replaces the server's "
        "update-norm rule, which cannot see single updates). 0: update-norm-factor decides."))
    update_norm_factor: float = Field(10.0, ge=0.0, description=(
        "Without update-norm-bound: hospitals clip their update to this many times the L2 norm of the previous "
        "round's aggregated update (none in the first round; 0: no clipping)."))
    stage_timeout: float = Field(0.0, ge=0.0, description=(
        "Seconds the server waits for the replies of each key stage (setup, share keys, consistency, unmask); 0: "
        "round-timeout."))
    distributed_dp: Literal["off", "skellam"] = Field("off", description=(
        "Distributed DP (docs/secure-aggregation.md): each hospital adds its share of Skellam noise to its integer "
        "contribution before masking, so the unmasked sum carries noise of std noise-multiplier x "
        "update-norm-bound on every coordinate and no party sees a less noisy value. FedAvg, FedProx, MOON and "
        "FedBN; needs update-norm-bound."))
    noise_multiplier: float = Field(1.0, gt=0.0, description=(
        "Distributed DP: z, the sum's noise standard deviation over update-norm-bound."))
    noise_hospitals: int = Field(0, ge=0, description=(
        "Distributed DP: how many hospitals' noise shares make up the target (each adds 1/this of its variance); "
        "0: the round's hospitals. Fewer than the round's gives more noise than the target when all survive."))
    code_range_margin: float = Field(0.5, ge=0.0, description=(
        "QFedPolyp: the shared code range of each tensor is the global tensor's [min, max] widened by this fraction "
        "of its span (BatchNorm statistics: four times as much); values outside are clipped."))

    @field_validator("num_shares", "reconstruction_threshold")
    @classmethod
    def _fraction_or_count(cls, value: float) -> float:
        if value > 1 and value != int(value):
            raise ValueError(f"{value!r}: a fraction is at most 1, a count is a whole number")
        return value

    @field_validator("reconstruction_threshold")
    @classmethod
    def _majority(cls, value: float) -> float:
        if value < MIN_THRESHOLD_FRACTION:
            raise ValueError(f"{value!r}: as a fraction it must be at least {MIN_THRESHOLD_FRACTION} (hospitals "
                             "refuse a threshold of half the shares or fewer: a server telling two halves different "
                             "survivor sets could rebuild both secrets of one hospital)")
        return value

    @field_validator("modulus_range")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1) or value > 2**32:
            raise ValueError(f"{value} is not a power of 2 up to 2^32")
        return value

    @model_validator(mode="after")
    def _ranges(self) -> "SecureAggregationSettings":
        if self.modulus_range <= self.quantization_range:
            raise ValueError(f"modulus-range={self.modulus_range} must exceed quantization-range="
                             f"{self.quantization_range}")
        if 1 < self.num_shares < 3:
            raise ValueError("num-shares as a count must be at least 3 (Flower's SecAgg+ rule)")
        if self.distributed_dp != "off" and not self.update_norm_bound > 0:
            raise ValueError("distributed-dp needs update-norm-bound > 0: the noise is scaled to the bound every "
                             "hospital clips its contribution to")
        if self.num_shares > 1 and self.reconstruction_threshold > 1:
            if self.reconstruction_threshold >= self.num_shares:
                raise ValueError(f"reconstruction-threshold={self.reconstruction_threshold:g} must be below "
                                 f"num-shares={self.num_shares:g}")
            if 2 * self.reconstruction_threshold <= self.num_shares:
                raise ValueError(f"reconstruction-threshold={self.reconstruction_threshold:g} is half of num-shares="
                                 f"{self.num_shares:g} or less, which hospitals refuse")
        return self


def share_plan(count: int, num_shares: float, reconstruction_threshold: float) -> tuple[int, int]:
    """(shares, threshold) for ``count`` hospitals: shares as Flower's ``SecAggPlusWorkflow`` derives them (an odd
    count for SecAgg+), the threshold as the fewest shares above the fraction (at least 2), or the count given."""
    if num_shares <= 1:
        shares = round(num_shares * count)
        if shares < count and shares % 2 == 0:
            shares += 1
        if shares <= 2:
            shares = count
    else:
        shares = int(num_shares)
    shares = min(shares, count)
    if reconstruction_threshold <= 1:
        threshold = max(min(math.floor(reconstruction_threshold * shares) + 1, shares), 2)
    else:
        threshold = int(reconstruction_threshold)
    return shares, threshold
