"""MOON through Flower: the server is FedAvg's; the contrastive term is in ``common.methods.moon``."""

from typing import Any

from .base import HospitalStrategy


class MoonStrategy(HospitalStrategy):
    """FedAvg whose hospitals add a model-contrastive term on the representation (Li et al. 2021)."""

    method_name = "moon"
    section = "moon"

    def __init__(self, *, mu: float = 1.0, temperature: float = 0.5, **kwargs: Any):
        super().__init__(settings=self.method_settings(mu=mu, temperature=temperature), **kwargs)
