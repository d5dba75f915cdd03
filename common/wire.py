"""Payloads on Flower's wire: Payload <-> RecordDict, and the measured size of a serialised message.

The only module of ``common`` that imports Flower; the methods never see Flower types.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from common.methods.base import Payload

ARRAYS_PREFIX = "arrays."
CONFIG_KEY = "config"
METRICS_KEY = "metrics"


class MalformedPayload(ValueError):
    """A RecordDict that is not one of ours (unexpected records or undecodable arrays)."""


def to_recorddict(payload: Payload) -> RecordDict:
    records: dict[str, Any] = {
        f"{ARRAYS_PREFIX}{group}": ArrayRecord({name: Array(np.require(value, requirements="C")) for name, value in arrays.items()})
        for group, arrays in payload.arrays.items()
    }
    records[CONFIG_KEY] = ConfigRecord(dict(payload.config))
    records[METRICS_KEY] = MetricRecord({k: _metric(v) for k, v in payload.metrics.items()})
    return RecordDict(records)


def _metric(value: Any) -> float | int | list:
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        return [float(v) for v in np.asarray(value, dtype=np.float64).ravel()]
    return float(value)


def from_recorddict(content: RecordDict) -> Payload:
    payload = Payload()
    for key, record in content.array_records.items():
        if not key.startswith(ARRAYS_PREFIX):
            raise MalformedPayload(f"unexpected array record {key!r}")
        try:
            payload.arrays[key.removeprefix(ARRAYS_PREFIX)] = {name: array.numpy() for name, array in record.items()}
        except Exception as error:  # np.load of a corrupted array
            raise MalformedPayload(f"array record {key!r} cannot be decoded: {error}") from None
    config = content.config_records.get(CONFIG_KEY)
    payload.config = dict(config) if config is not None else {}
    metrics = content.metric_records.get(METRICS_KEY)
    payload.metrics = dict(metrics) if metrics is not None else {}
    return payload


def message_nbytes(message: Message) -> int:
    """Bytes of the serialised message: every object Flower deflates to send it (content and metadata)."""
    return int(sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values()))
