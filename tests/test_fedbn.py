"""FedBN: each hospital keeps its normalisation layers; the server averages the rest and scores each hospital's own
model; a hospital's layers survive a restart in its state folder."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import load_job_config
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.base import HospitalInfo
from strategies.fedbn.hospital import FedBNHospital
from strategies.fedbn.norm_layers import NORM_GROUP

JOB = {"strategy": "fedbn", "model": "small-cnn", "image-size": 16, "synthetic-samples": 90, "batch-size": 16,
       "min-partition-size": 5, "num-server-rounds": 2, "partitioner": "dirichlet", "dirichlet-alpha": 0.3}

pytestmark = pytest.mark.usefixtures("one_thread")


def test_normalisation_layers_stay_at_each_hospital_and_the_rest_is_averaged(tmp_path):
    cfg = load_job_config(JOB)
    sites = simulated_sites(cfg, 2, state_root=tmp_path)
    engine = RoundEngine(cfg)
    norm_names = engine.method.norm_names
    assert norm_names == {f"{i}.{k}" for i in (1, 4, 7) for k in ("weight", "bias", "running_mean", "running_var")}
    sent = engine.downlink(1, HospitalInfo("hospital-00", 10)).arrays["model"]
    assert not set(sent) & norm_names  # the downlink carries the shared weights only

    run_rounds(cfg, sites, engine)
    own = {site.name: site.state.load(before_round=3) for site in sites}
    assert set(own["hospital-00"]) == norm_names
    assert not np.allclose(own["hospital-00"]["1.running_mean"], own["hospital-01"]["1.running_mean"])
    for hospital, arrays in own.items():  # the server scores each hospital with the layers that hospital kept
        for name, value in arrays.items():
            np.testing.assert_array_equal(engine.method.local_norms[hospital][name], value)
    record = engine.history[-1]
    assert record["aggregated"] == ["hospital-00", "hospital-01"] and 0 <= record["test"]["accuracy"] <= 1

    state = engine.state_dict()  # a resumed server keeps every hospital's layers
    resumed = RoundEngine(cfg)
    resumed.load_state_dict(state)
    assert sorted(resumed.method.local_norms) == ["hospital-00", "hospital-01"]


def test_a_hospital_trains_from_its_own_layers_and_a_reply_with_bad_ones_is_refused(tmp_path):
    cfg = load_job_config({**JOB, "num-server-rounds": 1})
    site = simulated_sites(cfg, 2, state_root=tmp_path)[0]
    engine = RoundEngine(cfg)
    info = FedBNHospital(cfg, site).info()
    reply = FedBNHospital(cfg, site).timed_train(1, engine.downlink(1, info))
    kept = site.state.load(before_round=2)
    model = FedBNHospital(cfg, site).own_model(2, engine.downlink(2, info))
    np.testing.assert_array_equal(model.state_dict()["1.running_var"].numpy(), kept["1.running_var"])

    bad = {k: v.copy() for k, v in reply.arrays[NORM_GROUP].items()}
    bad["1.running_var"][:] = -1.0
    forged = type(reply)(arrays={"model": reply.arrays["model"], NORM_GROUP: bad}, metrics=dict(reply.metrics))
    record = engine.complete_round(1, [info], [RoundReply(info, forged)], 0.0)
    assert "variances must be positive" in record["refused"][info.name]
