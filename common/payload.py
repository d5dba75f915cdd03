"""One message's content as plain data (named NumPy arrays, config, metrics), and its bytes form.

Free of torch and Flower on purpose: the ClientApp process Flower starts for every message
imports only this to hand a payload to the hospital's warm worker (``client_app/worker.py``).
The bytes form is an ``.npz`` archive read with ``allow_pickle=False``: arrays under
``arrays/<group>/<name>``, bytes config values under ``bytes/<key>``, and everything else in one
JSON header.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

NamedArrays = dict[str, np.ndarray]
ConfigValue = Union[bool, int, float, str, bytes, list]

_HEADER = "header.json"


@dataclass
class Payload:
    """One message's content: named array groups, scalar/bytes config and numeric metrics."""

    arrays: dict[str, NamedArrays] = field(default_factory=dict)
    config: dict[str, ConfigValue] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Raw content size (array bytes + config bytes), the in-process stand-in for measured traffic."""
        array_bytes = sum(a.nbytes for group in self.arrays.values() for a in group.values())
        config_bytes = sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in self.config.values())
        return int(array_bytes + config_bytes + 8 * len(self.metrics))


def payload_to_bytes(payload: Payload, header: dict[str, Any] | None = None) -> bytes:
    """``payload`` (and a JSON-able ``header`` travelling with it) as one ``.npz`` archive."""
    entries: dict[str, np.ndarray] = {}
    for group, arrays in payload.arrays.items():
        for name, value in arrays.items():
            entries[f"arrays/{group}/{name}"] = np.asarray(value)
    plain_config = {}
    for key, value in payload.config.items():
        if isinstance(value, bytes):
            entries[f"bytes/{key}"] = np.frombuffer(value, dtype=np.uint8)
        else:
            plain_config[key] = value
    meta = {"header": header or {}, "config": plain_config, "metrics": payload.metrics,
            "groups": list(payload.arrays)}
    entries[_HEADER] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **entries)
    return buffer.getvalue()


def size_text(nbytes: float) -> str:
    """A size as its bytes, with megabytes beside them from 1 MB on: a limit of 1,000 bytes never reads as "0.0 MB"."""
    nbytes = int(nbytes)
    return f"{nbytes:,} bytes" + (f" ({nbytes / 1e6:,.1f} MB)" if nbytes >= 1_000_000 else "")


class OversizedArchive(ValueError):
    """An archive that would take more memory than allowed once decompressed (checked before it is)."""


def check_archive_size(data: bytes, limit: int | None, what: str = "archive") -> None:
    """Raise OversizedArchive (or ValueError for a damaged archive) unless every entry of the ``.npz``
    ``data`` declares a size that adds up to at most ``limit`` bytes, and every array's header a shape that
    fits its entry. Reads only the zip directory and the array headers: a few kB of deflated zeros cannot
    expand to gigabytes before anything is checked."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
            declared = sum(entry.file_size for entry in entries)
            if limit is not None and declared > limit:
                raise OversizedArchive(f"{what}: {size_text(declared)} once decompressed, more than the "
                                       f"{size_text(limit)} allowed")
            for entry in entries:
                with archive.open(entry) as handle:
                    version = np.lib.format.read_magic(handle)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read_header(handle)
                if int(np.prod(shape, dtype=np.float64)) * dtype.itemsize > entry.file_size:
                    raise OversizedArchive(f"{what}: entry {entry.filename!r} declares shape {shape} of {dtype}, "
                                           f"more than its {entry.file_size} bytes")
    except (zipfile.BadZipFile, EOFError) as error:
        raise ValueError(f"{what} is not a readable .npz archive ({error})") from None


def payload_from_bytes(data: bytes, limit: int | None = None) -> tuple[Payload, dict[str, Any]]:
    """The payload and header written by :func:`payload_to_bytes` (at most ``limit`` bytes once decoded)."""
    check_archive_size(data, limit, "payload")
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        meta = json.loads(archive[_HEADER].tobytes().decode())
        payload = Payload(arrays={group: {} for group in meta["groups"]}, config=dict(meta["config"]),
                          metrics=dict(meta["metrics"]))
        for key in archive.files:
            kind, _, rest = key.partition("/")
            if kind == "arrays":
                group, _, name = rest.partition("/")
                payload.arrays[group][name] = archive[key]
            elif kind == "bytes":
                payload.config[rest] = archive[key].tobytes()
    return payload, meta["header"]
