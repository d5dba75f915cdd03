"""One round record for plain and secure rounds (``common/engine/round_record.py``): the same replies give the same
record, train metrics weighed by each hospital's screened share in both."""

from __future__ import annotations

import pytest

from common.engine.round_record import round_record, screened_shares, weighted_mean_metrics
from common.methods.base import HospitalInfo, HospitalUpdate, Payload
from strategies import FedAvgStrategy
from strategies.secure_aggregation import with_secure_aggregation

from .fake_grid import FakeGrid
from .test_secure_aggregation import SMALL_CLASSIFICATION, config_of, plain_hospitals, secure_hospitals

pytestmark = pytest.mark.usefixtures("one_thread")

#: unequal hospitals (a Dirichlet split) and a weight cap that binds: the screened share is not the sample count
UNEQUAL = {**SMALL_CLASSIFICATION, "partitioner": "dirichlet", "dirichlet-alpha": 0.3,
           "screening.max-hospital-weight": 0.4}
SAME_IN_BOTH = ("round", "chosen", "aggregated", "missing", "refused", "hospital_metrics", "devices", "train")


def measured(value):
    """``value`` without what differs between two runs of the same replies: seconds, and the secure protocol's own
    numbers (``secagg-*``)."""
    if not isinstance(value, dict):
        return value
    return {k: measured(v) for k, v in value.items() if not k.endswith("seconds") and not k.startswith("secagg-")}


def test_a_plain_and_a_secure_round_of_the_same_replies_give_the_same_record(tmp_path):
    plain_config = config_of(tmp_path, UNEQUAL, "plain")
    plain = FedAvgStrategy(min_train_nodes=3, min_available_nodes=3, run_config=plain_config)
    plain.start(FakeGrid(plain_hospitals(plain_config, 3)), num_rounds=1)
    secure_config = config_of(tmp_path, UNEQUAL, "secure")
    secure = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=3, min_available_nodes=3,
                                                     run_config=secure_config)
    secure.start(FakeGrid(secure_hospitals(secure_config, 3)), num_rounds=1)
    plain_record, secure_record = plain.engine.history[0], secure.engine.history[0]
    assert len(plain_record["aggregated"]) == 3 and "skipped" not in secure_record
    counts = {name: metrics["num-examples"] for name, metrics in plain_record["hospital_metrics"].items()}
    assert max(counts.values()) / sum(counts.values()) > 0.4  # the cap binds: shares are not the counts
    by_count = weighted_mean_metrics([(counts[name], metrics)
                                      for name, metrics in plain_record["hospital_metrics"].items()])
    assert plain_record["train"] != pytest.approx({k: by_count[k] for k in plain_record["train"]}, rel=1e-9, abs=0)
    for key in SAME_IN_BOTH:  # train metrics included: the secure round weighs by the screened share too
        assert measured(secure_record[key]) == measured(plain_record[key]), key
    assert plain_record["train"]["train-loss"] == secure_record["train"]["train-loss"]
    assert set(secure_record) - set(plain_record) == {"secure-aggregation"}


def update(name: str, count: int, loss: float) -> HospitalUpdate:
    return HospitalUpdate(HospitalInfo(name, count), Payload(metrics={"num-examples": count, "loss": loss,
                                                                     "curve": [1.0, 2.0]}, config={"device": "cpu"}))


def test_the_record_weighs_train_metrics_by_the_screened_share_and_keeps_lists_out(tmp_path):
    class Screening:
        sample_ratio_limit, max_hospital_weight = 2.0, 1.0

    updates = [update("a", 10, 1.0), update("b", 10, 1.0), update("c", 1000, 4.0)]
    cuts = screened_shares(updates, Screening)
    assert list(cuts) == ["c"] and "sample-ratio-limit=2" in cuts["c"]  # cut to 2 x the others' median, 20
    assert [u.weight for u in updates] == pytest.approx([0.25, 0.25, 0.5])
    traffic = {name: {"down": 5, "up": 7} for name in "abc"}
    record = round_record(3, [u.hospital for u in updates], updates, started=1.0, traffic=traffic,
                          method={"lr": 0.1}, weight_cuts=cuts)
    assert record["train"] == {"loss": pytest.approx(0.25 + 0.25 + 2.0)}
    assert record["hospital_metrics"]["c"] == {"num-examples": 1000, "loss": 4.0}  # the list stays out
    assert (record["bytes_down"], record["bytes_up"], record["weight-cut"]) == (15, 21, cuts)
    skipped = round_record(3, [u.hospital for u in updates], [], started=0.0, traffic=traffic, method={"x": 1},
                           skipped="too few")
    assert skipped["skipped"] == "too few" and "method" not in skipped and skipped["train"] == {}
