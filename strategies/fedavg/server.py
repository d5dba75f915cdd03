"""FedAvg's server half (McMahan et al. 2017): the sample-weighted mean of the hospitals' models
(``common/methods/averaging.py``, which FedProx and MOON share)."""

from __future__ import annotations

from common.methods.averaging import SampleWeightedAverage


class FedAvgServer(SampleWeightedAverage):
    name = "fedavg"
