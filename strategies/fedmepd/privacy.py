"""What the FedMEPD family's training replies release: the modality encoders a hospital holds and the fusion
decoder's shared filters (its personal filters masked out, their count a number the protocol needs); the baselines
send the whole model or nothing. Local DP is not implemented for the family."""

from common.methods.privacy import PrivacyRules

PERSONAL_FILTERS = frozenset({"personal-filters"})

RULES = PrivacyRules(
    no_local_dp="FedMEPD's reply (modality encoders and shared decoder filters, its personal filters masked out) is "
                "not covered: local DP is not implemented for the FedMEPD family",
    no_patient_dp="the FedMEPD family's 3D multi-modal networks are not taken through per-sample gradients (their "
                  "per-sample copies of the weights would not fit a hospital's memory)",
    protocol_metrics=PERSONAL_FILTERS)
BASELINE_RULES = PrivacyRules(no_local_dp="local DP is not implemented for the FedMEPD family",
                              no_patient_dp="the FedMEPD family's 3D networks are not taken through per-sample "
                                            "gradients",
                              protocol_metrics=PERSONAL_FILTERS)
