"""A real deployment on loopback: one SuperLink, two hospital SuperNodes, each with its own data folder
written by ``fedmed partition``."""

from __future__ import annotations

import json

import pytest

from common.cli import main as fedmed
from common.launch import FlowerHome, free_port, start_superlink, start_supernode
from server_app.results import read_history

from .flower_processes import TINY_JOB, run_to_completion, stopped_at_exit

pytestmark = pytest.mark.integration


def test_superlink_and_two_supernodes_with_their_own_data(tmp_path):
    sites = tmp_path / "sites"
    assert fedmed(["partition", "--hospitals", "2", "--out", str(sites),
                   "--run-config", "synthetic-samples=120 image-size=16 partitioner='dirichlet' min-partition-size=5"]) == 0
    manifest = json.loads((sites / "manifest.json").read_text())
    assert set(manifest["sites"]) == {"test", "hospital-00", "hospital-01"}
    assert (sites / "hospital-00" / "data.npz").is_file()

    home = FlowerHome(tmp_path / "flwr-home")
    port = free_port()
    superlink = start_superlink(home, port, simulation=False, connection="deployment")
    nodes = [start_supernode(home, f"127.0.0.1:{port}", free_port(),
                             {"hospital": name, "data-dir": str(sites / name), "state-dir": str(tmp_path / "state" / name),
                              "device": "cpu"})
             for name in ("hospital-00", "hospital-01")]
    with stopped_at_exit(superlink, *nodes):
        run_to_completion(home, {**TINY_JOB, "dataset": "npz", "test-dir": str(sites / "test"), "num-server-rounds": 2,
                                 "run-name": "deployed", "results-dir": str(tmp_path / "results")},
                          connection="deployment", timeout=300)

    history = read_history(tmp_path / "results" / "deployed")
    assert [r["round"] for r in history] == [1, 2]
    assert all(sorted(r["aggregated"]) == ["hospital-00", "hospital-01"] for r in history)
    trained = {name: history[-1]["hospital_metrics"][name]["num-examples"] for name in ("hospital-00", "hospital-01")}
    expected = {name: manifest["sites"][name]["samples"] for name in trained}
    assert all(0.8 * expected[n] <= trained[n] < expected[n] for n in trained)  # its own folder, minus validation
    assert history[-1]["test"]["num-examples"] == manifest["sites"]["test"]["samples"]
