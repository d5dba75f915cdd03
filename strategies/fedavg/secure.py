"""FedAvg under secure aggregation: each hospital adds (n_i/W) x its update, clipped to the round's norm bound, and
n_i/W; the server moves the global model by the ratio of the two sums, the sample-weighted mean update
(``MEAN_UPDATE`` of ``common/trust/secure_aggregation/methods.py``, which FedProx, MOON and FedMEPD's FedAvg baseline
name too and FedBN builds on; the server half takes the mean in ``aggregate_secure_mean``;
docs/secure-aggregation.md, "What each method sums")."""

from common.trust.secure_aggregation.methods import MEAN_UPDATE

SECURE = MEAN_UPDATE
