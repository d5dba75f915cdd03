"""FedProx through Flower: the server is FedAvg's; the proximal term is in ``common.methods.fedprox``."""

from .base import MethodStrategy


class FedProxStrategy(MethodStrategy):
    method_name = "fedprox"
