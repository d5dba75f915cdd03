"""FedMEPD and its baselines through Flower: the cores are ``common.methods.fedmepd`` and ``fedmepd_baselines``."""

from .base import MethodStrategy


class FedMEPDStrategy(MethodStrategy):
    method_name = "fedmepd"


class SharedEncoderFedAvgStrategy(MethodStrategy):
    method_name = "fedmepd-fedavg"


class FederatedDecoderStrategy(MethodStrategy):
    method_name = "fedmepd-federated-decoder"


class LocalOnlyStrategy(MethodStrategy):
    method_name = "fedmepd-local"
