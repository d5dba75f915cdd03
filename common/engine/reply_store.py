"""A round's accepted replies kept on disk until the round closes, so the server holds one reply in memory at a time.

The round engine (``common.engine.round_engine``) screens each reply as it arrives and writes the arrays the method will
aggregate here: one file per hospital and array group, the tensors back to back, their names, dtypes, shapes and
offsets kept in memory. The method then reads them as :class:`StoredArrays`, a read-only mapping that reads a
tensor from its file each time it is asked for (a fresh copy, nothing memory-mapped: mapped pages would count
toward the process's memory for as long as the mapping lives), so an aggregation that goes tensor by tensor holds
one hospital's tensor at a time besides its result. The folder (``<run>/.round-<n>``) is removed when the round
closes, whether it completed or failed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from common.payload import NamedArrays


class StoredArrays(Mapping):
    """Named arrays in one file of a :class:`ReplyStore`: ``arrays[name]`` reads that tensor from disk."""

    def __init__(self, path: Path, index: dict[str, tuple[int, np.dtype, tuple[int, ...]]]):
        self.path = path
        self.index = index  #: name -> (byte offset, dtype, shape)

    def __getitem__(self, name: str) -> np.ndarray:
        offset, dtype, shape = self.index[name]
        count = int(np.prod(shape, dtype=np.int64))
        value = np.fromfile(self.path, dtype=dtype, count=count, offset=offset) if count else np.empty(0, dtype)
        return value.reshape(shape)

    def flat_slice(self, name: str, start: int, stop: int) -> np.ndarray:
        """Values ``start:stop`` of the tensor raveled (C order), read from disk: a coordinate-wise rule takes a
        slice of every hospital's tensor without reading any whole."""
        offset, dtype, shape = self.index[name]
        stop = min(stop, int(np.prod(shape, dtype=np.int64)))
        if stop <= start:
            return np.empty(0, dtype)
        return np.fromfile(self.path, dtype=dtype, count=stop - start, offset=offset + start * dtype.itemsize)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def __repr__(self) -> str:
        return f"StoredArrays({self.path.name}: {len(self.index)} tensors)"


class ReplyStore:
    """The files of one round's replies, in ``folder`` (created empty; removed by :meth:`remove`)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if self.folder.exists():  # left by a round that was cut short (a killed server): that round is repeated
            shutil.rmtree(self.folder)
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        self.folder.mkdir(mode=0o700)  # single hospitals' updates: the server's user alone reads them
        self.nbytes = 0  #: bytes written this round
        self._files = 0

    def keep(self, arrays: Mapping[str, np.ndarray]) -> StoredArrays:
        """Write ``arrays`` to a file of their own; what reads them back."""
        self._files += 1
        path = self.folder / f"{self._files:06d}.bin"
        index: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
        offset = 0
        with open(path, "wb") as file:
            for name, value in arrays.items():
                value = np.require(value, requirements="C")  # (ascontiguousarray would make a 0-d array 1-d)
                if value.dtype.hasobject:
                    raise TypeError(f"{name} holds Python objects, which the server never keeps")
                index[name] = (offset, value.dtype, value.shape)
                value.tofile(file)
                offset += value.nbytes
        self.nbytes += offset
        return StoredArrays(path, index)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def materialized(arrays: Mapping[str, np.ndarray]) -> NamedArrays:
    """``arrays`` as a dict of arrays of their own (read from disk when they are :class:`StoredArrays`; copied
    when in memory, so that keeping a few small tensors beyond the round does not keep a whole reply alive)."""
    return {name: np.array(value, copy=True) for name, value in arrays.items()}


def selected(arrays: Mapping[str, np.ndarray], prefix: str | tuple[str, ...]) -> Mapping[str, np.ndarray]:
    """The arrays whose names start with ``prefix`` (or one of them), without reading any: a :class:`StoredArrays`
    of those, or a dict of the same (uncopied) arrays."""
    if isinstance(arrays, StoredArrays):
        return StoredArrays(arrays.path, {name: entry for name, entry in arrays.index.items()
                                          if name.startswith(prefix)})
    return {name: arrays[name] for name in arrays if name.startswith(prefix)}
