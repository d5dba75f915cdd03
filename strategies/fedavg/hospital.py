"""FedAvg's hospital half: local training of the received model, with its validation metrics in the reply (the
step itself is ``common/methods/local_training.py``, which the other methods build on)."""

from __future__ import annotations

from common.methods.local_training import LocalTraining


class FedAvgHospital(LocalTraining):
    """Local training of the received model, as it is."""
