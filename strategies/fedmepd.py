"""FedMEPD and its baselines through Flower: the cores are ``common.methods.fedmepd`` and ``fedmepd_baselines``.

A train message carries the hospital's encoders and the fusion decoder as the ArrayRecord ``"arrays"``,
the anchors as ``"anchors"``, and the hospital's personal-filter mask as bytes (``personal-mask``) in its
ConfigRecord. The server trains on its own full-modality cases every round (``brain.server-data-dir``, or
its share of ``data-dir`` in a simulation). Each round's MetricRecord has ``method.masks.<hospital>``
(the mask bytes as a list of ints), ``method.personalised.<hospital>.<layer>`` (the share of that
layer's filters that are personal; ``.all`` over the decoder) and ``method.server-train-loss``.
"""

from typing import Any

from .base import HospitalStrategy


class FedMEPDStrategy(HospitalStrategy):
    """Modality-specific encoders, a per-filter personalised fusion decoder and multi-anchor LACCA (docs/fedmepd.md)."""

    method_name = "fedmepd"
    section = "fedmepd"

    def __init__(self, *, patience: int = 10, warmup_rounds: int = 30, server_momentum: float = 0.3,
                 weight_momentum: float = 0.95, num_anchors: int = 4, anchor_momentum: float = 0.999,
                 lacca: bool = True, server_change_from: str = "sent", initial_weight: str = "one",
                 filter_vector: str = "kernel", **kwargs: Any):
        super().__init__(settings=self.method_settings(
            patience=patience, warmup_rounds=warmup_rounds, server_momentum=server_momentum,
            weight_momentum=weight_momentum, num_anchors=num_anchors, anchor_momentum=anchor_momentum,
            lacca=lacca, server_change_from=server_change_from, initial_weight=initial_weight,
            filter_vector=filter_vector), **kwargs)


class SharedEncoderFedAvgStrategy(HospitalStrategy):
    """Baseline: FedAvg of the whole model with one encoder shared by all modalities."""

    method_name = "fedmepd-fedavg"


class FederatedDecoderStrategy(HospitalStrategy):
    """Baseline: modality-specific encoders with a fully federated fusion decoder."""

    method_name = "fedmepd-federated-decoder"


class LocalOnlyStrategy(HospitalStrategy):
    """Baseline: every hospital (and the server) trains alone."""

    method_name = "fedmepd-local"
