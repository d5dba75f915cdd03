"""``flwr run`` in Flower's simulation engine: a run completes and leaves its results; a resumed run
finishes with the same model as an uninterrupted one."""

from __future__ import annotations

import numpy as np
import pytest

from server_app.checkpoint import list_checkpoints, load_checkpoint
from server_app.results import read_history

from .flower_processes import TINY_JOB, run_to_completion, simulation_superlink

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the long tier (.ci/run)


def test_two_round_simulation_completes_and_resumes_exactly(tmp_path):
    results = tmp_path / "results"
    job = {**TINY_JOB, "results-dir": str(results), "state-dir": str(tmp_path / "state"), "fraction-train": 0.7}
    with simulation_superlink(tmp_path) as home:
        run_to_completion(home, {**job, "run-name": "straight", "num-server-rounds": 3}, {"num-supernodes": 3})
        run_to_completion(home, {**job, "run-name": "interrupted", "num-server-rounds": 2}, {"num-supernodes": 3})
        run_to_completion(home, {**job, "run-name": "interrupted", "num-server-rounds": 3,
                                 "resume-from": str(results / "interrupted")}, {"num-supernodes": 3})

    history = read_history(results / "straight")
    assert [r["round"] for r in history] == [1, 2, 3]
    for record in history:
        assert len(record["aggregated"]) == 2 and not record["refused"] and not record["missing"]
        assert all(t["down"] > 1e6 and t["up"] > 1e6 for t in record["traffic"].values())  # a ResNet-18 each way
        assert 0.0 <= record["test"]["accuracy"] <= 1.0
        assert "val-accuracy" in record["train"]
    for name in ("summary.md", "config.json", "plots/test_metrics.png", "plots/traffic.png"):
        assert (results / "straight" / name).is_file(), name
    assert "| 3 | 2/2 |" in (results / "straight" / "summary.md").read_text()

    straight = load_checkpoint(results / "straight")
    resumed = load_checkpoint(results / "interrupted")
    assert list_checkpoints(results / "interrupted")[-1].name == "round-00003.npz"
    model_keys = [k for k in straight if k.startswith("method/global/")]
    assert model_keys
    for key in model_keys:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)
    assert [r["chosen"] for r in read_history(results / "interrupted")] == [r["chosen"] for r in history]
