"""A sparse, low-bit change of a model: only a fraction of each tensor's entries travel, each at b bits, with
their positions in the fewest bytes the codec finds for that tensor. QFedPolyp hospitals send their round's
update this way (``qfedpolyp.sparsity < 1``) and the server its downlink delta (``qfedpolyp.downlink='delta'``).

Which entries: per tensor, the ``k = ceil(sparsity * n)`` of largest magnitude (``top-k``) or ``k`` drawn at
random (``random-k``, seeded); tensors of fewer than :data:`DENSE_BELOW` entries (biases, BatchNorm scales) go
whole, their positions would cost more than they save. With ``block = B > 1`` the units are blocks of B
consecutive entries of the flattened tensor (the last one padded with zeros): ``k = ceil(sparsity * n / B)``
blocks of largest L2 norm (or drawn at random) travel whole, so each kept entry costs 1/B of a position and more
entries fit in the same bytes; the header's ``block`` says B (absent: 1). The kept values are quantised as the
dense codec does (``common.quantization.codec``: per tensor min-max over the kept values, codes packed at exactly
b bits; b = 1: their signs times the kept values' mean magnitude; b = 32 sends the floats). What is not sent is
the sender's to keep (error feedback).

Where they are, per tensor, whichever is smaller (ties: the bitmap), tagged in the header:

``dense``   every entry is sent, no positions
``bitmap``  one bit per entry (or block), little-endian bit order; bits past the tensor's end must be 0
``gaps``    the gaps between sorted positions (the first position, then each minus the one before; a gap of 0
            would repeat a position), as codes of ``w`` bits; a gap of ``E = 2^w - 1`` or more is written as
            escape codes of value ``E`` followed by the remainder (below ``E``), so a few long gaps do not widen
            every code. Each position is the running sum of the codes up to and including its last one. ``w`` is
            chosen per tensor for the fewest bytes (``w`` with no escapes is "the fewest bits of the longest gap").

An encoded change is three named arrays, like the dense codec's:

``header`` (uint8)   compact JSON: format, version, the bit-width tag, the content (a hospital's ``update``, the
                     server's downlink ``delta``), the block size, and per tensor ``[name, shape, dtype, kept,
                     index, width, codes]`` (kept entries, or kept blocks where positions are sent; index
                     encoding; for ``gaps`` the code width and the number of codes, else 0 0)
``ranges`` (float64) ``(m, 2)``: min and step of each tensor that has kept entries (none at b = 32)
``data``   (uint8)   per tensor its position bytes, then its value bytes, each tensor on a byte boundary

Decoding computes every tensor's byte length from the header before reading anything, checks names, shapes and
dtypes against the receiver's model before allocating, and refuses (:class:`PayloadError`, with the reason) a
wrong or unexpected tag, more or fewer kept entries than the sparsity assigned, truncated or padded data,
positions out of range, repeated or unsorted, a bitmap or gap stream that disagrees with its count, non-finite
or negative ranges (at 1 bit: ranges other than ``(-scale, 2 scale)``) and NaN values.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

import numpy as np

from common.arrays import NamedArrays

from .codec import (
    PayloadError,
    check_bit_width,
    check_ranges,
    dequantise,
    pack_codes,
    packed_nbytes,
    parse_header,
    quantise,
    unpack_codes,
)

FORMAT = "fedmed-sparse-change"
VERSION = 1
CONTENTS = ("update", "delta")  #: a hospital's round update; the server's downlink change of the hospitals' model
SPARSIFIERS = ("top-k", "random-k")
INDEX_ENCODINGS = ("dense", "bitmap", "gaps")
FLOAT_DTYPES = ("float16", "float32", "float64")
DENSE_BELOW = 1024  #: tensors with fewer entries travel whole at every sparsity
MAX_GAP_WIDTH = 32
MAX_BLOCK = 4096


def block_count(size: int, block: int) -> int:
    """How many blocks of ``block`` entries a tensor of ``size`` entries is cut into (the last may be short)."""
    return -(-size // block)


def kept_count(size: int, sparsity: float, block: int = 1) -> int:
    """What of a tensor's ``size`` entries travels at ``sparsity`` (fraction kept; 1.0: all): ``size`` where it goes
    whole, else the number of kept units (entries, or blocks of ``block`` entries)."""
    if sparsity >= 1.0 or size < DENSE_BELOW:
        return size
    units = block_count(size, block)
    kept = max(1, min(units, math.ceil(sparsity * units - 1e-9)))
    return size if kept == units and block == 1 else kept


def select(values: np.ndarray, k: int, sparsify: str, rng: np.random.Generator | None = None) -> np.ndarray:
    """Sorted int64 positions of the ``k`` entries of flat ``values`` to send: largest magnitude, or at random."""
    if sparsify == "top-k":
        chosen = np.argpartition(np.abs(values), values.size - k)[values.size - k:]
    elif sparsify == "random-k":
        chosen = (rng or np.random.default_rng()).choice(values.size, size=k, replace=False)
    else:
        raise ValueError(f"sparsify {sparsify!r} is not one of {SPARSIFIERS}")
    return np.sort(chosen).astype(np.int64)


def blocks_of(flat: np.ndarray, block: int) -> np.ndarray:
    """``flat`` as rows of ``block`` entries, the last row padded with zeros."""
    padded = np.zeros(block_count(flat.size, block) * block, dtype=flat.dtype)
    padded[:flat.size] = flat
    return padded.reshape(-1, block)


def entries_of(positions: np.ndarray, block: int) -> np.ndarray:
    """The entry positions (in the padded tensor) the kept block ``positions`` cover, in order."""
    return (positions[:, None] * block + np.arange(block)).ravel()


# --- positions <-> bytes --------------------------------------------------------------------------
def gap_codes(indices: np.ndarray) -> tuple[int, np.ndarray]:
    """(width, codes) of sorted, distinct ``indices`` as escape-coded gaps at the width that takes fewest bits."""
    gaps = np.diff(indices.astype(np.int64), prepend=0)
    largest = int(gaps.max()) if gaps.size else 0
    best_width, best_bits = 1, None
    for width in range(1, min(MAX_GAP_WIDTH, max(1, largest.bit_length()) + 1) + 1):
        bits = width * int((gaps // ((1 << width) - 1)).sum() + gaps.size)
        if best_bits is None or bits < best_bits:
            best_width, best_bits = width, bits
    escape = (1 << best_width) - 1
    repeats = gaps // escape
    codes = np.full(int(repeats.sum() + gaps.size), escape, dtype=np.int64)
    codes[np.cumsum(repeats + 1) - 1] = gaps % escape
    return best_width, codes


def indices_from_gap_codes(codes: np.ndarray, width: int) -> tuple[np.ndarray, bool]:
    """(positions, complete) of a gap code stream; ``complete`` is False when it ends inside a gap."""
    codes = codes.astype(np.int64)
    ends = codes != (1 << width) - 1
    return np.cumsum(codes)[ends], bool(codes.size == 0 or ends[-1])


def check_indices(indices: np.ndarray, size: int, name: str) -> None:
    """Refuse positions that are not strictly increasing, or not within ``0..size-1``."""
    if indices.size == 0:
        return
    steps = np.diff(indices)
    if (steps == 0).any():
        raise PayloadError(f"{name}: position {int(indices[1:][steps == 0][0])} is repeated")
    if (steps < 0).any():
        where = int(np.flatnonzero(steps < 0)[0])
        raise PayloadError(f"{name}: positions are not sorted ({int(indices[where])} before "
                           f"{int(indices[where + 1])})")
    if int(indices.min()) < 0 or int(indices.max()) >= size:
        bad = int(indices.max()) if int(indices.max()) >= size else int(indices.min())
        raise PayloadError(f"{name}: position {bad} is out of range for its {size} entries")


# --- whole changes --------------------------------------------------------------------------------
def check_block(block: Any, what: str = "block") -> int:
    """A block size: a whole number of entries from 1 to :data:`MAX_BLOCK`."""
    if not _is_count(block) or not 1 <= block <= MAX_BLOCK:
        raise PayloadError(f"{what} {block!r} is not a whole number of entries from 1 to {MAX_BLOCK}")
    return block


def encode_sparse(arrays: Mapping[str, np.ndarray], bits: int, sparsity: float, sparsify: str = "top-k",
                  seed: int | Sequence[int] = 0, content: str = "update", block: int = 1) -> NamedArrays:
    """Float arrays (a change of a model) as ``{"header", "ranges", "data"}``: per tensor the entries
    :func:`kept_count` keeps (chosen by ``sparsify``; ``random-k`` draws with ``seed`` and the tensor's position;
    ``block > 1``: whole blocks of that many entries, ranked by their L2 norm), at ``bits`` bits, their positions as
    a bitmap or gap codes, whichever is smaller."""
    bits = check_bit_width(bits)
    block = check_block(block)
    if content not in CONTENTS:
        raise PayloadError(f"content {content!r} is not one of {CONTENTS}")
    if not 0.0 < sparsity <= 1.0:
        raise ValueError(f"sparsity {sparsity!r}: the fraction of entries kept must be in (0, 1]")
    seeds = [int(s) & 0xFFFFFFFF for s in (seed if isinstance(seed, Sequence) else [seed])]
    tensors, ranges, chunks = [], [], []
    for position, (name, value) in enumerate(arrays.items()):
        value = np.asarray(value)
        if value.dtype.name not in FLOAT_DTYPES:
            raise PayloadError(f"{name}: dtype {value.dtype} cannot be sent sparse (float tensors only)")
        if not np.isfinite(value).all():
            raise PayloadError(f"{name}: holds NaN or Inf, cannot be encoded")
        flat = value.ravel()
        kept = kept_count(flat.size, sparsity, block)
        index, width, count, index_chunk = "dense", 0, 0, np.zeros(0, np.uint8)
        if kept < flat.size:
            rows = blocks_of(flat, block)
            scores = rows[:, 0] if block == 1 else np.sqrt(np.square(rows.astype(np.float64)).sum(axis=1))
            positions = select(scores, kept, sparsify, np.random.default_rng([*seeds, position]))
            gap_width, gaps = gap_codes(positions)
            if packed_nbytes(gaps.size, gap_width) < packed_nbytes(rows.shape[0], 1):
                index, width, count, index_chunk = "gaps", gap_width, int(gaps.size), pack_codes(gaps, gap_width)
            else:
                marks = np.zeros(rows.shape[0], np.uint8)
                marks[positions] = 1
                index, index_chunk = "bitmap", np.packbits(marks, bitorder="little")
            flat = rows[positions].ravel()
        tensors.append([name, list(value.shape), value.dtype.name, kept, index, width, count])
        chunks.append(index_chunk)
        if bits < 32 and kept:
            codes, low, step = quantise(flat, bits)
            ranges.append((low, step))
            chunks.append(pack_codes(codes, bits))
        elif kept:
            chunks.append(np.frombuffer(np.ascontiguousarray(flat).tobytes(), dtype=np.uint8))
    header = {"format": FORMAT, "version": VERSION, "bits": bits, "content": content, "block": block,
              "tensors": tensors}
    return {
        "header": np.frombuffer(json.dumps(header, separators=(",", ":")).encode(), dtype=np.uint8).copy(),
        "ranges": np.asarray(ranges, dtype=np.float64).reshape(-1, 2),
        "data": np.concatenate(chunks) if chunks else np.zeros(0, np.uint8),
    }


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _well_formed(entry: Any, block: int) -> bool:
    if not (isinstance(entry, list) and len(entry) == 7 and isinstance(entry[0], str) and isinstance(entry[1], list)
            and all(_is_count(d) for d in entry[1]) and entry[2] in FLOAT_DTYPES
            and all(_is_count(v) for v in (entry[3], entry[5], entry[6])) and entry[4] in INDEX_ENCODINGS):
        return False
    _, shape, _, kept, index, width, codes = entry
    size = math.prod(shape)
    if index == "dense":
        return kept == size and width == 0 and codes == 0
    if kept > block_count(size, block):
        return False
    if index == "bitmap":
        return width == 0 and codes == 0
    return 1 <= width <= MAX_GAP_WIDTH and codes >= kept and (codes > 0) == (kept > 0)


def read_sparse_header(encoded: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The checked header of a sparse change (its ``bits`` is the bit-width tag)."""
    header = parse_header(encoded, FORMAT, VERSION, "encoded change")
    if header.get("content") not in CONTENTS:
        raise PayloadError(f"header's content {header.get('content')!r} is not one of {CONTENTS}")
    block = header.setdefault("block", 1)
    check_block(block, "header's block")
    tensors = header.get("tensors")
    if not isinstance(tensors, list) or not all(_well_formed(entry, block) for entry in tensors):
        bad = (next((entry for entry in tensors if not _well_formed(entry, block)), None)
               if isinstance(tensors, list) else None)
        raise PayloadError("header's tensor list is malformed (want [name, shape, float dtype, kept <= entries "
                           f"or blocks, dense|bitmap|gaps, width, codes] entries, consistent with each other): "
                           f"{str(bad)[:200]}")
    if len({entry[0] for entry in tensors}) != len(tensors):
        raise PayloadError("header names a tensor twice")
    return header


def _index_nbytes(entry: list, block: int) -> int:
    _, shape, _, _, index, width, codes = entry
    if index == "dense":
        return 0
    return packed_nbytes(block_count(math.prod(shape), block), 1) if index == "bitmap" else packed_nbytes(codes, width)


def _values_sent(entry: list, block: int) -> int:
    """Entries whose values travel: all of a dense tensor's, else each kept block's (padding included)."""
    return entry[3] if entry[4] == "dense" else entry[3] * block


def _value_nbytes(entry: list, bits: int, block: int) -> int:
    sent = _values_sent(entry, block)
    return packed_nbytes(sent, bits) if bits < 32 else sent * np.dtype(entry[2]).itemsize


def sparse_nbytes(header: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(position bytes, value bytes) of every tensor a checked header describes."""
    block = header["block"]
    return [(_index_nbytes(entry, block), _value_nbytes(entry, header["bits"], block)) for entry in header["tensors"]]


def decode_sparse(encoded: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None = None,
                  expected_bits: int | None = None, expected_content: str | None = None,
                  expected_sparsity: float | None = None, expected_block: int | None = None) -> NamedArrays:
    """The dense arrays a sparse change stands for (zero where no entry was sent).

    ``expected_bits``: the tag the sender was told to use; ``expected_content``: ``update`` or ``delta``;
    ``expected_sparsity``: the fraction the sender was told to keep (each tensor must keep exactly
    :func:`kept_count` entries or blocks); ``expected_block``: the block size it was told to use; ``reference``:
    the names, shapes and dtypes the result must have. Anything that does not match is a :class:`PayloadError`.
    """
    header = read_sparse_header(encoded)
    bits, tensors, block = header["bits"], header["tensors"], header["block"]
    if expected_bits is not None and bits != expected_bits:
        raise PayloadError(f"bit-width tag is {bits}, but {expected_bits} was assigned")
    if expected_block is not None and block != expected_block:
        raise PayloadError(f"positions are of blocks of {block} entries, but {expected_block} was assigned")
    if expected_content is not None and header["content"] != expected_content:
        raise PayloadError(f"payload is tagged {header['content']!r}, expected {expected_content!r}")
    if reference is not None:  # before anything is allocated: a header cannot declare a tensor of any size
        names = [entry[0] for entry in tensors]
        missing, extra = [k for k in reference if k not in names], [k for k in names if k not in reference]
        if missing or extra:
            raise PayloadError(f"encoded change: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                               f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
        for name, shape, dtype, *_ in tensors:
            if tuple(shape) != reference[name].shape:
                raise PayloadError(f"encoded change: {name} has shape {tuple(shape)}, expected {reference[name].shape}")
            if np.dtype(dtype) != reference[name].dtype:
                raise PayloadError(f"{name} has dtype {dtype}, expected {reference[name].dtype}")
    if expected_sparsity is not None:
        for name, shape, _, kept, *_ in tensors:
            assigned = kept_count(math.prod(shape), expected_sparsity, block)
            if kept != assigned:
                units = "entries" if block == 1 or assigned == math.prod(shape) else f"blocks of {block}"
                total = math.prod(shape) if units == "entries" else block_count(math.prod(shape), block)
                raise PayloadError(f"{name}: {kept} of its {total} {units} sent, but {assigned} were "
                                   f"assigned (sparsity {expected_sparsity:g})")
    ranges, data = np.asarray(encoded["ranges"]), np.asarray(encoded["data"])
    check_ranges(ranges, [entry[0] for entry in tensors if bits < 32 and entry[3] > 0], bits)
    if data.dtype != np.uint8 or data.ndim != 1:
        raise PayloadError(f"data must be a 1-D uint8 array, got {data.dtype} {data.shape}")
    sizes = sparse_nbytes(header)
    needed = sum(a + b for a, b in sizes)
    if data.size != needed:
        raise PayloadError(f"data holds {data.size} bytes, but the header's {len(tensors)} tensors at {bits} bits "
                           f"need {needed} ({'truncated' if data.size < needed else 'padded'})")
    result: NamedArrays = {}
    offset, next_range = 0, 0
    for (name, shape, dtype, kept, index, width, codes), (index_size, value_size) in zip(tensors, sizes):
        size = math.prod(shape)
        units = size if index == "dense" else block_count(size, block)
        index_chunk, value_chunk = data[offset:offset + index_size], data[offset + index_size:
                                                                         offset + index_size + value_size]
        offset += index_size + value_size
        positions = None
        if index == "bitmap":
            marks = np.unpackbits(index_chunk, bitorder="little")
            if marks[units:].any():
                raise PayloadError(f"{name}: bitmap marks a position past its {units} "
                                   f"{'entries' if block == 1 else 'blocks'} (out of range)")
            positions = np.flatnonzero(marks[:units])
            if positions.size != kept:
                raise PayloadError(f"{name}: bitmap marks {positions.size} positions, the header says {kept}")
        elif index == "gaps":
            positions, complete = indices_from_gap_codes(unpack_codes(index_chunk, codes, width), width)
            if not complete:
                raise PayloadError(f"{name}: its position codes end inside a gap (escape code last)")
            if positions.size != kept:
                raise PayloadError(f"{name}: its position codes hold {positions.size} positions, the header says "
                                   f"{kept}")
            check_indices(positions, units, name)
        sent = _values_sent([name, shape, dtype, kept, index, width, codes], block)
        if bits < 32 and kept:
            low, step = ranges[next_range]
            next_range += 1
            values = dequantise(unpack_codes(value_chunk, sent, bits), low, step, np.dtype(dtype))
        else:
            values = np.frombuffer(value_chunk.tobytes(), dtype=np.dtype(dtype))
        if not np.isfinite(values).all():
            raise PayloadError(f"{name} holds NaN or Inf")
        if positions is None:
            dense = values.copy()
        else:
            dense = np.zeros(units * block, dtype=np.dtype(dtype))
            dense[entries_of(positions, block)] = values
            dense = dense[:size]
        result[name] = dense.reshape(shape)
    if reference is not None:
        result = {name: result[name] for name in reference}  # the receiver's order
    return result


def sparse_summary(encoded: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Bytes of an encoded change by part (header, ranges, positions, values), and its tensors by index encoding."""
    header = read_sparse_header(encoded)
    sizes = sparse_nbytes(header)
    summary = {"header": int(np.asarray(encoded["header"]).nbytes), "ranges": int(np.asarray(encoded["ranges"]).nbytes),
               "positions": sum(a for a, _ in sizes), "values": sum(b for _, b in sizes)}
    for encoding in INDEX_ENCODINGS:
        summary[f"tensors-{encoding}"] = sum(1 for entry in header["tensors"] if entry[4] == encoding)
    return summary
