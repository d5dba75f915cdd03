"""FedProx (Li et al. 2020): FedAvg plus (mu/2)||w - w_global||^2 in each hospital's loss; the server is FedAvg's
(``common/methods/averaging.py``)."""

from common.methods.registry import TWO_D, MethodSpec

METHODS = (
    MethodSpec("fedprox", TWO_D, server="strategies.fedprox.server:FedProxServer",
               hospital="strategies.fedprox.hospital:FedProxHospital",
               strategy="strategies.fedprox.strategy:FedProxStrategy",
               summary="FedAvg with a proximal term on the hospital side",
               settings="strategies.fedprox.settings:FedProxSettings", section="fedprox",
               secure="common.trust.secure_aggregation.methods:MEAN_UPDATE",
               privacy="common.methods.privacy:MODEL_UPDATE_WITH_TERM", flower_contract=True),
)
