"""QFedPolyp through Flower: the core (QAT, packed b-bit payloads, checks, FedAvg) is in ``server.py``, ``hospital.py``.

A train message carries the hospital's uplink bit-width in its ConfigRecord (``qfedpolyp.bit-width``)
and the global model as the ArrayRecord ``"packed-model"`` (at ``downlink_bit_width``); the reply
carries the hospital's model as ``"packed-model"``: ``data`` (uint8, every tensor's codes packed at
b bits), ``ranges`` (float64, min and step per quantised tensor) and ``header`` (uint8 bytes of a
JSON text: the bit-width tag and every tensor's name, shape and dtype), with ``bit-width`` in its
metrics. Each round's MetricRecord has ``method.bit-widths.<hospital>`` and the bytes each way.

With ``quantise='update'`` the reply's ``"packed-model"`` is the round's update (``sparsity < 1``: the sparse format of
``common/quantization/sparse.py``, positions as a bitmap or gap codes) and ``"statistics"`` the BatchNorm running
statistics as floats. With ``downlink='delta'`` the train (and evaluate) message's ``"packed-model"`` is the change of
the model the hospital holds (or, with ``qfedpolyp.downlink-base`` 0, the full held model at 32 bits), beside
``"statistics"``, with ``qfedpolyp.downlink-base``, ``-round`` and ``-digest`` in the ConfigRecord; each round's
MetricRecord then also has ``method.downlink-base.<hospital>`` (0: the full model went).
"""

from strategies.base import HospitalStrategy

from .settings import QFedPolypSettings


class QFedPolypStrategy(HospitalStrategy):
    """FedAvg of models trained quantisation-aware and uploaded at each hospital's bit-width (docs/qfedpolyp.md)."""

    method_name = "qfedpolyp"
    settings_type = QFedPolypSettings
    section = "qfedpolyp"

