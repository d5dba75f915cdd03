"""What FedProIn's training reply releases: its model (prototypes included), trained from the model it received, and
its influence counts (how many of its samples each prototype is nearest to, one count per sample), which the server
needs to weight the prototypes.

Under local DP the model update is clipped and noised like any other, and the counts get noise of std
``COUNT_NOISE_FACTOR`` x sigma; the hospital then counts with the model it received, which its data did not shape, so
one replaced record moves two counts by one (docs/privacy.md, "What epsilon means here"). Under min-samples k, a
count below k (after the noise) is sent as 0 and its prototype as received.

Under patient-level DP-SGD the encoder and prototypes train through per-patient gradients (the prototypes in a leaf
of their own: ``PrototypeNet.per_sample_view``), FDL clipped with the task loss and PCL, which reads no data, added
after the noise; no prototype is placed on a patient's features (no k-means start, no re-seeding), and the counts
are withheld: the hospital's samples spread evenly over the prototypes (``hospital.withheld_influence``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from common.methods.privacy import PrivacyRules

#: FedProIn's influence counts are noised with this many times noise-multiplier (in samples) under local DP.
COUNT_NOISE_FACTOR = 2.0


class FedProInRules(PrivacyRules):
    def noise_multiplier(self, sigma: float) -> float:
        """The model update (moved by at most 2C, noise sigma C) and the counts (moved by sqrt(2), noise
        COUNT_NOISE_FACTOR sigma) released together: one Gaussian mechanism of this multiplier."""
        ratio = (2.0 / sigma) ** 2 + (math.sqrt(2.0) / (COUNT_NOISE_FACTOR * sigma)) ** 2
        return 1.0 / math.sqrt(ratio)

    def withhold_small(self, method, payload, reply, k: int, sigma: float | None, rng) -> dict[str, Any]:
        """Influence counts noised (under local DP of multiplier ``sigma``), then those below ``k`` sent as 0 with
        their prototypes as received."""
        received = payload.arrays["model"]["prototypes"]
        counts = np.asarray(reply.metrics["influence"], dtype=np.float64).reshape(received.shape[:2])
        if sigma is not None:  # noised first: the threshold is then applied to noisy counts
            counts = np.clip(np.rint(counts + rng.normal(0.0, COUNT_NOISE_FACTOR * sigma, counts.shape)), 0, None)
            limit = float(len(method.site.train))
            if counts.sum() > limit:  # the server refuses more than the declared samples (post-processing)
                counts = np.floor(counts * limit / counts.sum())
        small = counts < k
        counts[small] = 0
        prototypes = reply.arrays["model"]["prototypes"]
        prototypes[small] = received[small]
        reply.metrics["influence"] = [int(c) for c in counts.ravel()]
        return {"prototypes-withheld": int(small.sum()), "of": int(small.size)}


RULES = FedProInRules(protocol_metrics=frozenset({"influence"}))
