"""The summed vector: its :class:`Layout` (named parts, float or integer), one hospital's contribution encoded as the
layout's integers (Flower's stochastic quantisation for floats), the decoded sums, and the masked values packed at
log2(modulus) bits for the wire. NumPy only; Flower's quantisation is imported when first used."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

FLOAT, INTEGER = "f", "i"
#: integers already below the modulus (distributed DP's noised values): summed with the rest, allowed to wrap, decoded
#: by their own rule (common/trust/secure_aggregation/distributed_dp.py)
MODULAR = "m"


@dataclass(frozen=True)
class Entry:
    """One named part of the summed vector: ``kind`` FLOAT (clipped and quantised) or INTEGER (summed exactly, each
    hospital adding at most ``bound``)."""

    name: str
    shape: tuple[int, ...]
    kind: str = FLOAT
    bound: int = 0

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


@dataclass(frozen=True)
class Layout:
    """The parts of the vector every hospital of a round contributes, in order (the server sends it)."""

    entries: tuple[Entry, ...]

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def largest(self, quantization_range: int) -> int:
        """The largest value one hospital adds to any element of the sum (modular entries wrap by design)."""
        return max([quantization_range if e.kind == FLOAT else e.bound for e in self.entries if e.kind != MODULAR]
                   or [0])

    def to_json(self) -> str:
        return json.dumps([[e.name, list(e.shape), e.kind, e.bound] for e in self.entries], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: Any) -> "Layout":
        try:
            items = json.loads(text)
            entries = tuple(Entry(str(n), tuple(int(d) for d in s), str(k), int(b)) for n, s, k, b in items)
        except Exception as error:
            raise ValueError(f"secure-aggregation layout cannot be read: {type(error).__name__}: {error}") from None
        if len({e.name for e in entries}) != len(entries) or any(
                e.kind not in (FLOAT, INTEGER, MODULAR) or e.bound < 0 or min(e.shape, default=0) < 0
                for e in entries):
            raise ValueError("secure-aggregation layout repeats a name or has an unknown kind or a negative size")
        return cls(entries)


def encode(layout: Layout, values: Mapping[str, np.ndarray], clipping_range: float,
           quantization_range: int) -> np.ndarray:
    """One hospital's contribution as the layout's integer vector: float entries through Flower's ``quantize``
    (clipped, stochastic rounding to [0, quantization-range]), integer entries rounded and held to [0, bound]."""
    from flwr.common.secure_aggregation.quantization import quantize

    missing = [name for name in layout.names if name not in values]
    if missing or len(values) != len(layout.entries):
        raise ValueError(f"the contribution's parts {sorted(values)} are not the layout's {layout.names}")
    parts = []
    for entry in layout.entries:
        value = np.asarray(values[entry.name], dtype=np.float64)
        if value.shape != entry.shape:
            raise ValueError(f"contribution part {entry.name} has shape {value.shape}, the layout {entry.shape}")
        if not np.isfinite(value).all():
            raise ValueError(f"contribution part {entry.name} holds NaN or Inf")
        if entry.kind == FLOAT:
            part = quantize([value], clipping_range, quantization_range)[0]
        else:
            part = np.clip(np.rint(value), 0, entry.bound)
        parts.append(np.asarray(part, dtype=np.int64).ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def decode_sum(layout: Layout, total: np.ndarray, count: int, clipping_range: float,
               quantization_range: int) -> dict[str, np.ndarray]:
    """The sums of ``count`` hospitals' contributions from the unmasked vector: float entries in float64 (Flower's
    ``dequantize`` and its offset for ``count`` summands), integer entries as int64."""
    from flwr.common.secure_aggregation.quantization import dequantize

    if total.shape != (layout.size,):
        raise ValueError(f"the unmasked vector has {total.size} values, the layout {layout.size}")
    sums, offset = {}, 0
    for entry in layout.entries:
        part = np.asarray(total[offset:offset + entry.size], dtype=np.int64)
        offset += entry.size
        if entry.kind == FLOAT:
            value = dequantize([part], clipping_range, quantization_range)[0] - (count - 1) * clipping_range
        else:
            value = part
        sums[entry.name] = value.reshape(entry.shape)
    return sums


def modulus_bits(modulus: int) -> int:
    if modulus < 2 or modulus & (modulus - 1):
        raise ValueError(f"modulus {modulus} is not a power of 2")
    return modulus.bit_length() - 1


def packed_size(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack_values(values: np.ndarray, bits: int) -> np.ndarray:
    """Values below 2^bits as a little-endian bit stream, ``bits`` bits each (the masked vector on the wire: a
    masked value is uniform below the modulus, so this is as small as it gets)."""
    values = np.asarray(values).ravel()
    if bits in (8, 16, 32):
        return np.ascontiguousarray(values.astype(f"<u{bits // 8}")).view(np.uint8)
    width = 4 if bits <= 32 else 8
    chunks, step = [], 1 << 16  # 2^16 values of any width end on a byte boundary
    for start in range(0, values.size, step):
        part = np.ascontiguousarray(values[start:start + step].astype(f"<u{width}")).view(np.uint8)
        planes = np.unpackbits(part.reshape(-1, width), axis=1, bitorder="little")[:, :bits]
        chunks.append(np.packbits(planes.ravel(), bitorder="little"))
    return np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)


def unpack_values(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_values`; ValueError unless ``data`` is exactly ``count`` values' bytes."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 1 or data.size != packed_size(count, bits):
        raise ValueError(f"a masked vector of {count} values at {bits} bits is {packed_size(count, bits)} uint8 "
                         f"bytes, not {data.dtype} {data.shape}")
    if bits in (8, 16, 32):
        return data.view(f"<u{bits // 8}").astype(np.int64)
    width = 4 if bits <= 32 else 8
    result = np.zeros(count, dtype=np.int64)
    step = 1 << 16
    for start in range(0, count, step):
        n = min(step, count - start)
        first = start * bits // 8
        planes = np.unpackbits(data[first:first + packed_size(n, bits)], count=n * bits, bitorder="little")
        full = np.zeros((n, 8 * width), dtype=np.uint8)
        full[:, :bits] = planes.reshape(n, bits)
        result[start:start + n] = np.packbits(full, axis=1, bitorder="little").view(f"<u{width}").ravel()
    return result

