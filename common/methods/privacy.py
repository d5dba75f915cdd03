"""What a method's training reply releases, as the method declares it for a hospital's policy (docs/privacy.md).

Each method package states its rules in its ``privacy.py`` (``MethodSpec.privacy``): whether local DP can bound its
reply and with which sensitivity, the reply metrics that are counts its protocol needs, what it sends beside the
model and how that is made safe under local DP, and what ``min-samples`` withholds. The policy (``common/trust/``)
enforces what a method declares and imports no method; a method that declares nothing is refused under local DP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def update_noise_multiplier(noise_multiplier: float) -> float:
    """One round's noise relative to its sensitivity when one record is replaced: the clipped update moves by at most
    2C, so noise of std sigma C is sigma / 2 of it."""
    return noise_multiplier / 2.0


@dataclass(frozen=True)
class PrivacyRules:
    """A method's declaration of what its training reply releases."""

    #: why local DP cannot bound the reply; empty: the reply's ``model`` is the received model trained, and local DP
    #: clips and noises its update
    no_local_dp: str = ""
    #: reply metrics that are counts its protocol needs, kept whatever ``release-metrics`` says
    protocol_metrics: frozenset[str] = frozenset()
    #: sigma -> one round's noise multiplier relative to its sensitivity (every statistic the reply carries counted)
    noise_multiplier: Callable[[float], float] = update_noise_multiplier
    #: under local DP, before the model is noised: (method, payload, reply) -> the array groups besides the model that
    #: it made safe to release (FedBN sends the initial normalisation layers in place of its own); any other group
    #: makes the reply refused
    before_local_dp: Callable[[Any, Any, Any], set[str]] | None = None
    #: min-samples k: (method, payload, reply, k, local-DP sigma or None, rng) -> what it withheld, for the audit
    #: log (None: nothing); statistics of fewer than k samples must not leave
    withhold_small: Callable[..., dict[str, Any] | None] | None = None

    #: why its training cannot run as patient-level DP-SGD (common/trust/patient_dp.py); empty: the method trains
    #: the received model with the task's loss alone, which per-patient gradients cover
    no_patient_dp: str = ""

    @property
    def local_dp(self) -> bool:
        return not self.no_local_dp


#: The reply is the received model, trained (FedAvg, FedProx, MOON): local DP clips and noises its update.
MODEL_UPDATE = PrivacyRules()
#: FedProx and MOON: the received model trained with a term of their own beside the task's loss (each term declares
#: how DP-SGD takes it: common.trust.patient_dp.loss_term, FedProx's data-free, MOON's per-sample).
MODEL_UPDATE_WITH_TERM = PrivacyRules()
#: A method whose package declares nothing.
UNDECLARED = PrivacyRules(no_local_dp="its package declares no privacy rules (privacy.py), so nothing bounds its "
                                      "reply", no_patient_dp="its package declares no privacy rules (privacy.py)")
