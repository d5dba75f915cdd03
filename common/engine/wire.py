"""Payloads on Flower's wire: Payload <-> RecordDict in Flower's own records, and the measured size of a message.

A payload travels the way Flower's own strategies and mods expect a message to look:

* the ``model`` array group as the ``ArrayRecord`` named ``"arrays"`` (Flower's ``arrayrecord_key``), one
  ``Array`` per state entry in state-dict order, so ``content["arrays"].to_torch_state_dict()`` loads into
  the hospital's model and Flower's DP wrappers clip exactly the model;
* every other array group (QFedPolyp's ``packed-model``, FedMEPD's ``anchors``) as an ``ArrayRecord`` of
  its own name;
* config (including bytes, e.g. FedMEPD's personal-filter masks) as the ``ConfigRecord`` ``"config"``;
* metrics (numbers) as the ``MetricRecord`` ``"metrics"``, lists of numbers (FedProIn's influence counts) as the
  ``MetricRecord`` ``"fedmed.list-metrics"``.

That is the ``per-tensor`` layout. Flower moves every Array (and its data chunk) as separate objects through
the SuperLink, each costing it milliseconds of work (benchmarks/results/overhead_arrays.md), so two more
layouts carry each array group in fewer Arrays:

* ``flat``: one 1-D Array per dtype of the group (``fedmed.flat.float32.0``: every float32 tensor, raveled and
  concatenated in order; a further ``.1``, ``.2``... every 16 MiB), and the tensors' names, Arrays and shapes
  as JSON in the ConfigRecord (``fedmed.layout.<record>``). Still weights: an update's norm, clipping and
  per-element noise or masks, as Flower's client-side DP and SecAgg+ mods compute them, are the same as
  tensor by tensor.
* ``packed``: one uint8 Array, ``fedmed.npz``, the group as an ``.npz`` archive (read without pickle);
  Flower's mods and wrappers then see bytes, not weights.

The only module of ``common`` that imports Flower; the methods never see Flower types.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SType

from common.payload import NamedArrays, OversizedArchive, Payload, check_archive_size, size_text

MODEL_RECORD = "arrays"  #: the ArrayRecord holding the ``model`` group (Flower's default ``arrayrecord_key``)
CONFIG_RECORD = "config"
METRICS_RECORD = "metrics"
#: a payload's lists of numbers (FedProIn's influence counts): method data beside the metrics, so that a Flower
#: user's mod reading the ``"metrics"`` record (TensorBoard's ``add_scalar`` of each) sees numbers only
LIST_METRICS_RECORD = "fedmed.list-metrics"
MODEL_GROUP = "model"
PACKED_ARRAY = "fedmed.npz"  #: the one Array of a packed group's ArrayRecord
FLAT_ARRAY = "fedmed.flat."  #: + a dtype's name: the Arrays of a flat group's ArrayRecord
FLAT_LAYOUT = "fedmed.layout."  #: + the record's name: the ConfigRecord entry listing a flat group's tensors
#: A flat Array holds at most this many bytes (or one larger tensor): serialising one Array takes a few copies
#: of it at once, which for a whole 100 MB model would be the ServerApp's peak memory.
FLAT_SEGMENT_BYTES = 16 * 2**20
LAYOUTS = ("per-tensor", "flat", "packed")


class MalformedPayload(ValueError):
    """A RecordDict that is not one of ours (unexpected records or undecodable content)."""


@dataclass(frozen=True)
class RecordKeys:
    """The names of the model's ArrayRecord and of the ConfigRecord (Flower's ``arrayrecord_key`` and
    ``configrecord_key``): a strategy chooses them, every message says which they are, replies use the same."""

    arrays: str = MODEL_RECORD
    config: str = CONFIG_RECORD

    def as_config(self) -> dict[str, str]:
        return {"fedmed.arrayrecord-key": self.arrays, "fedmed.configrecord-key": self.config}

    @classmethod
    def of(cls, content: RecordDict) -> "RecordKeys":
        """The names a received message uses: its one ConfigRecord says which they are (default: Flower's)."""
        configs = [(name, record) for name, record in content.items() if isinstance(record, ConfigRecord)]
        if len(configs) != 1:
            return cls()
        name, config = configs[0]
        if config.get("fedmed.configrecord-key") != name:  # not a message of ours naming its records
            return cls()
        arrays = config.get("fedmed.arrayrecord-key", MODEL_RECORD)
        return cls(arrays if isinstance(arrays, str) and arrays else MODEL_RECORD, name)

    def record_name(self, group: str) -> str:
        return self.arrays if group == MODEL_GROUP else group


DEFAULT_KEYS = RecordKeys()


def record_name(group: str) -> str:
    return DEFAULT_KEYS.record_name(group)


def metric_value(key: str, value: Any) -> int | float | list:
    """A value a MetricRecord accepts: an int, a float, or a flat list of one of them."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        flat = np.asarray(value).ravel()
        if flat.dtype.kind in "iub":
            return [int(v) for v in flat]
        if flat.dtype.kind == "f":
            return [float(v) for v in flat]
    raise TypeError(f"metric {key!r}: {type(value).__name__} {value!r} is not a number or a list of numbers")


def pack_arrays(arrays: NamedArrays) -> Array:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return Array(np.frombuffer(buffer.getvalue(), dtype=np.uint8))


def unpack_arrays(array: Array, name: str, limit: int | None = None) -> NamedArrays:
    data = array.numpy().tobytes()
    try:
        check_archive_size(data, limit, f"record {name!r}")
    except OversizedArchive as error:
        raise MalformedPayload(str(error)) from None
    except ValueError:
        pass  # damaged: the reading below says how
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except Exception as error:  # a truncated or corrupted archive
        raise MalformedPayload(f"record {name!r}: packed arrays cannot be read: {type(error).__name__}: {error}") \
            from None


def flatten_arrays(arrays: NamedArrays) -> tuple[ArrayRecord, str]:
    """The tensors raveled and concatenated in order into 1-D Arrays, one per dtype (more for a dtype whose
    tensors exceed :data:`FLAT_SEGMENT_BYTES`, split between tensors), and the JSON list of ``[name, Array,
    shape]`` that reads them back."""
    segments: dict[str, list[np.ndarray]] = {}
    filled: dict[str, tuple[str, int]] = {}  # dtype -> (its open segment, bytes in it)
    layout = []
    for name, value in arrays.items():
        value = np.asarray(value)
        dtype = value.dtype.name
        key, size = filled.get(dtype, (f"{dtype}.0", 0))
        if size and size + value.nbytes > FLAT_SEGMENT_BYTES:
            key, size = f"{dtype}.{int(key.rsplit('.', 1)[1]) + 1}", 0
        segments.setdefault(key, []).append(value.ravel())
        filled[dtype] = (key, size + value.nbytes)
        layout.append([name, key, list(value.shape)])
    flat = ArrayRecord({FLAT_ARRAY + key: Array(np.concatenate(parts)) for key, parts in segments.items()})
    return flat, json.dumps(layout, separators=(",", ":"))


def array_view(array: Array) -> np.ndarray:
    """An Array's values without a copy: a read-only view into the message's own bytes (the ``.npy`` header read
    by NumPy's reader); a copy, as ``Array.numpy()`` makes, where the bytes are in a form only ``np.load`` reads
    (Fortran order, a version 3 header)."""
    if array.stype != SType.NUMPY:
        return array.numpy()  # Flower's error for another serialisation
    stream = io.BytesIO(array.data)  # shares the bytes
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0)):
        return array.numpy()
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(stream)
    if fortran_order or dtype.hasobject:
        return array.numpy()
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(array.data, dtype=dtype, count=count, offset=stream.tell()).reshape(shape)


def unflatten_arrays(record: ArrayRecord, layout_json: Any, name: str, max_tensors: int | None = None,
                     copy: bool = True) -> NamedArrays:
    """The named tensors of a flat record (views into its Arrays, read-only views into the message's bytes without
    ``copy``); MalformedPayload unless ``layout_json`` lists tensors that use every value of every Array exactly
    once."""
    if not isinstance(layout_json, str):
        raise MalformedPayload(f"record {name!r} is flat but the config has no {FLAT_LAYOUT + name!r} text")
    try:
        entries = [(str(n), str(key), tuple(int(x) for x in shape)) for n, key, shape in json.loads(layout_json)]
        vectors = {key.removeprefix(FLAT_ARRAY): array.numpy() if copy else array_view(array)
                   for key, array in record.items()}
    except Exception as error:
        raise MalformedPayload(f"record {name!r}: flat layout cannot be read: {type(error).__name__}: {error}") \
            from None
    if max_tensors is not None and len(entries) > max_tensors:
        raise MalformedPayload(f"record {name!r}: flat layout lists {len(entries)} tensors, more than {max_tensors}")
    if len({n for n, _, _ in entries}) != len(entries) or any(x < 0 for _, _, s in entries for x in s):
        raise MalformedPayload(f"record {name!r}: flat layout repeats a name or has a negative size")
    arrays, used = {}, dict.fromkeys(vectors, 0)
    for tensor, key, shape in entries:
        vector = vectors.get(key)
        if vector is None or vector.ndim != 1:
            raise MalformedPayload(f"record {name!r}: tensor {tensor!r} is in Array {FLAT_ARRAY + key!r}, which is "
                                   "not a 1-D Array of the record")
        size = int(np.prod(shape, dtype=np.int64))
        if used[key] + size > vector.size:
            raise MalformedPayload(f"record {name!r}: the layout needs more values of {FLAT_ARRAY + key!r} than "
                                   f"its {vector.size}")
        arrays[tensor] = vector[used[key]:used[key] + size].reshape(shape)
        used[key] += size
    unused = {key: vectors[key].size - n for key, n in used.items() if vectors[key].size != n}
    if unused:
        raise MalformedPayload(f"record {name!r}: values the layout does not name: {unused}")
    return arrays


def to_recorddict(payload: Payload, layout: str = "per-tensor", keys: RecordKeys = DEFAULT_KEYS,
                  shared: dict | None = None) -> RecordDict:
    """``payload`` as Flower records, its arrays in ``layout`` (one of :data:`LAYOUTS`), the model and config
    records named by ``keys``. ``shared``: a dict kept across calls (one round's messages): an array group of the
    very same arrays as one encoded before gets that ArrayRecord again, not a copy of its own, so that a round's
    messages to every hospital hold one copy of the global model, not one each."""
    if layout not in LAYOUTS:
        raise ValueError(f"message layout {layout!r} is not one of {LAYOUTS}")
    content = RecordDict()
    config = dict(payload.config)
    for group, arrays in payload.arrays.items():
        name = keys.record_name(group)
        same = (name, layout, tuple((k, id(v)) for k, v in arrays.items()))
        if shared is not None and same in shared:
            content[name], flat_layout = shared[same][1:]
        else:
            content[name], flat_layout = encode_group(arrays, layout)
            if shared is not None:  # the arrays are kept with it, so their ids stay theirs while ``shared`` lives
                shared[same] = (tuple(arrays.values()), content[name], flat_layout)
        if flat_layout is not None:
            config[FLAT_LAYOUT + name] = flat_layout
    content[keys.config] = ConfigRecord(config)
    values = {k: metric_value(k, v) for k, v in payload.metrics.items()}
    content[METRICS_RECORD] = MetricRecord({k: v for k, v in values.items() if not isinstance(v, list)})
    lists = {k: v for k, v in values.items() if isinstance(v, list)}
    if lists:
        content[LIST_METRICS_RECORD] = MetricRecord(lists)
    return content


def encode_group(arrays: NamedArrays, layout: str) -> tuple[ArrayRecord, str | None]:
    """One array group as an ArrayRecord in ``layout``, and its flat layout's text (None unless flat)."""
    if layout == "packed":
        return ArrayRecord({PACKED_ARRAY: pack_arrays(arrays)}), None
    if layout == "flat":
        return flatten_arrays(arrays)
    return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in arrays.items()}), None


def declared_nbytes(array: Array) -> int:
    """The bytes an Array declares (its shape and dtype) and the bytes it carries, whichever is larger."""
    try:
        declared = int(np.prod(array.shape, dtype=np.float64)) * np.dtype(array.dtype).itemsize
    except (TypeError, ValueError):
        declared = 0
    return max(declared, len(array.data))


def record_nbytes(record: Any) -> int:
    """What a record holds, in bytes: an ArrayRecord's declared array sizes, a ConfigRecord's texts and bytes, a
    MetricRecord's numbers (8 bytes each), so a 100 MB text or a list of millions counts against the reply limit."""
    if isinstance(record, ArrayRecord):
        return sum(declared_nbytes(a) for a in record.values())
    total = 0
    for key, value in record.items():
        values = value if isinstance(value, list) else [value]
        total += len(key) + sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in values)
    return total


#: Characters a flat layout may spend per tensor it lists (a name of up to 200, its Array, its shape).
LAYOUT_CHARS_PER_TENSOR = 512


def tensor_count_problem(content: RecordDict, config: Any, max_tensors: int) -> str | None:
    """Why a message holds more tensors than ``max_tensors`` (None: it does not), counted before anything is
    decoded: the Arrays of its ArrayRecords and the length of its flat layouts' texts."""
    arrays = sum(len(record) for record in content.values() if isinstance(record, ArrayRecord))
    if arrays > max_tensors:
        return f"it holds {arrays} Arrays, more than the {max_tensors} a reply of this job may hold"
    layouts = [v for k, v in config.items() if k.startswith(FLAT_LAYOUT)] if isinstance(config, ConfigRecord) else []
    characters = sum(len(v) for v in layouts if isinstance(v, str))
    if characters > max_tensors * LAYOUT_CHARS_PER_TENSOR:
        return (f"its flat layouts take {characters} characters, more than {max_tensors} tensors of this job "
                "could need")
    return None


def from_recorddict(content: RecordDict, limit: int | None = None, keys: RecordKeys | None = None,
                    max_tensors: int | None = None, copy: bool = True) -> Payload:
    """The payload in a message's content (any layout); MalformedPayload for records of the wrong kind or
    content, for arrays that would take more than ``limit`` bytes or for more than ``max_tensors`` tensors (both
    checked before any is decoded). ``keys``: the record names (default: those the message's own config names).
    Without ``copy`` the arrays are read-only views into the message's bytes (but a packed group's), so a reply
    decoded costs no second copy of itself."""
    keys = keys or RecordKeys.of(content)
    config = content.get(keys.config)
    if max_tensors is not None:
        problem = tensor_count_problem(content, config, max_tensors)
        if problem:
            raise MalformedPayload(problem)
    if limit is not None:
        total = sum(record_nbytes(r) for r in content.values())
        if total > limit:
            raise MalformedPayload(f"its records take {size_text(total)}, more than the {size_text(limit)} "
                                   "allowed (screening.max-reply-mb)")
    payload = Payload()
    flat_layouts = {k: v for k, v in config.items() if k.startswith(FLAT_LAYOUT)} \
        if isinstance(config, ConfigRecord) else {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            group = MODEL_GROUP if name == keys.arrays else name
            if set(record) == {PACKED_ARRAY}:
                payload.arrays[group] = unpack_arrays(record[PACKED_ARRAY], name, limit)
                continue
            if record and all(key.startswith(FLAT_ARRAY) for key in record):
                payload.arrays[group] = unflatten_arrays(record, flat_layouts.pop(FLAT_LAYOUT + name, None), name,
                                                         max_tensors, copy)
                continue
            try:
                payload.arrays[group] = {key: array.numpy() if copy else array_view(array)
                                         for key, array in record.items()}
            except Exception as error:  # an Array whose bytes are not an array
                raise MalformedPayload(f"record {name!r} cannot be decoded: {type(error).__name__}: {error}") from None
        elif isinstance(record, ConfigRecord) and name == keys.config:
            payload.config = {k: v for k, v in record.items() if not k.startswith(FLAT_LAYOUT)}
        elif isinstance(record, MetricRecord) and name in (METRICS_RECORD, LIST_METRICS_RECORD):
            payload.metrics.update(record)
        else:
            raise MalformedPayload(f"unexpected {type(record).__name__} {name!r}")
    return payload


def message_nbytes(message: Message) -> int:
    """Bytes of the serialised message: every object Flower deflates to send it (content and metadata)."""
    from common.trust.audit import measure_message

    return measure_message(message)[0]


def from_flower_reply(content: RecordDict, limit: int | None = None, max_tensors: int | None = None,
                      copy: bool = True, with_arrays: bool = True) -> Payload:
    """The payload of a reply under Flower's FedAvg contract, from a ClientApp that trained the model itself: exactly
    one ArrayRecord (the model, one Array per tensor under its own names; none for an evaluate reply,
    ``with_arrays=False``) and exactly one MetricRecord (its sample count among the metrics), whatever their names, as
    Flower's ``validate_message_reply_consistency`` asks; ConfigRecords pass. MalformedPayload says what differs."""
    arrays = [(name, r) for name, r in content.items() if isinstance(r, ArrayRecord)]
    metrics = [(name, r) for name, r in content.items() if isinstance(r, MetricRecord)]
    wanted = 1 if with_arrays else 0
    if len(arrays) != wanted or len(metrics) != 1:
        raise MalformedPayload(f"a Flower ClientApp's {'training' if with_arrays else 'evaluation'} reply holds "
                               f"{len(arrays)} ArrayRecord(s) {[n for n, _ in arrays]} and {len(metrics)} "
                               f"MetricRecord(s) {[n for n, _ in metrics]}; Flower's FedAvg contract is {wanted} "
                               "ArrayRecord (the model) and 1 MetricRecord (with the sample count)")
    canonical = RecordDict({METRICS_RECORD: metrics[0][1]})
    if arrays:
        canonical[MODEL_RECORD] = arrays[0][1]
    return from_recorddict(canonical, limit, DEFAULT_KEYS, max_tensors, copy)
