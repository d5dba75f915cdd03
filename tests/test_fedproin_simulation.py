"""FedProIn through Flower's simulation engine: two rounds complete, the influence matrices reach
the round metrics, every hospital that trained kept its prototypes in its state folder, and every
hospital scored the final model in the cross-site evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from server_app.checkpoint import load_checkpoint
from server_app.results import read_history

from .flower_processes import TINY_JOB, run_to_completion, simulation_superlink

pytestmark = pytest.mark.integration


@pytest.mark.slow  # Flower's simulation engine in processes; fast: tests/test_fedproin.py's in-process rounds
def test_two_round_fedproin_simulation(tmp_path):
    results, state = tmp_path / "results", tmp_path / "state"
    job = {**TINY_JOB, "strategy": "fedproin", "model": "small-cnn", "num-server-rounds": 2,
           "fraction-train": 0.7, "run-name": "fedproin", "results-dir": str(results), "state-dir": str(state),
           "cross-site-evaluation": True}
    with simulation_superlink(tmp_path) as home:
        run_to_completion(home, job, {"num-supernodes": 3})

    history = read_history(results / "fedproin")
    assert [r["round"] for r in history] == [1, 2]
    trained = set()
    for record in history:
        assert len(record["aggregated"]) == 2 and not record["refused"]
        influence = record["method"]["influence"]
        assert set(influence) == set(record["aggregated"])
        usage = np.array(record["method"]["prototype-usage"])
        assert usage.shape == (4, 2) and usage.sum() == sum(np.array(m).sum() for m in influence.values())
        trained |= set(record["aggregated"])
    for hospital in trained:
        assert list((state / hospital / "fedproin").glob("state-r*.npz")), hospital
    checkpoint = load_checkpoint(results / "fedproin")
    assert checkpoint["method/global/prototypes"].shape[:2] == (4, 2)
    cross_site = json.loads((results / "fedproin" / "cross_site.json").read_text())
    assert sorted(cross_site["scores"]) == ["hospital-00", "hospital-01", "hospital-02"] and not cross_site["missing"]
    assert all(0.0 <= s["global"]["accuracy"] <= 1.0 for s in cross_site["scores"].values())
    assert (results / "fedproin" / "plots" / "cross_site.png").exists()
