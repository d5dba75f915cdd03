"""MOON's server half: FedAvg's sample-weighted mean (the model-contrastive term is in the hospitals' loss)."""

from __future__ import annotations

from common.methods.averaging import SampleWeightedAverage


class MoonServer(SampleWeightedAverage):
    name = "moon"
