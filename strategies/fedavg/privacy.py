"""What FedAvg's training reply releases: the model it received, trained on the hospital's data, and its sample count.
Local DP clips the update to C and adds N(0, (sigma C)^2) to every coordinate; one replaced record moves the clipped
update by at most 2C (``common.methods.privacy.MODEL_UPDATE``, which FedProx and MOON declare too)."""

from common.methods.privacy import MODEL_UPDATE

RULES = MODEL_UPDATE
