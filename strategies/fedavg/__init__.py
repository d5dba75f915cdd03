"""FedAvg (McMahan et al. 2017): hospitals train the whole model; the server averages by sample count.

``server.py`` the server half, ``hospital.py`` the hospital half (plain PyTorch/NumPy), ``strategy.py`` the Flower
strategy. FedAvg has no settings of its own (screening is every method's: ``common/engine/screening.py``).
"""

from common.methods.registry import TWO_D, MethodSpec

METHODS = (
    MethodSpec("fedavg", TWO_D, server="strategies.fedavg.server:FedAvgServer",
               hospital="strategies.fedavg.hospital:FedAvgHospital",
               strategy="strategies.fedavg.strategy:FedAvgStrategy",
               summary="Federated averaging weighted by sample counts",
               secure="strategies.fedavg.secure:SECURE",
               privacy="strategies.fedavg.privacy:RULES", flower_contract=True),
)
