"""FedMEPD through Flower's simulation engine: two rounds on generated multimodal volumes, with the
server training on its own full-modality cases inside the ServerApp, hospitals reporting the
modalities the run config gives them, personal masks and anchors travelling to the hospitals, and
everything the server keeps in its checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from server_app.checkpoint import load_checkpoint
from server_app.results import read_history

from .flower_processes import TINY_JOB, run_to_completion, simulation_superlink

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the long tier (.ci/run)


def test_two_round_simulation_with_server_side_training(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ServerApp and the hospitals' processes share two cores
    results, state = tmp_path / "results", tmp_path / "state"
    job = {**TINY_JOB, "task": "brain-tumour-segmentation", "strategy": "fedmepd", "num-server-rounds": 2,
           "batch-size": 2, "brain.widths": "4,8,16,32", "brain.crop-size": 16, "brain.synthetic-size": 24,
           "brain.synthetic-cases": 10, "brain.hospital-modalities": "t2;flair,t1ce;t1,t2",
           "fedmepd.warmup-rounds": 0, "fedmepd.patience": 1, "fedmepd.num-anchors": 2,
           "min-available-hospitals": 3, "run-name": "fedmepd", "results-dir": str(results), "state-dir": str(state)}
    with simulation_superlink(tmp_path) as home:
        run_to_completion(home, job, {"num-supernodes": 3})

    first, second = read_history(results / "fedmepd")
    hospitals = ["hospital-00", "hospital-01", "hospital-02"]
    for record in (first, second):
        assert record["aggregated"] == hospitals and not record["refused"]
        assert np.isfinite(record["method"]["server-train-loss"])  # the server trained on its own cases
        assert record["method"]["encoder-contributors"] == {"flair": 1, "t1ce": 1, "t1": 1, "t2": 2}
        assert (0.0 <= record["test"]["dice_mean"] <= 1.0
                and 0.0 <= record["method"]["hospital-average"]["dice_mean"] <= 1.0)
    # the masks the server set after round 1 are what the hospitals used in round 2 (bit-packed in the config)
    total = (second["hospital_metrics"]["hospital-00"]["personal-filters"]
             / first["method"]["personalised"]["hospital-00"]["all"])
    for name in hospitals:
        assert first["hospital_metrics"][name]["personal-filters"] == 0
        assert second["hospital_metrics"][name]["personal-filters"] == pytest.approx(
            first["method"]["personalised"][name]["all"] * total)
        assert 0 < first["method"]["personalised"][name]["all"] <= second["method"]["personalised"][name]["all"]
        assert second["traffic"][name]["down"] > first["traffic"][name]["down"]  # round 2 also carries the anchors

    checkpoint = load_checkpoint(results / "fedmepd")
    assert checkpoint["method/fedmepd/anchors/ready"].all()
    assert checkpoint["method/fedmepd/anchors/scale0"].shape == (8, 4)
    counters = [k for k in checkpoint if k.startswith("method/fedmepd/personalisation/counter/decoder.")]
    assert counters and all(checkpoint[k].shape[0] == 3 for k in counters)
    # personal filters and LACCA stay home
    with np.load(state / "hospital-01" / "fedmepd" / "state-r00002.npz") as kept:
        assert (any(k.startswith("lacca.") for k in kept.files)
                and any(k.startswith("encoders.t1ce.") for k in kept.files))
