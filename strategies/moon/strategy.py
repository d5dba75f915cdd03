"""MOON through Flower: the server is FedAvg's; the contrastive term is in ``strategies.moon.hospital``."""

from strategies.base import HospitalStrategy

from .settings import MoonSettings


class MoonStrategy(HospitalStrategy):
    """FedAvg whose hospitals add a model-contrastive term on the representation (Li et al. 2021)."""

    method_name = "moon"
    settings_type = MoonSettings
    section = "moon"

