"""The pieces of a streamed round: replies on disk read back exactly, the folder gone after the round whatever
happened, and the aggregations that now go hospital by hospital or slice by slice giving what they gave over every
reply stacked in memory, bit for bit (the old formulas are written out here as the reference)."""

from __future__ import annotations

import numpy as np
import pytest

import common.arrays as named_arrays
from common.arrays import flat_values
from common.config import load_job_config
from common.engine.reply_store import ReplyStore, StoredArrays, materialized, selected
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.base import HospitalInfo, Payload
from strategies.fedmepd.filter_personalisation import aggregate_filters
from strategies.fedproin.server import normalised_influence_aggregation


def test_arrays_come_back_from_disk_exactly_and_a_slice_alone_can_be_read(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((3, 4, 5)).astype(np.float32), "scalar": np.array(2.5),
              "counts": np.arange(7, dtype=np.int64), "mask": np.array([True, False, True]),
              "half": rng.standard_normal(6).astype(np.float16), "empty": np.zeros((0, 3), np.float32),
              "strided": rng.standard_normal((4, 6))[:, ::2]}
    store = ReplyStore(tmp_path / ".round-1")
    assert (store.folder.stat().st_mode & 0o777) == 0o700  # single hospitals' updates: for the server's user alone
    stored = store.keep(arrays)
    assert isinstance(stored, StoredArrays) and list(stored) == list(arrays) and len(stored) == len(arrays)
    for name, value in arrays.items():
        assert stored[name].dtype == value.dtype and stored[name].shape == value.shape
        np.testing.assert_array_equal(stored[name], value)
    np.testing.assert_array_equal(stored.flat_slice("w", 7, 19), arrays["w"].ravel()[7:19])
    np.testing.assert_array_equal(flat_values(arrays, "w", 55, 99), arrays["w"].ravel()[55:60])
    assert store.nbytes == sum(v.nbytes for v in arrays.values())
    kept = materialized(selected(stored, ("w", "count")))
    assert list(kept) == ["w", "counts"] and all(isinstance(v, np.ndarray) for v in kept.values())
    assert list(selected(arrays, "s")) == ["scalar", "strided"]
    store.remove()
    assert not (tmp_path / ".round-1").exists()


def test_a_folder_left_by_a_round_cut_short_is_emptied_when_the_round_is_run_again(tmp_path):
    (tmp_path / ".round-3").mkdir()
    (tmp_path / ".round-3" / "000001.bin").write_bytes(b"stale")
    store = ReplyStore(tmp_path / ".round-3")
    assert list(store.folder.iterdir()) == []


def small_job(tmp_path, **extra):
    return load_job_config({"model": "small-cnn", "image-size": 16, "synthetic-samples": 60, "min-partition-size": 5,
                            "run-name": "t", "results-dir": str(tmp_path), **extra})


def replies_of(engine: RoundEngine, count: int, rnd: int = 1) -> list[RoundReply]:
    rng = np.random.default_rng(rnd)
    replies = []
    for i in range(count):
        model = {k: (v + rng.normal(0, 0.01, v.shape)).astype(v.dtype) if v.dtype.kind == "f" and "running" not in k
                 else v.copy() for k, v in engine.method.global_arrays.items()}
        replies.append(RoundReply(HospitalInfo(f"h{i}", 50), Payload(arrays={"model": model},
                                                                      metrics={"num-examples": 10 + i,
                                                                               "server-round": rnd})))
    return replies


def test_the_rounds_folder_is_removed_when_the_aggregation_fails(tmp_path):
    engine = RoundEngine(small_job(tmp_path))
    seen = []

    def failing(rnd, updates):
        seen.extend(u.payload.arrays["model"].path for u in updates)
        raise RuntimeError("the server ran out of something")

    engine.method.aggregate = failing
    with pytest.raises(RuntimeError, match="ran out"):
        engine.complete_round(1, [], replies_of(engine, 3), 0.0, evaluate=False, reply_folder=tmp_path)
    assert len(seen) == 3 and all(path.parent == tmp_path / ".round-1" for path in seen)
    assert not (tmp_path / ".round-1").exists()


def test_a_full_disk_ends_the_round_loudly_instead_of_refusing_every_hospital(tmp_path, monkeypatch):
    engine = RoundEngine(small_job(tmp_path))

    def full(self, arrays):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ReplyStore, "keep", full)
    with pytest.raises(OSError, match="No space left"):
        engine.complete_round(1, [], replies_of(engine, 2), 0.0, evaluate=False, reply_folder=tmp_path)
    assert not (tmp_path / ".round-1").exists() and engine.history == []


def robust_reference(arrays, rule, trim_fraction):
    """The rule over every hospital's whole tensor stacked at once (robust_average as it was)."""
    from flwr.serverapp.strategy.fedtrimmedavg import trim_mean

    result = {}
    for name, first in arrays[0].items():
        stacked = np.stack([np.asarray(item[name]) for item in arrays])
        value = (trim_mean(stacked.astype(np.float64), trim_fraction) if rule == "trimmed-mean" and
                 first.dtype.kind == "f" else np.median(stacked, axis=0))
        result[name] = np.asarray(value).astype(first.dtype)
    return result


@pytest.mark.parametrize("hospitals", [2, 3, 9, 20, 130])
@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_robust_rules_slice_by_slice_from_disk_give_what_they_give_on_the_stacked_tensors(tmp_path, monkeypatch,
                                                                                           hospitals, rule):
    rng = np.random.default_rng(hospitals)
    shapes = {"scalar": (), "one": (1,), "bias": (3,), "conv": (8, 3, 3, 3), "fc": (17, 33), "big": (1001,)}
    arrays = [{name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
              | {"steps": rng.integers(0, 9, (4,))} for _ in range(hospitals)]
    expected = robust_reference(arrays, rule, 0.2)
    store = ReplyStore(tmp_path / ".round-1")
    stored = [store.keep(item) for item in arrays]
    monkeypatch.setattr(named_arrays, "ROBUST_CHUNK_BYTES", 8 * hospitals * 50)  # slices of 50 values: many per tensor
    for given in (arrays, stored):
        result = named_arrays.robust_average(given, rule, 0.2)
        for name, value in expected.items():
            assert result[name].shape == value.shape and result[name].dtype == value.dtype
            assert result[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("hospitals,classes,per_class,dim", [(1, 3, 2, 5), (2, 10, 5, 64), (7, 4, 3, 1),
                                                             (50, 10, 4, 128), (130, 2, 1, 16)])
def test_nia_hospital_by_hospital_equals_the_einsum_over_the_stacked_replies(hospitals, classes, per_class, dim):
    rng = np.random.default_rng(dim)
    prototypes = [rng.standard_normal((classes, per_class, dim)).astype(np.float32) for _ in range(hospitals)]
    influences = [rng.integers(0, 3000, (classes, per_class)) * (rng.random((classes, per_class)) > 0.2)
                  for _ in range(hospitals)]
    previous = rng.standard_normal((classes, per_class, dim)).astype(np.float32)
    weights = np.stack(influences).astype(np.float64)  # the formula as it was
    total = weights.sum(axis=0)
    weighted = np.einsum("hcm,hcmd->cmd", weights, np.stack(prototypes).astype(np.float64))
    expected = previous.astype(np.float64)
    expected[total > 0] = weighted[total > 0] / total[total > 0][:, None]
    result = normalised_influence_aggregation(iter(prototypes), influences, previous)
    assert result.tobytes() == expected.astype(np.float32).tobytes()


@pytest.mark.parametrize("hospitals", [0, 1, 2, 5, 12])
def test_decoder_filters_upload_by_upload_equal_the_sum_over_the_stacked_uploads(tmp_path, hospitals):
    rng = np.random.default_rng(hospitals)
    server = {"decoder.a.weight": rng.standard_normal((6, 4, 3, 3, 3)).astype(np.float32),
              "decoder.a.bias": rng.standard_normal(6).astype(np.float32),
              "decoder.out.weight": rng.standard_normal((4, 6, 1, 1, 1)).astype(np.float32),
              "decoder.out.bias": rng.standard_normal(4).astype(np.float32)}
    layers = {"decoder.a": ["decoder.a.bias", "decoder.a.weight"], "decoder.out": ["decoder.out.bias",
                                                                                   "decoder.out.weight"]}
    uploads = [{k: (v + rng.normal(0, 0.1, v.shape)).astype(v.dtype) for k, v in server.items()}
               for _ in range(hospitals)]
    weights = [{"decoder.a": rng.random(6) * (rng.random(6) > 0.3), "decoder.out": rng.random(4)}
               for _ in range(hospitals)]
    expected = {}  # the formula as it was
    for layer, names in layers.items():
        w = np.stack([weight[layer] for weight in weights]) if weights else np.zeros((0, server[names[0]].shape[0]))
        total = w.sum(axis=0)
        for name in names:
            shape = (-1,) + (1,) * (server[name].ndim - 1)
            stacked = (np.stack([u[name].astype(np.float64) for u in uploads]) if uploads
                       else np.zeros((0,) + server[name].shape))
            mean = (w.reshape(w.shape + (1,) * (server[name].ndim - 1)) * stacked).sum(axis=0)
            mean = mean / np.where(total > 0, total, 1.0).reshape(shape)
            blended = 0.3 * server[name].astype(np.float64) + 0.7 * mean
            expected[name] = np.where((total > 0).reshape(shape), blended, server[name]).astype(np.float32)
    store = ReplyStore(tmp_path / ".round-1")
    result, _ = aggregate_filters(server, [store.keep(u) for u in uploads], weights, layers, 0.3)
    for name, value in expected.items():
        assert result[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("hospitals", [1, 3, 11])
def test_fedavg_slice_by_slice_from_disk_equals_the_sum_over_whole_tensors(tmp_path, monkeypatch, hospitals):
    import common.arrays
    from common.arrays import weighted_average

    rng = np.random.default_rng(hospitals)
    shapes = {"scalar": (), "bias": (7,), "conv": (16, 8, 3, 3), "half": (33,)}
    models = [{name: rng.standard_normal(shape).astype(np.float16 if name == "half" else np.float32)
               for name, shape in shapes.items()} | {"steps": rng.integers(0, 9, (3,))} for _ in range(hospitals)]
    counts = rng.integers(1, 500, hospitals).tolist()
    weights = np.asarray(counts, dtype=np.float64) / sum(counts)  # the sum as it was: whole tensors at once
    expected = {}
    for name, first in models[0].items():
        if first.dtype.kind == "f":
            total = np.zeros(first.shape, dtype=np.float64)
            for model, w in zip(models, weights):
                total += w * model[name]
            expected[name] = total.astype(first.dtype)
        else:
            expected[name] = np.max(np.stack([m[name] for m in models]), axis=0)
    store = ReplyStore(tmp_path / ".round-1")
    stored = [store.keep(model) for model in models]
    monkeypatch.setattr(common.arrays, "AVERAGE_SLICE", 50)  # the conv tensor in 24 slices
    for given in (models, stored):
        result = weighted_average(given, counts)
        for name, value in expected.items():
            assert result[name].shape == value.shape and result[name].dtype == value.dtype
            assert result[name].tobytes() == value.tobytes(), name
