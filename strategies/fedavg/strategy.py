"""FedAvg through Flower: the core is ``strategies.fedavg.server`` and ``.hospital``."""

from strategies.base import HospitalStrategy


class FedAvgStrategy(HospitalStrategy):
    """Federated averaging weighted by the hospitals' sample counts (McMahan et al. 2017)."""

    method_name = "fedavg"
