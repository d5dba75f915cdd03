"""A model as b-bit integer codes really packed into bytes, with what the receiver needs to check and
rebuild it: the payload QFedPolyp hospitals upload (and, optionally, the server sends down).

Each float tensor is quantised on its own, asymmetric min-max (paper eq. 13-14):
``step = (max - min) / (2^b - 1)``, ``code = round((w - min) / step)``, ``w~ = min + code * step``, so
the rebuilt value is within half a step of the original and never below the minimum (which is
rebuilt exactly, so BatchNorm variances stay positive). ``b = 1`` is for a round's change only (an update or
a downlink delta, never weights): each value's sign times one scale per tensor, the mean magnitude (which
makes the squared error smallest for those signs), written as min ``-scale`` and step ``2 scale`` so the
same rebuild ``min + code * step`` gives ``-scale`` or ``+scale`` (signSGD with a scale, as EF-SignSGD sends
with error feedback). Codes are
packed at exactly b bits, little-endian bit order (at 4 bits two codes share a byte). ``b = 32``
sends floats as they are. Integer tensors (BatchNorm's ``num_batches_tracked``) are counters, not
weights: their bytes travel unchanged at every b.

An encoded model is three named arrays, so it travels like any other array group:

``header`` (uint8)   compact JSON: format, version, the bit-width tag, the content (``weights``, a round's
                     ``update`` or a downlink ``delta``), and every tensor's name, shape, dtype
``ranges`` (float64) ``(k, 2)``: min and step of each quantised tensor, in header order
``data``   (uint8)   every tensor's bytes (packed codes, or raw values) one after another, each tensor
                     starting on a byte boundary

Decoding recomputes every tensor's byte length from its shape and the tag, and refuses what does not
add up (wrong or unexpected tag, a 1-bit tag on weights or a 1-bit range that is not ``(-scale, 2 scale)``,
truncated or padded data, names or shapes unlike the reference model, NaN or Inf) with a
:class:`PayloadError` that says why.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

import numpy as np

from common.arrays import ArraysMismatch, NamedArrays, check_like

FORMAT = "fedmed-packed-model"
VERSION = 1
SIGN_BITS = 1  #: the sign of each value times one scale per tensor: for a round's change, never for weights
WEIGHT_BIT_WIDTHS = (*range(2, 17), 32)  #: what a model's weights can travel at
VALID_BIT_WIDTHS = (SIGN_BITS, *WEIGHT_BIT_WIDTHS)
#: what an encoded model holds: a model's weights, a hospital's round's change of them (``update``), or the change of
#: the model hospitals hold that the server sends down (``delta``)
CONTENTS = ("weights", "update", "delta")
#: dtypes a header may name (anything else is refused before NumPy is asked to interpret it)
ALLOWED_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                  "uint8", "uint16", "uint32", "uint64", "bool")


class PayloadError(ValueError):
    """An encoded model that cannot be accepted; the message says what is wrong with it."""


def check_bit_width(bits: Any, what: str = "bit-width", content: str | None = None) -> int:
    """``bits`` as an int if it is 1..16 or 32 (1 only for a change: ``content`` other than ``weights``), else a
    :class:`ValueError` naming ``what``."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in VALID_BIT_WIDTHS:
        raise ValueError(f"{what}: {bits!r} is not a bit-width; use 1..16 (1: signs of a change), or 32 for "
                         "plain floats")
    if int(bits) == SIGN_BITS and content == "weights":
        raise ValueError(f"{what}: 1 bit (signs with a scale) is for a round's change (qfedpolyp.quantise='update', "
                         "or a downlink='delta'), not for weights; use 2..16, or 32")
    return int(bits)


def is_quantised(dtype: np.dtype, bits: int) -> bool:
    return bits < 32 and np.dtype(dtype).kind == "f"


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` codes take at ``bits`` bits each."""
    return (count * bits + 7) // 8


# --- codes <-> bytes ------------------------------------------------------------------------------
def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes below 2^bits as a uint8 bit stream, ``bits`` bits per code, little-endian."""
    codes = np.asarray(codes).ravel()
    planes = np.empty((codes.size, bits), dtype=np.uint8)
    for bit in range(bits):
        planes[:, bit] = (codes >> bit) & 1
    return np.packbits(planes.ravel(), bitorder="little")


def unpack_codes(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: the first ``count`` codes of the stream, as uint32."""
    planes = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=count * bits, bitorder="little")
    planes = planes.reshape(count, bits)
    codes = np.zeros(count, dtype=np.uint32)
    for bit in range(bits):
        codes |= planes[:, bit].astype(np.uint32) << bit
    return codes


# --- values <-> codes -----------------------------------------------------------------------------
def quantise(values: np.ndarray, bits: int) -> tuple[np.ndarray, float, float]:
    """(codes, min, step) of one tensor; a constant tensor gets step 0 and all-zero codes. At 1 bit: code 1 for
    a value >= 0, min ``-scale`` and step ``2 scale`` (scale: the mean magnitude; all zeros: 0 and 0)."""
    values = np.asarray(values, dtype=np.float64).ravel()
    if values.size == 0:
        return np.zeros(0, np.uint32), 0.0, 0.0
    if bits == SIGN_BITS:
        scale = float(np.abs(values).mean())
        return (values >= 0).astype(np.uint32), -scale if scale else 0.0, 2 * scale
    low, high = float(values.min()), float(values.max())
    step = (high - low) / (2 ** bits - 1)
    if step == 0.0:
        return np.zeros(values.size, np.uint32), low, 0.0
    codes = np.clip(np.rint((values - low) / step), 0, 2 ** bits - 1).astype(np.uint32)
    return codes, low, step


def dequantise(codes: np.ndarray, low: float, step: float, dtype: np.dtype) -> np.ndarray:
    return (low + codes.astype(np.float64) * step).astype(dtype)


# --- whole models ---------------------------------------------------------------------------------
def encode_model(arrays: Mapping[str, np.ndarray], bits: int, content: str = "weights") -> NamedArrays:
    """Named arrays (a state dict, or ``content='update'``: a round's change of one) as
    ``{"header", "ranges", "data"}`` at ``bits`` bits per float value; ``content`` is tagged in the header."""
    if content not in CONTENTS:
        raise PayloadError(f"content {content!r} is not one of {CONTENTS}")
    try:
        bits = check_bit_width(bits, content=content)
    except ValueError as error:
        raise PayloadError(str(error)) from None
    tensors, ranges, chunks = [], [], []
    for name, value in arrays.items():
        value = np.asarray(value)
        if value.dtype.name not in ALLOWED_DTYPES:
            raise PayloadError(f"{name}: dtype {value.dtype} cannot be encoded")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise PayloadError(f"{name}: holds NaN or Inf, cannot be encoded")
        tensors.append([name, list(value.shape), value.dtype.name])
        if is_quantised(value.dtype, bits):
            codes, low, step = quantise(value, bits)
            ranges.append((low, step))
            chunks.append(pack_codes(codes, bits))
        else:
            chunks.append(np.frombuffer(np.ascontiguousarray(value).tobytes(), dtype=np.uint8))
    header = {"format": FORMAT, "version": VERSION, "bits": bits, "content": content, "tensors": tensors}
    return {
        "header": np.frombuffer(json.dumps(header, separators=(",", ":")).encode(), dtype=np.uint8).copy(),
        "ranges": np.asarray(ranges, dtype=np.float64).reshape(-1, 2),
        "data": np.concatenate(chunks) if chunks else np.zeros(0, np.uint8),
    }


#: The most bytes a payload's JSON header may take (ours take a few hundred).
MAX_HEADER_BYTES = 1 << 16


def parse_header(encoded: Mapping[str, np.ndarray], form: str, version: int, what: str) -> dict[str, Any]:
    """A payload's header, read and checked as far as every payload of ``form`` shares: its three arrays, a JSON
    header of that format and version, a bit-width tag the codec has."""
    missing = [key for key in ("header", "ranges", "data") if key not in encoded]
    if missing:
        raise PayloadError(f"{what} lacks {missing}")
    raw = np.asarray(encoded["header"])
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise PayloadError(f"header must be a 1-D uint8 array, got {raw.dtype} {raw.shape}")
    if raw.size > MAX_HEADER_BYTES:
        raise PayloadError(f"header is {raw.size} bytes, more than the {MAX_HEADER_BYTES} a header takes")
    try:
        header = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PayloadError(f"header is not JSON ({error})") from None
    except RecursionError:
        raise PayloadError("header nests lists or objects too deeply to be a header") from None
    if not isinstance(header, dict) or header.get("format") != form or header.get("version") != version:
        raise PayloadError(f"header is not a {form} version {version} header")
    try:
        check_bit_width(header.get("bits"), "bit-width tag")
    except ValueError as error:
        raise PayloadError(str(error)) from None
    return header


def read_header(encoded: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The checked header of an encoded model (its ``bits`` is the bit-width tag)."""
    header = parse_header(encoded, FORMAT, VERSION, "encoded model")
    if header.setdefault("content", "weights") not in CONTENTS:  # payloads written before the tag: weights
        raise PayloadError(f"header's content {header['content']!r} is not one of {CONTENTS}")
    if header["bits"] == SIGN_BITS and header["content"] == "weights":
        raise PayloadError("bit-width tag 1 (signs) on weights: 1 bit is for a round's change, never a model")
    tensors = header.get("tensors")
    if not isinstance(tensors, list) or not all(_well_formed(entry) for entry in tensors):
        raise PayloadError("header's tensor list is malformed (want [name, shape, dtype] entries)")
    if len({entry[0] for entry in tensors}) != len(tensors):
        raise PayloadError("header names a tensor twice")
    return header


def check_ranges(ranges: np.ndarray, names: list[str], bits: int) -> None:
    """Refuse ranges that are not one finite (min, step >= 0) float64 row per quantised tensor ``names``, or, at
    1 bit, not the symmetric ``(-scale, 2 scale)`` of sign codes."""
    ranges = np.asarray(ranges)
    if ranges.dtype != np.float64 or ranges.shape != (len(names), 2):
        raise PayloadError(f"ranges are {ranges.dtype} {ranges.shape}, expected float64 {(len(names), 2)}")
    bad = ~np.isfinite(ranges).all(axis=1) | (ranges[:, 1] < 0)
    if bad.any():
        raise PayloadError(f"{names[int(np.flatnonzero(bad)[0])]}: min/step are not finite and non-negative")
    if bits == SIGN_BITS:
        bad = ranges[:, 0] != -ranges[:, 1] / 2
        if bad.any():
            where = int(np.flatnonzero(bad)[0])
            raise PayloadError(f"{names[where]}: 1-bit sign codes need min = -step/2 (values -scale or +scale), "
                               f"got min {ranges[where, 0]!r}, step {ranges[where, 1]!r}")


def _well_formed(entry: Any) -> bool:
    return (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
            and isinstance(entry[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1])
            and entry[2] in ALLOWED_DTYPES)


def decode_model(encoded: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None = None,
                 expected_bits: int | None = None, expected_content: str | None = None) -> NamedArrays:
    """The named arrays an encoded model stands for.

    ``expected_bits``: the tag the sender was told to use; ``expected_content``: weights or an update;
    ``reference``: arrays with the names, shapes and dtypes the result must have (the receiver's model).
    Anything that does not match is a :class:`PayloadError`.
    """
    header = read_header(encoded)
    bits = header["bits"]
    if expected_bits is not None and bits != expected_bits:
        raise PayloadError(f"bit-width tag is {bits}, but {expected_bits} was assigned")
    if expected_content is not None and header["content"] != expected_content:
        raise PayloadError(f"payload is tagged {header['content']!r}, expected {expected_content!r}")
    ranges, data = encoded["ranges"], encoded["data"]
    check_ranges(ranges, [entry[0] for entry in header["tensors"] if is_quantised(np.dtype(entry[2]), bits)], bits)
    if data.dtype != np.uint8 or data.ndim != 1:
        raise PayloadError(f"data must be a 1-D uint8 array, got {data.dtype} {data.shape}")
    sizes = [_nbytes(entry, bits) for entry in header["tensors"]]
    if data.size != sum(sizes):
        raise PayloadError(f"data holds {data.size} bytes, but the header's {len(sizes)} tensors at "
                           f"{bits} bits need {sum(sizes)} ({'truncated' if data.size < sum(sizes) else 'padded'})")
    result: NamedArrays = {}
    offset, next_range = 0, 0
    for (name, shape, dtype), size in zip(header["tensors"], sizes):
        chunk = data[offset:offset + size]
        offset += size
        count = math.prod(shape)
        if is_quantised(np.dtype(dtype), bits):
            low, step = ranges[next_range]
            next_range += 1
            value = dequantise(unpack_codes(chunk, count, bits), low, step, np.dtype(dtype))
        else:
            value = np.frombuffer(chunk.tobytes(), dtype=np.dtype(dtype)).copy()
        result[name] = value.reshape(shape)
    try:
        check_like(result, reference if reference is not None else result, "encoded model")
    except ArraysMismatch as error:
        raise PayloadError(str(error)) from None
    if reference is not None:
        for name, value in result.items():
            if value.dtype != reference[name].dtype:
                raise PayloadError(f"{name} has dtype {value.dtype}, expected {reference[name].dtype}")
    return result


def _nbytes(entry: list, bits: int) -> int:
    _, shape, dtype = entry
    count = math.prod(shape)
    return packed_nbytes(count, bits) if is_quantised(np.dtype(dtype), bits) else count * np.dtype(dtype).itemsize


def encoded_nbytes(encoded: Mapping[str, np.ndarray]) -> int:
    return int(sum(np.asarray(a).nbytes for a in encoded.values()))
