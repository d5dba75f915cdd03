"""FedProx through Flower: the server is FedAvg's; the proximal term is in ``strategies.fedprox.hospital``."""

from strategies.base import HospitalStrategy

from .settings import FedProxSettings


class FedProxStrategy(HospitalStrategy):
    """FedAvg whose hospitals add (mu/2)||w - w_global||^2 to their loss (``proximal_mu``, as Flower's FedProx)."""

    method_name = "fedprox"
    settings_type = FedProxSettings
    section = "fedprox"
    renamed = {"proximal_mu": "mu"}

