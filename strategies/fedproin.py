"""FedProIn through Flower: the core is ``common.methods.fedproin``."""

from .base import MethodStrategy


class FedProInStrategy(MethodStrategy):
    method_name = "fedproin"
