"""FedProto through Flower: the core is ``common.methods.fedproto``."""

from typing import Any

from .base import HospitalStrategy


class FedProtoStrategy(HospitalStrategy):
    """Personal models that share per-class mean features (prototypes) (Tan et al. 2022)."""

    method_name = "fedproto"
    section = "fedproto"

    def __init__(self, *, proto_weight: float = 1.0, **kwargs: Any):
        super().__init__(settings=self.method_settings(proto_weight=proto_weight), **kwargs)
