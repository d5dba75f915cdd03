"""FedBN (Li et al. 2021): FedAvg in which every hospital keeps its normalisation layers (BatchNorm's affine
parameters and running statistics) to itself, a personalised baseline for multi-centre data whose scanners and
stains shift each site's feature statistics.

``norm_layers.py`` which state entries are a model's normalisation layers, ``server.py`` and ``hospital.py`` the two
halves, ``strategy.py`` the Flower strategy. Adding it touched nothing outside this package but one line in
``common/methods/registry.py`` (docs/ARCHITECTURE.md).
"""

from common.methods.registry import TWO_D, MethodSpec

METHODS = (
    MethodSpec("fedbn", TWO_D, server="strategies.fedbn.server:FedBNServer",
               hospital="strategies.fedbn.hospital:FedBNHospital", strategy="strategies.fedbn.strategy:FedBNStrategy",
               summary="FedAvg with every hospital's normalisation layers kept local",
               not_for_central_dp="a reply carries the hospital's own normalisation layers beside the shared "
               "weights, which are not the model the wrapper sent, so it cannot clip the update tensor by tensor",
               secure="strategies.fedbn.secure:SECURE", privacy="strategies.fedbn.privacy:RULES",
               flower_contract=True),
)
