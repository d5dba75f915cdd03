"""Payloads through Flower records, and message sizes measured on the serialised message."""

from __future__ import annotations

import numpy as np
from flwr.app import Message, MessageType, RecordDict

from common.methods.base import Payload
from common.wire import from_recorddict, message_nbytes, to_recorddict


def payload_of(size: int) -> Payload:
    return Payload(arrays={"model": {"w": np.arange(size, dtype=np.float32), "count": np.array(3, np.int64)}},
                   config={"server-round": 2, "mask": b"\x01\x00\x01"}, metrics={"num-examples": 10, "loss": 0.5})


def test_payload_round_trip_keeps_names_shapes_dtypes_and_bytes():
    original = payload_of(7)
    back = from_recorddict(to_recorddict(original))
    assert back.arrays["model"]["count"].shape == () and back.arrays["model"]["count"].dtype == np.int64
    np.testing.assert_array_equal(back.arrays["model"]["w"], original.arrays["model"]["w"])
    assert back.config == original.config and back.metrics == original.metrics


def test_message_size_is_measured_from_serialised_content(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # set by Flower inside a ServerApp process
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    small = Message(to_recorddict(payload_of(10)), message_type=MessageType.TRAIN, dst_node_id=1)
    large = Message(to_recorddict(payload_of(250_000)), message_type=MessageType.TRAIN, dst_node_id=1)
    small_bytes, large_bytes = message_nbytes(small), message_nbytes(large)
    raw_difference = (250_000 - 10) * 4
    # the float32 data dominates: the difference is the raw array bytes plus a small framing cost
    assert raw_difference <= large_bytes - small_bytes < raw_difference * 1.01
    assert 100 < small_bytes < 5000


def test_recorddict_from_elsewhere_is_refused():
    from flwr.app import ArrayRecord, Array

    import pytest

    from common.wire import MalformedPayload

    foreign = RecordDict({"weights": ArrayRecord({"w": Array(np.zeros(2, np.float32))})})
    with pytest.raises(MalformedPayload, match="unexpected record 'weights'"):
        from_recorddict(foreign)
    truncated = to_recorddict(payload_of(100))
    blob = truncated["fedmed.payload"]["npz"].numpy()
    truncated["fedmed.payload"]["npz"] = Array(blob[: len(blob) // 2].copy())
    with pytest.raises(MalformedPayload, match="cannot be decoded"):
        from_recorddict(truncated)
