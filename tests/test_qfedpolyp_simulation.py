"""QFedPolyp through Flower's simulation engine with mixed bit-widths: two rounds complete, every
hospital uploads at its own bit-width, and the bytes measured on the serialised messages shrink with
the bit-width as the codec says."""

from __future__ import annotations

import numpy as np
import pytest

from common.arrays import model_arrays
from common.models.unet2d import PolypUNet
from common.quantization.codec import encode_model, encoded_nbytes
from server_app.checkpoint import load_checkpoint
from server_app.results import read_history

from .flower_processes import TINY_JOB, run_to_completion, simulation_superlink

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the long tier (.ci/run)


def test_two_round_simulation_with_mixed_bit_widths(tmp_path):
    results = tmp_path / "results"
    job = {**TINY_JOB, "task": "polyp-segmentation", "strategy": "qfedpolyp", "synthetic-samples": 60,
           "image-size": 32, "batch-size": 8, "num-server-rounds": 2, "min-available-hospitals": 3, "evaluate-every": 2,
           "qfedpolyp.bit-widths": "4,8,32", "run-name": "qfedpolyp", "results-dir": str(results),
           "state-dir": str(tmp_path / "state")}
    with simulation_superlink(tmp_path) as home:
        run_to_completion(home, job, {"num-supernodes": 3})

    history = read_history(results / "qfedpolyp")
    assert [r["round"] for r in history] == [1, 2]
    codec_bytes = {bits: encoded_nbytes(encode_model(model_arrays(PolypUNet()), bits)) for bits in (4, 8, 32)}
    for record in history:
        assert record["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"] and not record["refused"]
        assert record["method"]["bit-widths"] == {"hospital-00": 4, "hospital-01": 8, "hospital-02": 32}
        up = {name: traffic["up"] for name, traffic in record["traffic"].items()}
        for name, bits in record["method"]["bit-widths"].items():
            assert codec_bytes[bits] < up[name] < codec_bytes[bits] * 1.01 + 4000, name  # the codes, little else
        assert up["hospital-02"] / up["hospital-01"] >= 3.9 and up["hospital-02"] / up["hospital-00"] >= 7.7
        assert all(t["down"] > codec_bytes[32] for t in record["traffic"].values())  # plain floats go down
    assert 0.0 <= history[-1]["test"]["dice"] <= 1.0
    checkpoint = load_checkpoint(results / "qfedpolyp")
    weight = checkpoint["method/global/enc1.conv1.weight"]
    assert weight.shape == (32, 3, 3, 3) and weight.dtype == np.float32 and np.isfinite(weight).all()
