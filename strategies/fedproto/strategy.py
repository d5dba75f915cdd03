"""FedProto through Flower: the core is ``strategies.fedproto.server`` and ``.hospital``."""

from strategies.base import HospitalStrategy

from .settings import FedProtoSettings


class FedProtoStrategy(HospitalStrategy):
    """Personal models that share per-class mean features (prototypes) (Tan et al. 2022)."""

    method_name = "fedproto"
    settings_type = FedProtoSettings
    section = "fedproto"

