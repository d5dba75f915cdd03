"""FedProx's settings: the ``[fedprox]`` run-config table and ``FedProxStrategy``'s own argument (``proximal_mu``)."""

from __future__ import annotations

from pydantic import Field

from common.settings import Section


class FedProxSettings(Section):
    mu: float = Field(0.01, ge=0.0, description="Weight of the proximal term (mu/2)||w - w_global||^2.")
