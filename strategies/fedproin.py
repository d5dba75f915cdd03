"""FedProIn through Flower: the core is ``common.methods.fedproin``.

Replies carry the model as the ArrayRecord ``"arrays"`` (prototypes included, as the model's
``prototypes`` parameter) and the influence matrix as the metric ``influence`` (a flat list of
counts, classes x prototypes per class), so Flower's DP wrappers can clip the model. Each round's
MetricRecord has ``method.influence.<hospital>`` and ``method.prototype-usage``.
"""

from typing import Any

from .base import HospitalStrategy


class FedProInStrategy(HospitalStrategy):
    """Learnable multi-prototypes, feature-divergence and prototype-contrastive losses, and normalised
    influence aggregation of the prototypes (docs/fedproin.md; ablations: ``fdl_weight=0``,
    ``pcl_weight=0``, ``aggregation='fedavg'``)."""

    method_name = "fedproin"
    section = "fedproin"

    def __init__(self, *, num_prototypes: int = 2, task_loss: str = "dce", mcel_xi: float = 0.05,
                 mcl_margin: float = 0.5, dce_gamma: float = 0.05, fdl_weight: float = 1.0, pcl_weight: float = 1.0,
                 pcl_margin: float = 0.5, aggregation: str = "nia", class_balanced: bool = False,
                 class_augmentation: bool = False, prototype_learning_rate: float = 0.0, prototype_init: str = "normal",
                 keep_optimizer_state: bool = False, epoch_draws: str = "samples", reseed_after: int = 0,
                 reseed_rule: str = "split", **kwargs: Any):
        super().__init__(settings=self.method_settings(
            num_prototypes=num_prototypes, task_loss=task_loss, mcel_xi=mcel_xi, mcl_margin=mcl_margin,
            dce_gamma=dce_gamma, fdl_weight=fdl_weight, pcl_weight=pcl_weight, pcl_margin=pcl_margin,
            aggregation=aggregation, class_balanced=class_balanced, class_augmentation=class_augmentation,
            prototype_learning_rate=prototype_learning_rate, prototype_init=prototype_init,
            keep_optimizer_state=keep_optimizer_state, epoch_draws=epoch_draws, reseed_after=reseed_after,
            reseed_rule=reseed_rule),
            **kwargs)
