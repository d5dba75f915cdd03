"""FedProto through Flower: the core is ``common.methods.fedproto``."""

from .base import MethodStrategy


class FedProtoStrategy(MethodStrategy):
    method_name = "fedproto"
