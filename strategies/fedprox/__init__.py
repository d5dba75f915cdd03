"""FedProx (Li et al. 2020): FedAvg plus (mu/2)||w - w_global||^2 in each hospital's loss; the server is FedAvg's."""

from common.methods.registry import TWO_D, MethodSpec

METHODS = (
    MethodSpec("fedprox", TWO_D, server="strategies.fedavg.server:FedAvgServer",
               hospital="strategies.fedprox.hospital:FedProxHospital",
               strategy="strategies.fedprox.strategy:FedProxStrategy",
               summary="FedAvg with a proximal term on the hospital side",
               settings="strategies.fedprox.settings:FedProxSettings", section="fedprox",
               secure="strategies.fedavg.secure:SECURE", flower_contract=True),
)
