"""What FedBN's training reply releases: the shared weights, trained, like FedAvg's, and its normalisation layers
(``NORM_GROUP``), which the server keeps per hospital. Under local DP the shared weights are clipped and noised like
any model update, and the normalisation layers of the job's initial model (the server's seed) go in place of the
hospital's own, so they say nothing of its data."""

from __future__ import annotations

from common.methods.privacy import PrivacyRules

from .norm_layers import NORM_GROUP


class FedBNRules(PrivacyRules):
    def before_local_dp(self, method, payload, reply) -> set[str]:
        """The reply's normalisation layers replaced by the job's initial model's (the same seed as the server's)."""
        import torch

        from common.arrays import model_arrays

        method.task.adopt_spec(payload.config)
        torch.manual_seed(method.cfg.seed)
        initial = model_arrays(method.task.initial_model())
        reply.arrays[NORM_GROUP] = {name: initial[name] for name in reply.arrays[NORM_GROUP]}
        return {NORM_GROUP}


RULES = FedBNRules(no_patient_dp=(
    "FedBN keeps each hospital's own BatchNorm statistics, and BatchNorm mixes the samples of a batch, so no "
    "per-patient gradient exists (DP-SGD needs GroupNorm in its place, which is not FedBN)"))
