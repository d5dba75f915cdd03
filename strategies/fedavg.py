"""FedAvg through Flower: the core is ``common.methods.fedavg``."""

from .base import MethodStrategy


class FedAvgStrategy(MethodStrategy):
    method_name = "fedavg"
