"""FedProIn's baselines and references: MOON, FedProto, SOLO and centralised training, in process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import JobConfig
from common.data.sources import server_test_set
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.references import reference_config, run_centralised, run_solo
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.base import HospitalInfo, Payload
from strategies.moon.hospital import model_contrastive_loss


@pytest.fixture
def cfg():
    return JobConfig(run_name="test", num_server_rounds=2, synthetic_samples=120, image_size=16, batch_size=16,
                     min_partition_size=5, model="small-cnn", fraction_train=0.7)


def test_moon_loss_prefers_the_global_representation():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    same, orthogonal = z.clone(), torch.tensor([[0.0, 1.0], [3.0, 0.0]])
    expected = -math.log(math.exp(1 / 0.5) / (math.exp(1 / 0.5) + math.exp(0.0)))
    assert model_contrastive_loss(z, same, orthogonal, 0.5).item() == pytest.approx(expected, rel=1e-6)
    assert model_contrastive_loss(z, orthogonal, same, 0.5).item() > expected  # nearer the previous model: worse


def test_moon_two_rounds_keep_each_hospitals_previous_model(cfg):
    cfg = cfg.model_copy(update={"strategy": "moon", "fraction_train": 1.0})
    sites = simulated_sites(cfg, 2)
    engine = run_rounds(cfg, sites)
    assert [len(r["aggregated"]) for r in engine.history] == [2, 2]
    assert 0.0 <= engine.history[-1]["test"]["accuracy"] <= 1.0
    for site in sites:  # the model it trained in round 2 is what its round-3 contrastive term will push from
        assert site.state.rounds() == [1, 2]
        saved = site.state.load(before_round=3)
        assert set(saved) == set(engine.method.global_arrays)
        assert not all(np.array_equal(saved[k], v) for k, v in engine.method.global_arrays.items())


def test_fedproto_two_rounds_share_prototypes_and_score_the_hospitals_models(cfg):
    cfg = cfg.model_copy(update={"strategy": "fedproto"})
    sites = simulated_sites(cfg, 3)
    engine = run_rounds(cfg, sites)
    method = engine.method
    assert [len(r["aggregated"]) for r in engine.history] == [2, 2]
    assert method.present.all() and np.isfinite(method.prototypes).all()
    assert set(method.local_models) == set(engine.history[0]["aggregated"]) | set(engine.history[1]["aggregated"])
    assert 0.0 <= engine.history[-1]["test"]["accuracy"] <= 1.0
    # The downlink carries prototypes only; a hospital continues its own model from its state store.
    payload = engine.downlink(3, HospitalInfo(sites[0].name, 1))
    assert (set(payload.arrays) == {"prototypes"}
            and payload.arrays["prototypes"]["mean"].shape == method.prototypes.shape)


def test_fedproto_averages_each_class_over_the_hospitals_that_hold_it(cfg):
    cfg = cfg.model_copy(update={"strategy": "fedproto"})
    engine = RoundEngine(cfg)
    classes, dim = engine.method.prototypes.shape

    def reply(name, mean, count):
        return RoundReply(HospitalInfo(name, 10), Payload(
            arrays={"model": dict(engine.method.global_arrays),
                    "prototypes": {"mean": np.full((classes, dim), mean, np.float32), "count": np.array(count)}},
            metrics={"num-examples": 10, "server-round": 1}))

    replies = [reply("h1", 1.0, [5, 0, 1, 0]), reply("h2", 3.0, [50, 2, 0, 0]), reply("h3", np.nan, [1, 1, 1, 1])]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert "NaN" in record["refused"]["h3"]
    np.testing.assert_allclose(engine.method.prototypes[:3, 0], [2.0, 3.0, 1.0])  # unweighted by counts
    assert engine.method.present.tolist() == [True, True, True, False]
    assert record["method"]["hospitals-per-class"] == [2, 1, 1, 0]


def test_solo_and_centralised_spend_the_federated_budget(cfg):
    cfg = cfg.model_copy(update={"num_server_rounds": 3})
    sites = simulated_sites(cfg, 3)
    test = server_test_set(cfg)
    assert reference_config(cfg).num_server_rounds == 2  # round(3 rounds * 0.7 of the hospitals)
    solo = run_solo(cfg, sites, test)
    assert [r["round"] for r in solo] == [1, 2]
    last = solo[-1]
    assert set(last["per_hospital"]) == {s.name for s in sites}
    assert last["test"]["accuracy"] == pytest.approx(np.mean([m["accuracy"] for m in last["per_hospital"].values()]))
    centralised = run_centralised(cfg, sites, test)
    assert [r["aggregated"] for r in centralised] == [["centralised"], ["centralised"]]
    assert centralised[-1]["hospital_metrics"]["centralised"]["num-examples"] == sum(len(s.train) for s in sites)
