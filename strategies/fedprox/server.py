"""FedProx's server half: FedAvg's sample-weighted mean (the proximal term is in the hospitals' loss)."""

from __future__ import annotations

from common.methods.averaging import SampleWeightedAverage


class FedProxServer(SampleWeightedAverage):
    name = "fedprox"
