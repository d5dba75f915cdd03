"""FedProIn: learnable multi-prototypes, feature- and prototype-drift losses, normalised influence aggregation
(docs/fedproin.md).

``settings.py`` its settings, ``task.py`` classification by the nearest prototype (the network with its prototype
head, the task losses, class-balanced draws), ``hospital.py`` the hospital half (FDL, PCL, influence counts),
``server.py`` the server half (NIA), ``strategy.py`` the Flower strategy.
"""

from common.methods.registry import MethodSpec

METHODS = (
    MethodSpec("fedproin", ("classification",), server="strategies.fedproin.server:FedProInServer",
               hospital="strategies.fedproin.hospital:FedProInHospital",
               strategy="strategies.fedproin.strategy:FedProInStrategy",
               summary="Learnable multi-prototypes, FDL + PCL, normalised influence aggregation",
               settings="strategies.fedproin.settings:FedProInSettings", section="fedproin",
               model_needs="features", secure="strategies.fedproin.secure:SECURE",
               privacy="strategies.fedproin.privacy:RULES"),
)
