"""Payloads on Flower's wire: Payload <-> RecordDict, and the measured size of a serialised message.

A payload travels as one byte array (``common.payload.payload_to_bytes``: an ``.npz`` archive, no
pickle) in one ArrayRecord. Flower moves every array of a message as separate objects, each a
request to the SuperLink; a model with dozens of tensors as dozens of arrays cost seconds per
round in pushes and pulls on a busy machine, one blob costs a handful of requests (large blobs
still travel in Flower's chunks). The only module of ``common`` that imports Flower; the methods
never see Flower types.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from common.payload import Payload, payload_from_bytes, payload_to_bytes

PAYLOAD_RECORD = "fedmed.payload"
PAYLOAD_ARRAY = "npz"


class MalformedPayload(ValueError):
    """A RecordDict that is not one of ours (unexpected records or undecodable content)."""


def to_recorddict(payload: Payload) -> RecordDict:
    blob = np.frombuffer(payload_to_bytes(payload), dtype=np.uint8)
    return RecordDict({PAYLOAD_RECORD: ArrayRecord({PAYLOAD_ARRAY: Array(blob)})})


def from_recorddict(content: RecordDict) -> Payload:
    unexpected = sorted(set(content) - {PAYLOAD_RECORD})
    if unexpected:
        raise MalformedPayload(f"unexpected record {unexpected[0]!r}")
    record = content.array_records.get(PAYLOAD_RECORD)
    if record is None or set(record) != {PAYLOAD_ARRAY}:
        raise MalformedPayload(f"no {PAYLOAD_RECORD!r} record holding one {PAYLOAD_ARRAY!r} array")
    try:
        payload, _ = payload_from_bytes(record[PAYLOAD_ARRAY].numpy().tobytes())
    except Exception as error:  # a truncated or corrupted archive
        raise MalformedPayload(f"payload cannot be decoded: {type(error).__name__}: {error}") from None
    return payload


def message_nbytes(message: Message) -> int:
    """Bytes of the serialised message: every object Flower deflates to send it (content and metadata)."""
    return int(sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values()))
