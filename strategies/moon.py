"""MOON through Flower: the server is FedAvg's; the contrastive term is in ``common.methods.moon``."""

from .base import MethodStrategy


class MoonStrategy(MethodStrategy):
    method_name = "moon"
