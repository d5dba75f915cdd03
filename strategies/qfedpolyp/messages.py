"""What QFedPolyp's messages carry: the packed model (or update, or downlink delta) both ways, the BatchNorm
statistics of an update or delta, each hospital's assigned bit-width, and (``downlink='delta'``) which model a
delta applies to and a digest of the model it rebuilds."""

from __future__ import annotations

import hashlib

import numpy as np

from common.arrays import NamedArrays
from common.config import ConfigError
from common.methods.base import HospitalInfo
from common.quantization.codec import PayloadError, check_bit_width, decode_model, encode_model

PACKED = "packed-model"  #: the array group holding an encoded model (or update), both ways
#: update mode and a delta downlink: the BatchNorm running statistics, not as a change (a quantised change of a
#: variance could make it negative) but as themselves, one encoded model of the dense codec at
#: ``statistics-bit-width`` (32: the floats exactly; fewer: per tensor min-max, the minimum exact, so variances stay
#: positive): three arrays instead of one per tensor, as Flower frames every array (about 0.5 kB each)
STATISTICS = "statistics"
BIT_WIDTH_KEY = "qfedpolyp.bit-width"  #: round-config key: the uplink bit-width assigned to this hospital
#: downlink='delta' round-config keys: the round of the model the delta applies to (0: the message holds the full
#: model), the round of the model it rebuilds, and that model's digest (:func:`model_digest`)
DOWNLINK_BASE_KEY = "qfedpolyp.downlink-base"
DOWNLINK_ROUND_KEY = "qfedpolyp.downlink-round"
DOWNLINK_DIGEST_KEY = "qfedpolyp.downlink-digest"
HELD_PREFIX = "held/"  #: a hospital's state: the model it holds (weights without the BatchNorm statistics)
HELD_ROUND = "held-round"  #: ... and the round of the downlink it rebuilt it from


def is_statistic(name: str) -> bool:
    return name.endswith(("running_mean", "running_var"))


def split_statistics(arrays: NamedArrays) -> tuple[NamedArrays, NamedArrays]:
    """(weights, BatchNorm running statistics) of a model's arrays."""
    return ({k: v for k, v in arrays.items() if not is_statistic(k)},
            {k: v for k, v in arrays.items() if is_statistic(k)})


def pack_statistics(statistics: NamedArrays, bits: int) -> NamedArrays:
    """The BatchNorm running statistics as they travel (:data:`STATISTICS`)."""
    return encode_model(statistics, bits)


def unpack_statistics(arrays: dict[str, NamedArrays], reference: NamedArrays, bits: int, what: str) -> NamedArrays:
    """The statistics a message's :data:`STATISTICS` group stands for, checked against ``reference`` (names, shapes,
    dtypes) and the assigned bit-width; :class:`PayloadError` naming ``what`` otherwise."""
    if STATISTICS not in arrays:
        raise PayloadError(f"{what} carries no '{STATISTICS}' arrays")
    try:
        return decode_model(arrays[STATISTICS], reference=reference, expected_bits=bits, expected_content="weights")
    except PayloadError as error:
        raise PayloadError(f"{what} '{STATISTICS}': {error}") from None


def apply_delta(base: NamedArrays, delta: NamedArrays) -> NamedArrays:
    """``base + delta`` in float64, cast back to each array's dtype: the one sum the server and every hospital
    compute, so both arrive at the same bits."""
    return {k: (v.astype(np.float64) + delta[k].astype(np.float64)).astype(v.dtype) for k, v in base.items()}


def model_digest(arrays: NamedArrays) -> str:
    """SHA-256 over the arrays' names, dtypes, shapes and bytes in name order: equal digests, equal models."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{value.dtype.str}|{value.shape}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def assign_bit_width(hospital: HospitalInfo, roster: list[str], widths: list[int]) -> int:
    """The hospital's own declaration (node config ``bit-width``) if it made one, else its entry of
    ``widths`` by its rank among ``roster``'s names (a single entry applies to every hospital)."""
    declared = hospital.properties.get("bit-width")
    if declared:
        return check_bit_width(declared, f"node config of {hospital.name} key 'bit-width'")
    if len(widths) == 1:
        return widths[0]
    names = sorted(set(roster) | {hospital.name})
    rank = names.index(hospital.name)
    if rank >= len(widths):
        raise ConfigError(f"qfedpolyp.bit-widths: lists {len(widths)} bit-widths, but {hospital.name} is hospital "
                          f"number {rank + 1} in name order ({', '.join(names)}); give one bit-width per hospital, "
                          f"a single value for all, or set 'bit-width' in that hospital's node config")
    return widths[rank]
