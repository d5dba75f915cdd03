"""The server's round logic: sampling, averaging, refusing bad updates, resuming."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from common.arrays import weighted_average
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.round_engine import RoundEngine, RoundReply, select_hospitals
from common.methods.base import HospitalInfo, Payload


def test_weighted_average_by_sample_count_and_integer_buffers():
    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(4, np.int64)}
    b = {"w": np.array([3.0, 6.0], np.float32), "n": np.array(9, np.int64)}
    result = weighted_average([a, b], [1, 3])
    np.testing.assert_allclose(result["w"], [2.5, 5.0])
    assert result["w"].dtype == np.float32
    assert result["n"] == 9 and result["n"].dtype == np.int64 and result["n"].shape == ()


def test_selection_is_seeded_by_round_and_independent_of_order():
    hospitals = [HospitalInfo(f"h{i}", 10) for i in range(10)]
    first = select_hospitals(hospitals, 0.5, 2, seed=1, rnd=3)
    assert len(first) == 5
    assert [h.name for h in select_hospitals(list(reversed(hospitals)), 0.5, 2, 1, 3)] == [h.name for h in first]
    rounds = {tuple(h.name for h in select_hospitals(hospitals, 0.5, 2, 1, r)) for r in range(1, 8)}
    assert len(rounds) > 1
    assert len(select_hospitals(hospitals[:3], 0.1, 2, 1, 1)) == 2  # the minimum wins over the fraction


@pytest.fixture
def engine(small_classification):
    """The round's arithmetic under plain sample weights, replies of the model unchanged accepted (the screening
    defaults that change both are tested in tests/test_hostile_numbers.py)."""
    plain = small_classification.screening.model_copy(update={"max_hospital_weight": 1.0, "refuse_unchanged": False})
    return RoundEngine(small_classification.model_copy(update={"screening": plain}))


def honest_reply(engine, name, scale=1.0, n=10):
    arrays = {k: (v * scale if v.dtype.kind == "f" else v) for k, v in engine.method.global_arrays.items()}
    return RoundReply(HospitalInfo(name, n), Payload(arrays={"model": arrays},
                                                     metrics={"num-examples": n, "server-round": 1}))


def test_bad_updates_are_refused_with_reasons_and_the_round_goes_on(engine, caplog):
    before = {k: v.copy() for k, v in engine.method.global_arrays.items()}
    nan_reply = honest_reply(engine, "h-nan")
    first_float = next(k for k, v in before.items() if v.dtype.kind == "f")
    nan_reply.payload.arrays["model"][first_float] = np.full_like(before[first_float], np.nan)
    shape_reply = honest_reply(engine, "h-shape")
    shape_reply.payload.arrays["model"][first_float] = np.zeros(3, np.float32)
    empty_reply = RoundReply(HospitalInfo("h-empty", 5), Payload(metrics={"num-examples": 5, "server-round": 1}))
    error_reply = RoundReply(HospitalInfo("h-error", 5), None, "DataError: x.jpg: cannot read image")
    good = [honest_reply(engine, "h-good-1", 2.0, n=10), honest_reply(engine, "h-good-2", 4.0, n=30)]
    chosen = ([r.hospital for r in [nan_reply, shape_reply, empty_reply, error_reply, *good]]
              + [HospitalInfo("h-gone", 3)])
    with caplog.at_level(logging.WARNING, logger="fedmed"):
        record = engine.complete_round(1, chosen, [nan_reply, shape_reply, empty_reply, error_reply, *good], 0.0)
    assert record["aggregated"] == ["h-good-1", "h-good-2"]
    assert "NaN" in record["refused"]["h-nan"] and "shape" in record["refused"]["h-shape"]
    assert "no 'model'" in record["refused"]["h-empty"] and "x.jpg" in record["refused"]["h-error"]
    assert record["missing"] == ["h-gone"]
    assert "refused the update of h-nan" in caplog.text
    np.testing.assert_allclose(engine.method.global_arrays[first_float], before[first_float] * 3.5, rtol=1e-5)
    assert "test" in record and record["test"]["accuracy"] >= 0


def test_sample_counts_that_are_not_finite_numbers_are_refused(engine):
    bad = {"h-nan": float("nan"), "h-inf": float("inf"), "h-text": "abc", "h-none": None, "h-list": [3]}
    replies = [honest_reply(engine, name) for name in bad] + [honest_reply(engine, "h-good-1"),
                                                                  honest_reply(engine, "h-good-2")]
    for reply in replies[:len(bad)]:
        reply.payload.metrics["num-examples"] = bad[reply.hospital.name]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == ["h-good-1", "h-good-2"]
    assert sorted(record["refused"]) == sorted(bad)
    assert all("num-examples" in reason and "not a" in reason for reason in record["refused"].values())


def test_aggregation_does_not_depend_on_the_order_replies_arrive_in(small_classification):
    first, second = RoundEngine(small_classification), RoundEngine(small_classification)
    replies = [honest_reply(first, "h-a", 2.0, n=10), honest_reply(first, "h-b", 3.0, n=7),
               honest_reply(first, "h-c", 0.5, n=13)]
    first.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    second.complete_round(1, [r.hospital for r in replies], list(reversed(replies)), 0.0)
    for name, value in first.method.global_arrays.items():
        assert np.array_equal(value, second.method.global_arrays[name]), name


def test_too_few_good_updates_leave_the_model_unchanged(engine):
    before = {k: v.copy() for k, v in engine.method.global_arrays.items()}
    record = engine.complete_round(1, [HospitalInfo("h1", 1), HospitalInfo("h2", 1)],
                                       [honest_reply(engine, "h1", 5.0)], 0.0)
    assert "min-train-hospitals" in record["skipped"]
    assert all(np.array_equal(before[k], v) for k, v in engine.method.global_arrays.items())


def test_resumed_run_ends_with_the_same_model_as_an_uninterrupted_one(small_classification, tmp_path):
    from server_app.checkpoint import load_checkpoint, save_checkpoint

    cfg = small_classification.model_copy(update={"num_server_rounds": 3, "strategy": "fedprox", "fraction_train": 0.7,
                                                  "resnet_width": 0.25})  # BatchNorm and all, a sixteenth the work
    straight = run_rounds(cfg, simulated_sites(cfg, 3))

    first = run_rounds(cfg, simulated_sites(cfg, 3), last_round=2)
    save_checkpoint(tmp_path, 2, first.state_dict())
    resumed = RoundEngine(cfg)
    resumed.load_state_dict(load_checkpoint(tmp_path))
    assert resumed.next_round == 3
    run_rounds(cfg, simulated_sites(cfg, 3), engine=resumed)

    for name, value in straight.method.global_arrays.items():
        np.testing.assert_array_equal(resumed.method.global_arrays[name], value, err_msg=name)
    assert [r["chosen"] for r in resumed.history] == [r["chosen"] for r in straight.history]
    assert resumed.history[-1]["test"] == straight.history[-1]["test"]
