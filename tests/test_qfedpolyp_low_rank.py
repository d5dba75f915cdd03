"""QFedPolyp's low-rank updates (``qfedpolyp.low-rank-bits``): each matrix-shaped tensor of a hospital's update as its
best rank-r factors at the hospital's bit-width, r fixed by the shape, the bit-width and the budget on both sides;
anything else refused; error feedback carries what the factors leave out. The same for the server's downlink delta
(``qfedpolyp.downlink-low-rank-bits``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.arrays import model_arrays
from common.config import ConfigError, load_job_config
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.base import Payload
from common.models.unet2d import PolypUNet
from common.quantization.codec import PayloadError, encode_model, encoded_nbytes
from common.quantization.low_rank import LEFT, RIGHT, decode_low_rank, encode_low_rank, rank_for
from strategies.qfedpolyp.hospital import QFedPolypHospital
from strategies.qfedpolyp.messages import PACKED, split_statistics

from .test_qfedpolyp_sparse import (  # noqa: F401
    BASE,
    LOW_RANK,
    assert_same,
    quick_training,
    sample_change,
    second_downlink,
    tampered,
    traffic_ratios,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def low_rank(rows: int, columns: int, rank: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 1e-3, (rows, rank)) @ rng.normal(0, 1, (rank, columns))).astype(np.float32)


def test_rank_follows_shape_bits_and_budget_and_small_or_flat_tensors_go_whole():
    assert rank_for((64, 32, 3, 3), 8, 0.45) == int(0.45 * 64 * 288 / (8 * (64 + 288)))  # 2
    assert rank_for((64, 32, 3, 3), 4, 0.45) == int(0.45 * 64 * 288 / (4 * (64 + 288)))  # 4: cheaper factors
    assert rank_for((64,), 8, 0.45) == 0 and rank_for((8, 8), 8, 0.45) == 0  # a vector; below 1024 entries
    assert rank_for((1, 4096), 8, 0.45) == 0  # rank 1 would take more entries than the tensor
    assert rank_for((64, 32, 3, 3), 8, 0.01) == 1  # at least rank 1


def test_a_tensor_of_low_rank_comes_back_within_the_factors_quantisation_and_the_rest_whole():
    change = {"conv.weight": low_rank(64, 288, 2).reshape(64, 32, 3, 3),
              "bias": np.linspace(-1e-3, 1e-3, 64, dtype=np.float32)}
    assert rank_for((64, 32, 3, 3), 8, 0.45) == 2
    encoded = encode_low_rank(change, 8, 0.45)
    decoded = decode_low_rank(encoded, change, 8, 0.45)
    assert list(decoded) == list(change) and all(decoded[k].shape == v.shape for k, v in change.items())
    error = np.abs(decoded["conv.weight"] - change["conv.weight"]).max()
    assert error < 0.02 * np.abs(change["conv.weight"]).max()  # rank 2 of a rank-2 matrix: 8-bit factors' error
    assert np.abs(decoded["bias"] - change["bias"]).max() <= 1.01e-3 / 255  # whole, within half a step
    noisy = {"conv.weight": np.random.default_rng(1).normal(0, 1, (64, 288)).astype(np.float32)}
    best = np.linalg.svd(noisy["conv.weight"], compute_uv=False)
    kept = 1 - np.square(decode_low_rank(encode_low_rank(noisy, 8, 0.45), noisy, 8, 0.45)["conv.weight"]
                         - noisy["conv.weight"]).sum() / np.square(noisy["conv.weight"]).sum()
    assert kept == pytest.approx(np.square(best[:2]).sum() / np.square(best).sum(), abs=2e-3)  # Eckart-Young


def test_a_unet_update_as_4_bit_factors_at_045_bits_is_over_64_times_smaller_than_its_floats():
    weights, _ = split_statistics(model_arrays(PolypUNet()))
    rng = np.random.default_rng(0)
    change = {k: rng.normal(0, 1e-3, v.shape).astype(v.dtype) for k, v in weights.items()}
    floats = sum(v.nbytes for v in change.values())
    assert 64 < floats / encoded_nbytes(encode_low_rank(change, 4, 0.45)) < 80


def test_payloads_of_another_rank_bit_width_or_content_are_refused():
    change = sample_change()
    encoded = encode_low_rank(change, 8, 0.45)
    names = {entry[0] for entry in json.loads(encoded["header"].tobytes())["tensors"]}
    assert names == {"conv.weight" + LEFT, "conv.weight" + RIGHT, "bias", "wide"}
    with pytest.raises(PayloadError, match="conv.weight\\|left.*shape"):
        decode_low_rank(encode_low_rank(change, 8, 0.9), change, 8, 0.45)  # a higher rank than assigned
    with pytest.raises(PayloadError, match="bit-width tag is 8, but 4 was assigned"):
        decode_low_rank(encoded, change, 4, 0.45)
    with pytest.raises(PayloadError, match="tagged 'weights', expected 'update'"):
        decode_low_rank(tampered(encoded, content="weights"), change, 8, 0.45)
    with pytest.raises(PayloadError, match="truncated"):
        decode_low_rank({**encoded, "data": encoded["data"][:-1]}, change, 8, 0.45)
    with pytest.raises(PayloadError, match="low-rank budget 8: use bits per entry above 0 and below the bit-width 8"):
        encode_low_rank(change, 8, 8)
    with pytest.raises(PayloadError, match="conv.weight: holds NaN"):
        encode_low_rank({**change, "conv.weight": np.full((64, 32, 3, 3), np.nan, np.float32)}, 8, 0.45)
    dense = encode_model(change, 8, content="update")  # a whole update where factors were assigned
    with pytest.raises(PayloadError, match="conv.weight"):
        decode_low_rank(dense, change, 8, 0.45)


def test_error_feedback_makes_low_rank_factors_track_the_sum_of_full_rank_updates():
    rng = np.random.default_rng(1)
    drift = low_rank(64, 288, 1, seed=2) + 0.3 * low_rank(64, 288, 6, seed=3)  # rank 7, every round; rank 2 sent
    updates = [{"w": drift + rng.normal(0, 1e-4, (64, 288)).astype(np.float32)} for _ in range(40)]

    def sent_total(feedback: bool) -> np.ndarray:
        residual, total = np.zeros((64, 288), np.float32), np.zeros((64, 288))
        for update in updates:
            change = {"w": update["w"] + (residual if feedback else 0)}
            sent = decode_low_rank(encode_low_rank(change, 8, 0.45), change, 8, 0.45)["w"]
            residual = change["w"] - sent
            total += sent
        return total

    truth = sum(u["w"].astype(np.float64) for u in updates)
    with_feedback = np.abs(sent_total(True) - truth).mean()
    assert with_feedback < 0.1 * np.abs(truth).mean()
    assert np.abs(sent_total(False) - truth).mean() > 5 * with_feedback  # lost every round


def test_settings_refuse_low_rank_with_weights_sparsity_or_bit_widths_that_cannot_carry_it():
    assert load_job_config({**BASE, "qfedpolyp.bit-widths": "4", "qfedpolyp.low-rank-bits": 0.45}
                           ).qfedpolyp.low_rank_bits == 0.45
    with pytest.raises(ConfigError, match="low-rank-bits=0.45 needs qfedpolyp.quantise='update' and sparsity=1"):
        load_job_config({**BASE, "qfedpolyp.quantise": "weights", "qfedpolyp.error-feedback": False,
                         "qfedpolyp.low-rank-bits": 0.45})
    with pytest.raises(ConfigError, match="needs qfedpolyp.quantise='update' and sparsity=1"):
        load_job_config({**BASE, "qfedpolyp.sparsity": 0.3, "qfedpolyp.low-rank-bits": 0.45})
    for widths in ("1", "4,4,32", "2"):
        budget = 2 if widths == "2" else 0.45
        with pytest.raises(ConfigError, match=f"low-rank-bits={budget:g}: the factors travel at the hospitals' "
                                              f"bit-widths \\({widths}\\)"):
            load_job_config({**BASE, "qfedpolyp.bit-widths": widths, "qfedpolyp.low-rank-bits": budget})


@pytest.mark.slow  # whole U-Net rounds (over a minute); fast: the U-Net ratio test, payloads of another rank refused
@pytest.mark.usefixtures("quick_training")
def test_low_rank_rounds_are_over_64_times_below_32_bits_and_a_forged_rank_is_refused_while_the_round_goes_on():
    job = {**BASE, "qfedpolyp.bit-widths": "4", "qfedpolyp.error-feedback": True, "qfedpolyp.low-rank-bits": 0.45,
           "qfedpolyp.statistics-bit-width": 8, "num-server-rounds": 2, "evaluate-every": 100}
    cfg = load_job_config(job)
    engine = run_rounds(cfg, simulated_sites(cfg, 2))
    plain = load_job_config({**BASE, "qfedpolyp.bit-widths": "32", "num-server-rounds": 1, "evaluate-every": 100})
    baseline = run_rounds(plain, simulated_sites(plain, 2))
    for name, traffic in engine.history[-1]["traffic"].items():
        assert baseline.history[-1]["traffic"][name]["up"] / traffic["up"] > 64
    assert set(engine.history[-1]["method"]["uplink-arrays"]) == {"hospital-00", "hospital-01"}

    cfg = load_job_config({**job, "num-server-rounds": 1})
    sites = simulated_sites(cfg, 3)
    engine = RoundEngine(cfg)
    infos = [QFedPolypHospital(cfg, site).info() for site in sites]
    chosen = engine.select(1, infos)
    replies = []
    for info, site in zip(chosen, sites):
        reply = QFedPolypHospital(cfg, site).timed_train(1, engine.downlink(1, info))
        if info.name == "hospital-01":  # factors of twice the assigned rank
            weights, _ = split_statistics(model_arrays(PolypUNet()))
            change = {k: np.full(v.shape, 1e-3, v.dtype) for k, v in weights.items()}
            reply = Payload(arrays={**reply.arrays, PACKED: encode_low_rank(change, 4, 0.9)}, metrics=reply.metrics)
        replies.append(RoundReply(info, reply))
    record = engine.complete_round(1, chosen, replies, 0.0, evaluate=False)
    assert record["aggregated"] == ["hospital-00", "hospital-02"]
    assert "hospital-01" in record["refused"] and "left" in str(record["refused"]["hospital-01"])


def test_the_statistics_check_recomputes_batchnorm_statistics_as_the_plain_average_over_the_images():
    from benchmarks.qfedpolyp.statistics_check import recompute_statistics

    class Images:  # what the task's batches yield: (image, mask) pairs
        def __init__(self, x):
            self.x = x

    class Task:
        @staticmethod
        def batches(images, size, device, rng, train):
            return ((images.x[i:i + size], None) for i in range(0, len(images.x), size))

    layer = torch.nn.BatchNorm2d(3)
    layer.running_mean.fill_(5.0)
    x = torch.randn(70, 3, 4, 4) * torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1) + 1.5
    recompute_statistics(torch.nn.Sequential(layer), Task(), Images(x))
    batch_means = torch.stack([x[i:i + 32].mean(dim=(0, 2, 3)) for i in range(0, 70, 32)])
    torch.testing.assert_close(layer.running_mean, batch_means.mean(0))  # every batch counts alike, not the last most
    assert torch.all(layer.running_var > torch.tensor([0.5, 3.0, 7.0]))


def test_to_target_finds_the_round_a_lagging_row_reaches_32_bits_and_its_uplink_until_then(tmp_path):
    from benchmarks.qfedpolyp.table1 import run_name
    from benchmarks.qfedpolyp.to_target import main, rows

    def run(name: str, dice: list[float], uplink: int) -> object:
        folder = tmp_path / "runs" / run_name(name)
        folder.mkdir(parents=True)
        folder.joinpath("metrics.jsonl").write_text(
            "".join(json.dumps({"round": i + 1, "test": {"dice": d}}) + "\n" for i, d in enumerate(dice)))
        return folder, {"config": name, "uplink_bytes": uplink}

    climb = [0.1 * i for i in range(1, 11)]  # 32 bits: 0.1 .. 1.0, rounds 6-10 average 0.8
    reference, reference_row = run("32,32,32,32,32", climb, 6400)
    lagging, lagging_row = run("1,1,1,1,1/update+ef", [0.0, 0.0, 0.0] + climb, 100)  # 3 rounds late
    stalled, stalled_row = run("2,2,2,2,2/update", [0.5] * 13, 200)
    (tmp_path / "table1.json").write_text(json.dumps([reference_row, lagging_row, stalled_row]))

    by_run = {row["run"]: row for row in rows(reference, [lagging, stalled], at=10)}
    late, never = by_run[lagging.name], by_run[stalled.name]
    assert late["target"] == pytest.approx(0.8) and late["reached"] == 13
    assert late["uplink_ratio_per_round"] == 64 and late["uplink_ratio_to_target"] == pytest.approx(64 * 10 / 13)
    assert late["dice_at"] == pytest.approx(0.5)  # rounds 6-10 of the lagging row: 0.3 .. 0.7
    assert never["reached"] is None and never["uplink_ratio_to_target"] is None
    assert late["gap_last"] is None  # 32 bits ran 10 rounds, the row 13: no 32-bit Dice to compare its last rounds with
    table = tmp_path / "target.md"
    main([str(reference), str(lagging), str(stalled), "--at", "10", "--table", str(table)])
    assert "| 13 | 64.0x | 49.2x | - |" in table.read_text() and "not by round 13" in table.read_text()
    short, short_row = run("3,3,3,3,3", [0.05 * i for i in range(1, 9)], 640)  # 8 rounds: gap over rounds 4-8
    (tmp_path / "table1.json").write_text(json.dumps([reference_row, lagging_row, stalled_row, short_row]))
    assert rows(reference, [short], at=8)[0]["gap_last"] == pytest.approx(0.6 - 0.3)
    with pytest.raises(SystemExit, match="needs at least 12"):
        main([str(reference), str(lagging), "--at", "12"])
    with pytest.raises(SystemExit, match="no row for the run"):
        main([str(reference), str(run("4,4,4,4,4", climb, 1)[0]), "--at", "10"])


def test_table1_reads_the_low_rank_row_trained_from_the_hospitals_own_model():
    from benchmarks.qfedpolyp.table1 import parse_config, sparse_targets

    row = "4,4,4,4,4/update+ef/rank0.45/stats8/own/slr1.5"
    assert parse_config(row) == {
        "bit_widths": "4,4,4,4,4", "quantise": "update", "error_feedback": True, "low_rank_bits": 0.45,
        "statistics_bit_width": 8, "train_from": "own", "server_learning_rate": 1.5}
    assert sparse_targets(row, 66.0) == (64.0, None)
    with pytest.raises(SystemExit, match="unknown option 'owner'"):
        parse_config("4,4,4,4,4/update+ef/rank0.45/owner")


def test_settings_refuse_a_low_rank_downlink_without_a_dense_delta_or_a_bit_width_to_carry_it():
    cfg = load_job_config({**BASE, "qfedpolyp.error-feedback": True, "qfedpolyp.downlink": "delta",
                           "qfedpolyp.downlink-bit-width": 4, **LOW_RANK})
    assert cfg.qfedpolyp.downlink_low_rank_bits == 1.0
    for extra, match in (({"qfedpolyp.downlink": "model"}, "needs qfedpolyp.downlink='delta' and downlink-sparsity=1"),
                         ({"qfedpolyp.downlink-sparsity": 0.5}, "needs qfedpolyp.downlink='delta'"),
                         ({"qfedpolyp.downlink-bit-width": 1}, "travel at downlink-bit-width \\(1\\)"),
                         ({"qfedpolyp.downlink-low-rank-bits": 4}, "travel at downlink-bit-width \\(4\\)")):
        with pytest.raises(ConfigError, match=match):
            load_job_config({**BASE, "qfedpolyp.error-feedback": True, "qfedpolyp.downlink": "delta",
                             "qfedpolyp.downlink-bit-width": 4, **LOW_RANK, **extra})


def low_rank_both_ways(**extra):
    return load_job_config({**BASE, "qfedpolyp.error-feedback": True, "qfedpolyp.downlink": "delta",
                            "qfedpolyp.downlink-bit-width": 4, **LOW_RANK, "num-server-rounds": 2,
                            "evaluate-every": 100, **extra})


@pytest.mark.slow  # whole U-Net rounds both ways; fast: the U-Net ratio test and the signs' both-ways test
@pytest.mark.usefixtures("quick_training")
def test_low_rank_both_ways_is_over_64_times_below_32_bits_up_and_32_times_both_ways():
    engine = run_rounds(cfg := low_rank_both_ways(), simulated_sites(cfg, 2))
    ratios = traffic_ratios(engine)
    assert set(ratios) == {"hospital-00", "hospital-01"}
    assert all(up > 64 and both > 32 for up, both in ratios.values()), ratios
    delta = engine.method._delta[2]
    header = json.loads(delta["header"].tobytes())
    assert header["content"] == "delta" and header["bits"] == 4
    assert any(name.endswith(LEFT) for name, *_ in header["tensors"])


@pytest.mark.usefixtures("quick_training")
def test_a_hospital_refuses_a_low_rank_delta_of_another_rank_content_or_kind():
    from common.quantization.sparse import encode_sparse

    engine, hospital, good, reference, memory = second_downlink(low_rank_both_ways())
    assert_same(hospital.received_arrays(good, reference, memory), engine.method.held)
    weights, _ = split_statistics(reference)
    delta = decode_low_rank(good.arrays[PACKED], weights, 4, 1.0, expected_content="delta")
    for packed, match in ((encode_low_rank(delta, 4, 2.0, content="delta"), "left"),
                          (encode_low_rank(delta, 4, 1.0, content="update"), "tagged 'update', expected 'delta'"),
                          (encode_low_rank(delta, 8, 1.0, content="delta"), "tag is 8"),
                          (encode_sparse(delta, 4, 0.3, content="delta"), "")):
        with pytest.raises(PayloadError, match=match):
            hospital.received_arrays(Payload(arrays={**good.arrays, PACKED: packed}, config=good.config),
                                     reference, memory)


def test_a_low_rank_product_summed_rank_by_rank_equals_the_float64_matrix_product():
    rng = np.random.default_rng(3)
    left, right = rng.normal(size=(64, 7)).astype(np.float32), rng.normal(size=(7, 90)).astype(np.float32)
    from common.quantization.low_rank import product

    expected = left.astype(np.float64) @ right.astype(np.float64)
    assert product(left, right).dtype == np.float64
    np.testing.assert_allclose(product(left, right), expected, rtol=1e-12, atol=1e-12)
