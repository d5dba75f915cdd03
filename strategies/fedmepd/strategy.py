"""FedMEPD and its baselines through Flower: the cores are ``server.py``, ``hospital.py`` and ``baselines.py``.

A train message carries the hospital's encoders and the fusion decoder as the ArrayRecord ``"arrays"``,
the anchors as ``"anchors"``, and the hospital's personal-filter mask as bytes (``personal-mask``) in its
ConfigRecord. The server trains on its own full-modality cases every round (``brain.server-data-dir``, or
its share of ``data-dir`` in a simulation). Each round's MetricRecord has ``method.masks.<hospital>``
(the mask bytes as a list of ints), ``method.personalised.<hospital>.<layer>`` (the share of that
layer's filters that are personal; ``.all`` over the decoder) and ``method.server-train-loss``.
"""

from strategies.base import HospitalStrategy

from .settings import FedMEPDSettings


class FedMEPDStrategy(HospitalStrategy):
    """Modality-specific encoders, a per-filter personalised fusion decoder and multi-anchor LACCA (docs/fedmepd.md)."""

    method_name = "fedmepd"
    settings_type = FedMEPDSettings
    section = "fedmepd"


class SharedEncoderFedAvgStrategy(HospitalStrategy):
    """Baseline: FedAvg of the whole model with one encoder shared by all modalities."""

    method_name = "fedmepd-fedavg"


class FederatedDecoderStrategy(HospitalStrategy):
    """Baseline: modality-specific encoders with a fully federated fusion decoder."""

    method_name = "fedmepd-federated-decoder"


class LocalOnlyStrategy(HospitalStrategy):
    """Baseline: every hospital (and the server) trains alone."""

    method_name = "fedmepd-local"
