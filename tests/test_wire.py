"""Payloads through Flower records, and message sizes measured on the serialised message."""

from __future__ import annotations

import numpy as np
from flwr.app import Message, MessageType, RecordDict

from common.engine.wire import from_recorddict, message_nbytes, to_recorddict
from common.methods.base import Payload


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


def test_a_message_is_measured_and_named_as_flower_serialises_it(monkeypatch):
    """The audit's digest (common.trust.audit.measure_message, one serialisation of each object): the content's id is
    Flower's own object id, and the bytes are the sum of every object Flower would send, each serialised once."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.task_identity import TaskIdentity

    from common.trust.audit import measure_message

    for name, value in {"_run_id": 1, "_task_id": 1, "_node_id": 0}.items():
        monkeypatch.setattr(TaskIdentity, name, value)
    payload = Payload(arrays={"model": {"w": np.arange(300_000, dtype=np.float32), "b": np.ones(3)}},
                      config={"run-name": "r", "secagg.keys": [b"k" * 32, b"q" * 32]}, metrics={"loss": 0.5})

    def message():
        return Message(to_recorddict(payload), message_type=MessageType.TRAIN, dst_node_id=1)

    size, content_id = measure_message(message())
    reference = message()
    assert content_id == reference.content.object_id
    assert size == sum(len(obj.deflate()) for obj in get_all_nested_objects(reference).values())
    assert size > 300_000 * 4


def test_payload_travels_in_flowers_own_records():
    """The model is the ArrayRecord "arrays" (loadable by torch), config and metrics Flower's records (lists of numbers
    in a MetricRecord of their own)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    from common.arrays import model_arrays

    content = to_recorddict(Payload(arrays={"model": model_arrays(model), "anchors": {"a": np.ones(2)}},
                                    config={"mask": b"\x01"}, metrics={"influence": [3, 0, 1, 2], "loss": 0.5}))
    assert set(content.array_records) == {"arrays", "anchors"}
    assert content.config_records["config"]["mask"] == b"\x01"
    assert dict(content.metric_records["metrics"]) == {"loss": 0.5}  # numbers only: what a user's mod logs
    assert content.metric_records["fedmed.list-metrics"]["influence"] == [3, 0, 1, 2]  # method data beside them
    assert from_recorddict(content).metrics == {"loss": 0.5, "influence": [3, 0, 1, 2]}
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    assert "1.num_batches_tracked" not in content["arrays"]  # the step counter stays local
    fresh.load_state_dict(content["arrays"].to_torch_state_dict(), strict=True)  # torch accepts it missing
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_recorddict_from_elsewhere_is_refused():
    import pytest
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    from common.engine.wire import MalformedPayload

    for foreign in (RecordDict({"settings": ConfigRecord({"a": 1})}), RecordDict({"scores": MetricRecord({"a": 1})})):
        with pytest.raises(MalformedPayload, match="unexpected"):
            from_recorddict(foreign)
    truncated = to_recorddict(payload_of(100))
    good = truncated["arrays"]["w"]
    truncated["arrays"] = ArrayRecord({"w": Array(dtype=good.dtype, shape=good.shape, stype=good.stype,
                                                  data=good.data[: len(good.data) // 2])})
    with pytest.raises(MalformedPayload, match="cannot be decoded"):
        from_recorddict(truncated)


def test_packed_layout_carries_each_group_as_one_array_and_reads_back_the_same():
    import pytest
    from flwr.app import Array, ArrayRecord

    from common.engine.wire import PACKED_ARRAY, MalformedPayload

    original = payload_of(1000)
    original.arrays["anchors"] = {"scale0": np.ones((2, 3))}
    content = to_recorddict(original, "packed")
    assert set(content["arrays"]) == {PACKED_ARRAY} and set(content["anchors"]) == {PACKED_ARRAY}
    back = from_recorddict(content)
    for group, arrays in original.arrays.items():
        for name, value in arrays.items():
            assert back.arrays[group][name].dtype == value.dtype
            np.testing.assert_array_equal(back.arrays[group][name], value)
    assert back.config == original.config and back.metrics == original.metrics
    blob = content["arrays"][PACKED_ARRAY].numpy()
    content["arrays"] = ArrayRecord({PACKED_ARRAY: Array(blob[: len(blob) // 2].copy())})
    with pytest.raises(MalformedPayload, match="packed arrays cannot be read"):
        from_recorddict(content)


def test_flat_layout_carries_one_array_per_dtype_and_reads_back_the_same():
    from common.engine.wire import FLAT_ARRAY, FLAT_LAYOUT

    original = payload_of(1000)
    original.arrays["model"]["bias"] = np.full((2, 3), 0.5, np.float32)
    original.arrays["anchors"] = {"scale0": np.ones((2, 3))}
    content = to_recorddict(original, "flat")
    assert sorted(content["arrays"]) == [FLAT_ARRAY + "float32.0", FLAT_ARRAY + "int64.0"]
    assert content["arrays"][FLAT_ARRAY + "float32.0"].shape == (1006,)  # w, then bias, raveled
    assert sorted(content["anchors"]) == [FLAT_ARRAY + "float64.0"]
    back = from_recorddict(content)
    for group, arrays in original.arrays.items():
        assert list(back.arrays[group]) == list(arrays)  # names in their order
        for name, value in arrays.items():
            assert back.arrays[group][name].dtype == value.dtype and back.arrays[group][name].shape == value.shape
            np.testing.assert_array_equal(back.arrays[group][name], value)
    assert back.config == original.config and not any(k.startswith(FLAT_LAYOUT) for k in back.config)
    assert back.metrics == original.metrics


def test_a_flat_record_whose_layout_does_not_fit_its_values_is_refused():
    import json

    import pytest
    from flwr.app import Array, ArrayRecord

    from common.engine.wire import FLAT_ARRAY, FLAT_LAYOUT, MalformedPayload

    def broken(change):
        content = to_recorddict(payload_of(100), "flat")
        change(content)
        with pytest.raises(MalformedPayload, match="flat|layout|values|holds") as refused:
            from_recorddict(content)
        return str(refused.value)

    def layout(entries):
        return lambda content: content["config"].__setitem__(FLAT_LAYOUT + "arrays", json.dumps(entries))

    assert "more values of 'fedmed.flat.float32.0'" in broken(layout([["w", "float32.0", [101]],
                                                                        ["count", "int64.0", []]]))
    assert "does not name" in broken(layout([["w", "float32.0", [99]], ["count", "int64.0", []]]))
    assert "repeats a name" in broken(layout([["w", "float32.0", [50]], ["w", "float32.0", [50]],
                                              ["count", "int64.0", []]]))
    assert "negative" in broken(layout([["w", "float32.0", [-1, -100]], ["count", "int64.0", []]]))
    assert "not a 1-D Array" in broken(layout([["w", "float64.0", [100]], ["count", "int64.0", []]]))
    assert "cannot be read" in broken(lambda content: content["config"].__setitem__(FLAT_LAYOUT + "arrays", "[oops"))
    assert "no 'fedmed.layout.arrays'" in broken(lambda content: content["config"].__delitem__(FLAT_LAYOUT + "arrays"))
    two_d = np.zeros((10, 10), np.float32)  # a vector that is not 1-D
    assert "not a 1-D Array" in broken(lambda content: content["arrays"].__setitem__(FLAT_ARRAY + "float32.0",
                                                                                      Array(two_d)))
    assert isinstance(to_recorddict(payload_of(1), "flat")["arrays"], ArrayRecord)


def test_clipping_a_flat_update_is_clipping_the_tensors():
    """What Flower's DP code computes on a flat update (the norm over all values, the scaled update) is what it
    computes tensor by tensor: the flat layout is weights to Flower's client-side mods."""
    from flwr.supercore.differential_privacy import compute_clip_model_update

    rng = np.random.default_rng(0)
    received = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    trained = {k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in received.items()}
    per_tensor = [trained[k].copy() for k in received]
    compute_clip_model_update(per_tensor, [received[k] for k in received], clipping_norm=0.5)
    flat_sent = from_recorddict(to_recorddict(Payload(arrays={"model": received}), "flat"))
    flat_reply = to_recorddict(Payload(arrays={"model": trained}), "flat")
    flat = [flat_reply["arrays"]["fedmed.flat.float32.0"].numpy()]
    compute_clip_model_update(flat, [np.concatenate([v.ravel() for v in flat_sent.arrays["model"].values()])],
                              clipping_norm=0.5)
    clipped = np.concatenate([a.ravel() for a in per_tensor])
    assert not np.allclose(clipped, np.concatenate([trained[k].ravel() for k in received]))  # it did clip
    np.testing.assert_allclose(flat[0], clipped, rtol=1e-6)


def test_a_large_flat_group_is_split_between_tensors_into_arrays_of_bounded_size(monkeypatch):
    import common.engine.wire as wire

    monkeypatch.setattr(wire, "FLAT_SEGMENT_BYTES", 4000)
    model = {f"layer{i}": np.full(300, i, np.float32) for i in range(8)}  # 1200 bytes each
    model["huge"] = np.arange(2000, dtype=np.float32)  # alone larger than a segment
    model["tail"] = np.ones(3, np.float32)
    content = to_recorddict(Payload(arrays={"model": model}), "flat")
    sizes = {key: content["arrays"][key].numpy().nbytes for key in content["arrays"]}
    assert list(sizes) == [wire.FLAT_ARRAY + f"float32.{i}" for i in range(5)]
    assert list(sizes.values()) == [3600, 3600, 2400, 8000, 12]  # 3 + 3 + 2 layers, "huge" alone, then "tail"
    back = from_recorddict(content).arrays["model"]
    for name, value in model.items():
        np.testing.assert_array_equal(back[name], value)
