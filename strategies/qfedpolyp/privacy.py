"""What QFedPolyp's training reply releases: b-bit packed codes of its model update and the bit-width it chose (a
count the protocol needs). Local DP cannot bound it: noise added to the update would not survive the quantisation."""

from common.methods.privacy import PrivacyRules

RULES = PrivacyRules(
    no_local_dp="QFedPolyp's reply is b-bit packed codes of its update (common/quantization), which noise added "
                "here would not survive",
    protocol_metrics=frozenset({"bit-width"}),
    no_patient_dp="QFedPolyp's fake-quant layers have no per-sample gradient rule in Opacus, and its segmentation "
                  "task is not taken through DP-SGD yet")
