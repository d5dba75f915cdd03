"""FedProx through Flower: the server is FedAvg's; the proximal term is in ``strategies.fedprox.hospital``."""

from typing import Any

from strategies.base import HospitalStrategy

from .settings import FedProxSettings


class FedProxStrategy(HospitalStrategy):
    """FedAvg whose hospitals add (mu/2)||w - w_global||^2 to their loss (``proximal_mu``, as Flower's FedProx)."""

    method_name = "fedprox"
    settings_type = FedProxSettings
    section = "fedprox"
    renamed = {"proximal_mu": "mu"}

    def flower_train_config(self) -> dict[str, Any]:
        """``proximal-mu`` in every train message's config, as Flower's FedProx sends it: a ClientApp that trains
        itself adds the term with it (fedmed's hospitals take ``fedprox.mu`` from the job)."""
        return {"proximal-mu": float(self.proximal_mu)}
