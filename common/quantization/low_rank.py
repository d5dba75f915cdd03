"""A round's change of a model as low-rank factors at b bits: QFedPolyp hospitals' uplink at ``qfedpolyp.low-rank-
bits``, and the server's downlink delta at ``qfedpolyp.downlink-low-rank-bits`` (docs/qfedpolyp.md, "Low-rank
updates").

Why: a hospital's update is far from random noise across a convolution's filters. Measured on the cpu preset
(``benchmarks.qfedpolyp.frontier``), 4-bit factors at 0.45 bits per entry keep 0.80 of the mean update the server
adds, where 1-bit signs of the top 30 % of blocks keep 0.45 for the same bits (over 20 rounds the two trail 32 bits
alike: docs/qfedpolyp.md). This is the PowerSGD idea (Vogels et al., 2019) with the factors computed exactly (an SVD)
since a hospital sends once a round.

Each float tensor of at least :data:`~common.quantization.sparse.DENSE_BELOW` entries and two or more dimensions is
read as a matrix M of ``shape[0]`` rows (a convolution: one row per output filter), and sent as two factors,
``left = U_r sqrt(S_r)`` (rows x r) and ``right = sqrt(S_r) V_r^T`` (r x columns), its best rank-r approximation, r
fixed by the tensor's shape, the bit-width and ``budget`` (:func:`rank_for`: the factors take at most ``budget`` bits
per entry of M, at least rank 1). Other tensors, and any whose factors would not be smaller than the tensor, go whole.
The factors and whole tensors travel in the dense codec's format (``common.quantization.codec``: per tensor min-max at
b bits, content ``update``), under the names ``<name>|left`` and ``<name>|right``: the receiver computes every name and
shape from its own model, the bit-width and the budget before decoding, so a payload of another rank, bit-width or
content is refused by the dense codec's own checks. What the factors leave out is the sender's to keep (error
feedback).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from common.arrays import NamedArrays

from .codec import PayloadError, decode_model, encode_model
from .sparse import DENSE_BELOW

LEFT, RIGHT = "|left", "|right"


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(rows, columns) a tensor of ``shape`` is factored as, or None where it travels whole."""
    size = math.prod(shape)
    if len(shape) < 2 or size < DENSE_BELOW:
        return None
    return shape[0], size // shape[0]


def rank_for(shape: tuple[int, ...], bits: int, budget: float) -> int:
    """The rank a tensor of ``shape`` is sent at: the largest whose two factors at ``bits`` bits take at most
    ``budget`` bits per entry of the tensor (at least 1); 0 where it goes whole (not a matrix, or factors no
    smaller)."""
    matrix = matrix_shape(shape)
    if matrix is None:
        return 0
    rows, columns = matrix
    rank = max(1, min(rows, columns, int(budget * rows * columns / (bits * (rows + columns)))))
    return rank if rank * (rows + columns) < rows * columns else 0


def factor_reference(reference: Mapping[str, np.ndarray], bits: int, budget: float) -> NamedArrays:
    """Zero arrays with the names, shapes and dtypes a low-rank change of ``reference`` travels as."""
    out: NamedArrays = {}
    for name, value in reference.items():
        rank = rank_for(tuple(value.shape), bits, budget) if np.asarray(value).dtype.kind == "f" else 0
        if rank:
            rows, columns = matrix_shape(tuple(value.shape))
            out[name + LEFT] = np.zeros((rows, rank), value.dtype)
            out[name + RIGHT] = np.zeros((rank, columns), value.dtype)
        else:
            out[name] = np.zeros(value.shape, value.dtype)
    return out


def factors(arrays: Mapping[str, np.ndarray], bits: int, budget: float) -> NamedArrays:
    """Each tensor's best rank-r factors (truncated SVD; r from :func:`rank_for`) or the tensor itself."""
    out: NamedArrays = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        rank = rank_for(tuple(value.shape), bits, budget) if value.dtype.kind == "f" else 0
        if not rank:
            out[name] = value
            continue
        if not np.isfinite(value).all():
            raise PayloadError(f"{name}: holds NaN or Inf, cannot be encoded")
        u, s, vt = np.linalg.svd(value.reshape(matrix_shape(value.shape)).astype(np.float64), full_matrices=False)
        root = np.sqrt(s[:rank])
        out[name + LEFT] = (u[:, :rank] * root).astype(value.dtype)
        out[name + RIGHT] = (root[:, None] * vt[:rank]).astype(value.dtype)
    return out


def encode_low_rank(arrays: Mapping[str, np.ndarray], bits: int, budget: float, content: str = "update") -> NamedArrays:
    """A change of a model (``arrays``) as low-rank factors at ``bits`` bits: ``{"header", "ranges", "data"}``."""
    check_budget(budget, bits)
    return encode_model(factors(arrays, bits, budget), bits, content=content)


def decode_low_rank(encoded: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], bits: int,
                    budget: float, expected_content: str | None = "update") -> NamedArrays:
    """The change ``encoded`` stands for, shaped like ``reference``: PayloadError where its tag is not ``bits``, its
    names, shapes or ranks are not those ``reference``, ``bits`` and ``budget`` give, or its data does not add up."""
    check_budget(budget, bits)
    decoded = decode_model(encoded, reference=factor_reference(reference, bits, budget), expected_bits=bits,
                           expected_content=expected_content)
    out: NamedArrays = {}
    for name, value in reference.items():
        if name in decoded:
            out[name] = decoded[name]
            continue
        out[name] = product(decoded[name + LEFT], decoded[name + RIGHT]).reshape(value.shape).astype(value.dtype)
    return out


def product(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``left @ right`` in float64, summed rank by rank in a fixed order rather than by BLAS (whose order depends on
    the CPU): a downlink delta is rebuilt by the server and every hospital, and the model they arrive at must be the
    same bits everywhere (its digest is checked)."""
    out = np.zeros((left.shape[0], right.shape[1]))
    for k in range(left.shape[1]):
        out += np.multiply.outer(left[:, k].astype(np.float64), right[k].astype(np.float64))
    return out


def check_budget(budget: float, bits: int) -> None:
    """A budget is a positive number of bits per entry below the factors' own bit-width (else nothing is saved)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 < budget < bits:
        raise PayloadError(f"low-rank budget {budget!r}: use bits per entry above 0 and below the bit-width {bits}")
