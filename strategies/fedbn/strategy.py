"""FedBN through Flower: the model's shared weights go both ways as the ArrayRecord ``"arrays"``; a reply also
carries its normalisation layers as the ArrayRecord ``"norm-layers"``, which the server uses only to score that
hospital's own model. Under Flower's DP wrappers both records are clipped, so use FedAvg there."""

from strategies.base import HospitalStrategy


class FedBNStrategy(HospitalStrategy):
    """FedAvg with every hospital's BatchNorm layers kept local (Li et al. 2021)."""

    method_name = "fedbn"
