"""FedProx through Flower: the server is FedAvg's; the proximal term is in ``common.methods.fedprox``."""

from typing import Any

from .base import HospitalStrategy


class FedProxStrategy(HospitalStrategy):
    """FedAvg whose hospitals add (mu/2)||w - w_global||^2 to their loss (``proximal_mu``, as Flower's FedProx)."""

    method_name = "fedprox"
    section = "fedprox"
    renamed = {"proximal_mu": "mu"}

    def __init__(self, *, proximal_mu: float = 0.01, **kwargs: Any):
        super().__init__(settings=self.method_settings(proximal_mu=proximal_mu), **kwargs)
