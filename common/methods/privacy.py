"""What a method's training reply releases, as the method declares it for a hospital's policy (docs/privacy.md).

Each method package states its rules in its ``privacy.py`` (``MethodSpec.privacy``): whether local DP can bound its
reply and with which sensitivity, the reply metrics that are counts its protocol needs, what it sends beside the
model and how that is made safe under local DP, and what ``min-samples`` withholds. The policy (``common/trust/``)
enforces what a method declares and imports no method; a method that declares nothing is refused under local DP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.payload import Payload

#: ``method`` below: the hospital's ``common.methods.base.HospitalMethod`` (not imported: base imports the config,
#: which reads the registry, which reads these rules)
HospitalMethod = Any


def update_noise_multiplier(noise_multiplier: float) -> float:
    """One round's noise relative to its sensitivity when one record is replaced: the clipped update moves by at most
    2C, so noise of std sigma C is sigma / 2 of it."""
    return noise_multiplier / 2.0


@dataclass(frozen=True)
class PrivacyRules:
    """A method's declaration of what its training reply releases: three statements (the fields) and three steps
    the hospital's policy (``common/trust/enforcer.py``) calls, which a method whose reply carries more than the
    model overrides in a subclass (FedProIn's counts, FedProto's class means, FedBN's normalisation layers)."""

    #: why local DP cannot bound the reply; empty: the reply's ``model`` is the received model trained, and local DP
    #: clips and noises its update
    no_local_dp: str = ""
    #: reply metrics that are counts its protocol needs, kept whatever ``release-metrics`` says
    protocol_metrics: frozenset[str] = frozenset()
    #: why its training cannot run as patient-level DP-SGD (common/trust/patient_dp.py); empty: the method trains
    #: the received model with the task's loss alone, which per-patient gradients cover
    no_patient_dp: str = ""

    @property
    def local_dp(self) -> bool:
        return not self.no_local_dp

    def noise_multiplier(self, sigma: float) -> float:
        """One round's noise multiplier relative to the reply's sensitivity under local DP of ``sigma`` (every
        statistic the reply carries counted); default: the clipped model update alone."""
        return update_noise_multiplier(sigma)

    def before_local_dp(self, method: HospitalMethod, payload: Payload, reply: Payload) -> set[str]:
        """Under local DP, before the model is noised: the array groups of ``reply`` besides the model that this
        made safe to release (FedBN sends the initial normalisation layers in place of its own); any other group
        makes the reply refused. Default: none."""
        return set()

    def withhold_small(self, method: HospitalMethod, payload: Payload, reply: Payload, k: int,
                       sigma: float | None, rng: np.random.Generator | None) -> dict[str, Any] | None:
        """Under min-samples ``k`` (``sigma``: the local-DP noise multiplier, None without; ``rng``: the hospital's
        noise): withhold from ``reply`` the statistics of fewer than ``k`` samples and say what was withheld, for the
        audit log (None: nothing). Default: nothing beyond the model, which the task trained on all its samples."""
        return None


#: The reply is the received model, trained (FedAvg, FedProx, MOON): local DP clips and noises its update.
MODEL_UPDATE = PrivacyRules()
#: FedProx and MOON: the received model trained with a term of their own beside the task's loss (each term declares
#: how DP-SGD takes it: common.trust.patient_dp.loss_term, FedProx's data-free, MOON's per-sample).
MODEL_UPDATE_WITH_TERM = PrivacyRules()
#: A method whose package declares nothing.
UNDECLARED = PrivacyRules(no_local_dp="its package declares no privacy rules (privacy.py), so nothing bounds its "
                                      "reply", no_patient_dp="its package declares no privacy rules (privacy.py)")
