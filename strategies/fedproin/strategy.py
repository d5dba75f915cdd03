"""FedProIn through Flower: the core is ``strategies.fedproin.server`` and ``.hospital``.

Replies carry the model as the ArrayRecord ``"arrays"`` (prototypes included, as the model's
``prototypes`` parameter) and the influence matrix as the metric ``influence`` (a flat list of
counts, classes x prototypes per class), so Flower's DP wrappers can clip the model. Each round's
MetricRecord has ``method.influence.<hospital>`` and ``method.prototype-usage``.
"""

from strategies.base import HospitalStrategy

from .settings import FedProInSettings


class FedProInStrategy(HospitalStrategy):
    """Learnable multi-prototypes, feature-divergence and prototype-contrastive losses, and normalised
    influence aggregation of the prototypes (docs/fedproin.md; ablations: ``fdl_weight=0``,
    ``pcl_weight=0``, ``aggregation='fedavg'``)."""

    method_name = "fedproin"
    settings_type = FedProInSettings
    section = "fedproin"

