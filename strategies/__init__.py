"""Our Flower strategies, one module per method. Each is a Flower ``Strategy`` that owns its method:

    from strategies import FedProInStrategy
    strategy = FedProInStrategy(fraction_train=0.5, min_train_nodes=2, num_prototypes=2)
    result = strategy.start(grid, initial_arrays=strategy.initial_arrays(), num_rounds=10)

The hospitals run fedmed's ClientApp (``client_app.app:app``). See docs/own-serverapp.md.
"""

from .base import HospitalStrategy, strategy_arguments
from .fedavg import FedAvgStrategy
from .fedmepd import FederatedDecoderStrategy, FedMEPDStrategy, LocalOnlyStrategy, SharedEncoderFedAvgStrategy
from .fedproin import FedProInStrategy
from .fedproto import FedProtoStrategy
from .fedprox import FedProxStrategy
from .moon import MoonStrategy
from .qfedpolyp import QFedPolypStrategy

__all__ = ["HospitalStrategy", "strategy_arguments", "FedAvgStrategy", "FedProxStrategy", "MoonStrategy",
           "FedProtoStrategy", "FedProInStrategy", "QFedPolypStrategy", "FedMEPDStrategy",
           "SharedEncoderFedAvgStrategy", "FederatedDecoderStrategy", "LocalOnlyStrategy"]
