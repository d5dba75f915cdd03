"""docs/own-serverapp.md's example: a ServerApp written against Flower's API plus ``FedProInStrategy``
runs FedProIn in ``flwr run`` simulation, and its Result carries the method's state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.launch import run_log, submit_run, wait_for_run

from .flower_processes import simulation_superlink

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the long tier (.ci/run)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_serverapp"


def test_a_users_own_serverapp_runs_fedproin_in_simulation(tmp_path):
    result_file = tmp_path / "result.json"
    run_config = {"result-file": str(result_file), "state-dir": str(tmp_path / "state"),
                  "results-dir": str(tmp_path / "results")}
    with simulation_superlink(tmp_path) as home:
        run_id = submit_run(home, "local", run_config, {"num-supernodes": 2}, app_dir=EXAMPLE)
        status = wait_for_run(home, "local", run_id, 420.0)
        assert status == "finished:completed", run_log(home, "local", run_id)[-4000:]
    summary = json.loads(result_file.read_text())
    assert sorted(summary["train"]) == ["1", "2"] and sorted(summary["central"]) == ["0", "1", "2"]
    for metrics in summary["train"].values():
        for hospital in ("hospital-00", "hospital-01"):
            assert len(metrics[f"method.influence.{hospital}"]) == 4 * 2  # classes x prototypes per class
            assert metrics[f"bytes-up.{hospital}"] > 0
        assert metrics["hospitals-aggregated"] == 2
    assert all(m["prototype-spread"] > 0 for m in summary["central"].values())
    for rnd in ("1", "2"):  # the server's test-set metrics sit beside the app's own evaluate_fn metrics
        assert 0.0 <= summary["central"][rnd]["accuracy"] <= 1.0
    assert "prototypes" in summary["arrays"]
