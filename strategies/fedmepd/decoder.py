"""The fusion decoder's parameters, as FedMEPD's server and hospitals name and mask them."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from common.arrays import NamedArrays
from common.engine.reply_store import selected

from .filter_personalisation import subtract

DECODER = "decoder."
MASK_KEY = "personal-mask"
STATE_PREFIX = "fedmepd/"


def decoder_part(arrays: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """The decoder's arrays (of a reply on disk: still on disk, none read)."""
    return selected(arrays, DECODER)


def server_decoder_change(trained: NamedArrays, sent: NamedArrays, aggregated: NamedArrays,
                          reference: str = "sent") -> NamedArrays:
    """delta_s: the server's trained decoder minus the one it held before aggregating (``'sent'``, the public
    code's: it includes the pull toward the hospitals) or minus the aggregate (``'aggregated'``: its own step only)."""
    if reference not in ("sent", "aggregated"):
        raise ValueError(f"fedmepd.server-change-from: {reference!r} is neither 'sent' nor 'aggregated'")
    return subtract(trained, sent if reference == "sent" else aggregated)
