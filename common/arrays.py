"""Named NumPy arrays: moving model state in and out of torch, averaging it, and checking it.

A model travels as ``dict[name, ndarray]`` in its state-dict order, buffers included, so every
method, codec and checkpoint speaks the same language and nothing depends on positions.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Mapping

import numpy as np
import torch

from common.payload import NamedArrays


class ArraysMismatch(ValueError):
    """Arrays that do not fit the expected names, shapes or dtypes; the message says which."""


#: State entries that are never exchanged: BatchNorm's step counter. Ours run with momentum 0.1, for
#: which the counter is unused, and Flower's DP clipping scales every array of a reply in place,
#: which fails for an integer array.
LOCAL_ONLY_SUFFIXES = ("num_batches_tracked",)


def is_exchanged(name: str) -> bool:
    return not name.endswith(LOCAL_ONLY_SUFFIXES)


def model_arrays(model: torch.nn.Module) -> NamedArrays:
    """A model's state as named arrays, in state-dict order, without the entries that stay local."""
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in model.state_dict().items()
            if is_exchanged(name)}


def load_model_arrays(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Load named arrays into a model; every exchanged state entry must be present with its shape
    (the local-only counters may be given, and are otherwise left as they are)."""
    expected = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items() if is_exchanged(k)}
    check_like({k: v for k, v in arrays.items() if is_exchanged(k)}, expected, "model arrays")
    with warnings.catch_warnings():  # a read-only view (a server's global model shares a message's bytes) is only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        state = {name: torch.from_numpy(np.require(value, requirements="C")) for name, value in arrays.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(is_exchanged(name) for name in missing):
        raise ArraysMismatch(f"model arrays: missing {missing[:3]}, unexpected {unexpected[:3]}")


def check_like(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], what: str,
               require_finite: bool = True, exact_dtype: bool = False) -> None:
    """Raise :class:`ArraysMismatch` unless ``arrays`` has reference's names, shapes and finite floats, and (with
    ``exact_dtype``: a hospital's reply) its dtypes exactly, so no reply can turn the global model into float16."""
    missing = [k for k in reference if k not in arrays]
    extra = [k for k in arrays if k not in reference]
    if missing or extra:
        raise ArraysMismatch(f"{what}: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                             f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for name, ref in reference.items():
        value = arrays[name]
        if value.shape != ref.shape:
            raise ArraysMismatch(f"{what}: {name} has shape {value.shape}, expected {ref.shape}")
        if value.dtype.kind != ref.dtype.kind or (exact_dtype and value.dtype != ref.dtype):
            raise ArraysMismatch(f"{what}: {name} has dtype {value.dtype}, expected {ref.dtype}")
        if require_finite and value.dtype.kind == "f" and not np.isfinite(value).all():
            raise ArraysMismatch(f"{what}: {name} holds NaN or Inf")


def is_float(array: np.ndarray) -> bool:
    return array.dtype.kind == "f"


#: Values of a tensor :func:`weighted_average` sums at once (in float64): a slice, not the whole of a large tensor,
#: so the sum holds a few MB besides its result whatever the tensor's size.
AVERAGE_SLICE = 2**20


def weighted_average(arrays: Iterable[Mapping[str, np.ndarray]], weights: Iterable[float]) -> NamedArrays:
    """FedAvg of named arrays, in float64, cast back to each array's dtype.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are counters, not weights: they take the
    largest value instead of an average. Each tensor is summed a slice of its values at a time, each hospital's
    slice read alone where its arrays are on disk (``common.engine.reply_store``): every value is the same sum, in the
    same order, as over whole tensors.
    """
    arrays, weights = list(arrays), np.asarray([float(w) for w in weights], dtype=np.float64)
    if not arrays or weights.sum() <= 0:
        raise ValueError("weighted_average needs at least one array set with positive weight")
    weights = weights / weights.sum()
    result: NamedArrays = {}
    for name in arrays[0]:
        first = np.asarray(arrays[0][name])
        shape, dtype = first.shape, first.dtype
        del first
        if dtype.kind != "f":
            result[name] = np.asarray(np.max(np.stack([item[name] for item in arrays]), axis=0), dtype=dtype)
            continue
        average = np.empty(int(np.prod(shape, dtype=np.int64)), dtype=dtype)
        for start in range(0, average.size, AVERAGE_SLICE):
            stop = min(start + AVERAGE_SLICE, average.size)
            total = np.zeros(stop - start, dtype=np.float64)
            for item, w in zip(arrays, weights):
                total += w * flat_values(item, name, start, stop)
            average[start:stop] = total
        result[name] = average.reshape(shape)
    return result


def flat_values(arrays: Mapping[str, np.ndarray], name: str, start: int, stop: int) -> np.ndarray:
    """Values ``start:stop`` of tensor ``name`` raveled; arrays that can read a slice themselves (the reply store's
    ``StoredArrays``, on disk) read only it."""
    flat_slice = getattr(arrays, "flat_slice", None)
    if flat_slice is not None:
        return flat_slice(name, start, stop)
    return np.asarray(arrays[name]).reshape(-1)[start:stop]


ROBUST_CHUNK_BYTES = 64 * 2**20


def robust_average(arrays: list[Mapping[str, np.ndarray]], rule: str, trim_fraction: float = 0.2) -> NamedArrays:
    """Coordinate-wise median (Flower's FedMedian) or trimmed mean (Flower's FedTrimmedAvg, its ``trim_mean``)
    of named arrays, unweighted; integer arrays take the median. Each tensor goes a slice of coordinates at a time,
    the same slice of every hospital's (read from disk alone where the arrays are there: :func:`flat_values`);
    every coordinate's value is what the rule gives over the whole tensor at once."""
    result: NamedArrays = {}
    per_slice = max(2, ROBUST_CHUNK_BYTES // (8 * len(arrays)))
    for name in arrays[0]:
        first = np.asarray(arrays[0][name])
        size = first.size
        slices = max(1, -(-size // per_slice))
        step = -(-size // slices)  # slices of (nearly) equal length, none of a single value but a 1-value tensor's
        value = np.empty(size, dtype=first.dtype)
        for start in range(0, size, step):
            stacked = np.stack([flat_values(item, name, start, start + step) for item in arrays])
            if rule == "trimmed-mean" and first.dtype.kind == "f":
                from flwr.serverapp.strategy.fedtrimmedavg import trim_mean  # Flower's own rule, where Flower is

                part = trim_mean(stacked.astype(np.float64), trim_fraction)
            else:
                part = np.median(stacked, axis=0)
            value[start:start + step] = np.asarray(part).astype(first.dtype)
        result[name] = value.reshape(first.shape)
    return result


def total_nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    return int(sum(a.nbytes for a in arrays.values()))
