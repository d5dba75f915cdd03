"""QFedPolyp through Flower: the core (QAT, packed b-bit payloads, checks, FedAvg) is ``common.methods.qfedpolyp``;
bytes per hospital each way are measured on the serialised messages by ``MethodStrategy``."""

from .base import MethodStrategy


class QFedPolypStrategy(MethodStrategy):
    method_name = "qfedpolyp"
