"""QFedPolyp below 2 bits: 1-bit sign codes (each value's sign times one scale per tensor, the mean magnitude) for
hospitals' updates and the server's downlink delta, dense or sparse, with error feedback; refused on weights and
wherever the payload does not match the assignment."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.arrays import model_arrays
from common.config import ConfigError, load_job_config
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.round_engine import RoundEngine
from common.methods.base import HospitalInfo
from common.models.unet2d import PolypUNet
from common.quantization.codec import PayloadError, decode_model, encode_model, encoded_nbytes
from common.quantization.sparse import decode_sparse, encode_sparse, kept_count
from strategies.qfedpolyp.messages import (
    DOWNLINK_DIGEST_KEY,
    STATISTICS,
    model_digest,
    pack_statistics,
    split_statistics,
    unpack_statistics,
)

from .test_qfedpolyp_sparse import (  # noqa: F401
    BASE,
    assert_same,
    play_round,
    quick_training,
    sample_change,
    tampered,
    traffic_ratios,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_dense_signs_send_each_value_as_plus_or_minus_the_tensors_mean_magnitude():
    change = sample_change()
    encoded = encode_model(change, 1, content="update")
    decoded = decode_model(encoded, reference=change, expected_bits=1, expected_content="update")
    for name, value in change.items():
        scale = np.abs(value.astype(np.float64)).mean()
        expected = np.where(value >= 0, scale, -scale).astype(value.dtype)
        np.testing.assert_array_equal(decoded[name], expected, err_msg=name)
    assert encoded["data"].size == sum(-(-v.size // 8) for v in change.values())  # one bit per value
    np.testing.assert_array_equal(encoded["ranges"][:, 0], -encoded["ranges"][:, 1] / 2)
    zero = decode_model(encode_model({"w": np.zeros(9, np.float32)}, 1, content="update"))["w"]
    np.testing.assert_array_equal(zero, np.zeros(9, np.float32))  # no change: nothing moves


@pytest.mark.parametrize("block", [1, 8])
def test_sparse_signs_keep_the_largest_blocks_at_their_mean_magnitude(block):
    change = sample_change(3)
    encoded = encode_sparse(change, 1, 0.3, block=block, content="delta")
    decoded = decode_sparse(encoded, reference=change, expected_bits=1, expected_content="delta",
                            expected_sparsity=0.3, expected_block=block)
    reference = decode_sparse(encode_sparse(change, 32, 0.3, block=block), reference=change)  # the same entries
    for name, value in change.items():
        kept = reference[name] != 0
        sent = decoded[name]
        assert not sent[~kept].any(), name
        scale = np.abs(value[kept].astype(np.float64)).mean()
        expected = np.where(value[kept] >= 0, scale, -scale).astype(value.dtype)
        np.testing.assert_array_equal(sent[kept], expected, err_msg=name)  # sizes here fill whole blocks


def test_a_unet_update_at_1_bit_top_30_percent_of_blocks_of_8_is_over_64_times_smaller_than_its_floats():
    rng = np.random.default_rng(0)
    weights, _ = split_statistics(model_arrays(PolypUNet()))
    change = {k: rng.normal(0, 1e-3, v.shape).astype(v.dtype) for k, v in weights.items()}
    floats = sum(v.nbytes for v in change.values())
    assert floats / encoded_nbytes(encode_sparse(change, 1, 0.3, block=8)) > 64
    assert floats / encoded_nbytes(encode_sparse(change, 2, 0.35, block=8)) < 40  # what it replaces


def test_error_feedback_makes_sparse_signs_track_the_sum_of_the_updates():
    rng = np.random.default_rng(1)
    updates = [{"w": (rng.normal(0, 1e-3, 2048) + 3e-4).astype(np.float32)} for _ in range(60)]

    def sent_total(feedback: bool) -> np.ndarray:
        residual, total = np.zeros(2048, np.float32), np.zeros(2048)
        for update in updates:
            change = update["w"] + (residual if feedback else 0)
            sent = decode_sparse(encode_sparse({"w": change}, 1, 0.3, block=8))["w"]
            residual = change - sent
            total += sent
        return total

    truth = sum(u["w"].astype(np.float64) for u in updates)
    with_feedback = np.abs(sent_total(True) - truth).mean()
    without = np.abs(sent_total(False) - truth).mean()
    assert with_feedback < 0.1 * np.abs(truth).mean()  # what was left out is sent later
    assert without > 5 * with_feedback


# --- refusals -------------------------------------------------------------------------------------
def test_one_bit_weights_are_refused_when_encoded_and_when_received():
    arrays = {"w": np.linspace(-1, 1, 50, dtype=np.float32)}
    with pytest.raises(PayloadError, match="1 bit .*is for a round's change.*not for weights"):
        encode_model(arrays, 1)
    forged = tampered(encode_model(arrays, 1, content="update"), content="weights")
    with pytest.raises(PayloadError, match="bit-width tag 1 \\(signs\\) on weights"):
        decode_model(forged)


def test_one_bit_payloads_that_do_not_match_the_assignment_are_refused():
    change = sample_change()
    dense, sparse = encode_model(change, 1, content="update"), encode_sparse(change, 1, 0.3, block=8)
    with pytest.raises(PayloadError, match="bit-width tag is 1, but 2 was assigned"):
        decode_model(dense, reference=change, expected_bits=2)
    with pytest.raises(PayloadError, match="bit-width tag is 1, but 2 was assigned"):
        decode_sparse(sparse, reference=change, expected_bits=2)
    with pytest.raises(PayloadError, match="bit-width tag is 2, but 1 was assigned"):
        decode_sparse(encode_sparse(change, 2, 0.3, block=8), reference=change, expected_bits=1)
    with pytest.raises(PayloadError, match="conv.weight: .* sent, but .* were assigned \\(sparsity 0.2\\)"):
        decode_sparse(sparse, reference=change, expected_bits=1, expected_sparsity=0.2)
    with pytest.raises(PayloadError, match="positions are of blocks of 8 entries, but 16 was assigned"):
        decode_sparse(sparse, reference=change, expected_bits=1, expected_block=16)
    for payload, decode in ((dense, decode_model), (sparse, decode_sparse)):
        lopsided = payload["ranges"].copy()
        lopsided[0, 0] = 0.0  # min 0, step 2 scale: every value would become 0 or +2 scale
        with pytest.raises(PayloadError, match="1-bit sign codes need min = -step/2"):
            decode({**payload, "ranges": lopsided}, reference=change)
        negative = payload["ranges"].copy()
        negative[0] = [0.5, -1.0]
        with pytest.raises(PayloadError, match="min/step are not finite and non-negative"):
            decode({**payload, "ranges": negative}, reference=change)
    truncated = {**sparse, "data": sparse["data"][:-1]}
    with pytest.raises(PayloadError, match="truncated"):
        decode_sparse(truncated, reference=change)


def test_settings_and_hospitals_refuse_one_bit_for_weights():
    with pytest.raises(ConfigError, match="1 bit .*needs qfedpolyp.quantise='update'"):
        load_job_config({**BASE, "qfedpolyp.quantise": "weights", "qfedpolyp.bit-widths": "1"})
    with pytest.raises(ConfigError, match="downlink-bit-width=1 .*needs qfedpolyp.downlink='delta'"):
        load_job_config({**BASE, "qfedpolyp.bit-widths": "1", "qfedpolyp.downlink-bit-width": 1})
    assert load_job_config({**BASE, "qfedpolyp.bit-widths": "1", "qfedpolyp.downlink": "delta",
                            "qfedpolyp.downlink-bit-width": 1}).qfedpolyp.bit_width_list == [1]
    weights = RoundEngine(load_job_config({k: v for k, v in BASE.items() if k != "qfedpolyp.quantise"})).method
    declared = HospitalInfo("hospital-07", 0, properties={"bit-width": 1})
    with pytest.raises(ValueError, match="hospital hospital-07: declared bit-width: 1 bit .*not for weights"):
        weights.check_hospital(declared)
    updates = RoundEngine(load_job_config({**BASE, "qfedpolyp.error-feedback": True})).method
    updates.check_hospital(declared)  # a change can travel as signs


# --- whole rounds -------------------------------------------------------------------------------
def sign_job(**extra):
    return load_job_config({**BASE, "qfedpolyp.bit-widths": "1", "qfedpolyp.error-feedback": True,
                            "qfedpolyp.sparsity": 0.3, "qfedpolyp.sparse-block": 8, "qfedpolyp.downlink": "delta",
                            "qfedpolyp.downlink-bit-width": 1, "qfedpolyp.downlink-sparsity": 0.6,
                            "num-server-rounds": 4, "evaluate-every": 100, **extra})


@pytest.mark.usefixtures("quick_training")
def test_hospitals_rebuild_a_one_bit_delta_bit_for_bit_and_the_server_takes_their_signs():
    cfg = sign_job()
    sites = simulated_sites(cfg, 3)
    engine = RoundEngine(cfg)
    server = engine.method
    for rnd in range(1, 5):
        record, received = play_round(cfg, engine, sites, rnd)
        assert record["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"], record["refused"]
        for payload, arrays in received.values():
            assert_same(arrays, server.held)
            assert payload.config[DOWNLINK_DIGEST_KEY] == model_digest(server.held)
        if rnd > 1:  # a 1-bit delta of the top 60 % of blocks went to everyone
            assert set(record["method"]["downlink-base"].values()) == {rnd - 1}
            delta = server._delta[2]
            assert json.loads(delta["header"].tobytes())["bits"] == 1
            conv = decode_sparse(delta)["enc2.conv2.weight"]
            assert np.unique(np.abs(conv[conv != 0])).size == 1  # one magnitude per tensor
            assert (conv != 0).sum() == kept_count(conv.size, 0.6, 8) * 8


@pytest.mark.usefixtures("quick_training")
def test_one_bit_both_ways_is_over_64_times_below_32_bits_up_and_32_times_both_ways():
    cfg = sign_job(**{"num-server-rounds": 2})
    ratios = traffic_ratios(run_rounds(cfg, simulated_sites(cfg, 2)))
    assert set(ratios) == {"hospital-00", "hospital-01"}
    assert all(up > 64 and both > 32 for up, both in ratios.values()), ratios


def test_statistics_at_8_bits_keep_variances_positive_and_are_refused_at_another_width():
    cfg = load_job_config({**BASE, "qfedpolyp.statistics-bit-width": 8})
    assert cfg.qfedpolyp.statistics_bit_width == 8
    with pytest.raises(ConfigError, match="statistics-bit-width=8 needs qfedpolyp.quantise='update' or"):
        load_job_config({k: v for k, v in BASE.items() if k != "qfedpolyp.quantise"} |
                        {"qfedpolyp.statistics-bit-width": 8})
    with pytest.raises(ConfigError, match="'qfedpolyp.statistics-bit-width'.*not for weights"):
        load_job_config({**BASE, "qfedpolyp.statistics-bit-width": 1})
    _, statistics = split_statistics(model_arrays(PolypUNet()))
    rng = np.random.default_rng(0)
    statistics = {k: (rng.uniform(1e-4, 3.0, v.shape) if k.endswith("var") else rng.normal(0, 1, v.shape)).astype(
        v.dtype) for k, v in statistics.items()}
    packed = pack_statistics(statistics, 8)
    rebuilt = unpack_statistics({STATISTICS: packed}, statistics, 8, "the reply of hospital-00")
    for name, value in rebuilt.items():
        assert value.min() >= statistics[name].min(), name  # a variance never turns negative or smaller than sent
        np.testing.assert_allclose(value, statistics[name], atol=np.ptp(statistics[name]) / 255, err_msg=name)
    with pytest.raises(PayloadError, match="the reply of hospital-00 'statistics': bit-width tag is 8, but 32"):
        unpack_statistics({STATISTICS: packed}, statistics, 32, "the reply of hospital-00")
    with pytest.raises(PayloadError, match="the reply of hospital-00 carries no 'statistics'"):
        unpack_statistics({}, statistics, 8, "the reply of hospital-00")


SIGN_ROW = "1,1,1,1,1/update+ef/top0.3/block8/stats8"
SIGN_BOTH_WAYS = "1,1,1,1,1/update+ef/top0.3/block8/delta2+top0.6/stats8"


def table_row(config, up, down, dice):
    return {"config": config, "uplink_bytes": up, "downlink_bytes": down, "dice_last5": dice, "dice": dice}


def test_table1_reads_sign_rows_and_holds_each_sparse_row_to_the_highest_goal_it_reaches():
    from benchmarks.qfedpolyp.table1 import goals, parse_config, sparse_targets

    assert parse_config(SIGN_BOTH_WAYS) == {
        "bit_widths": "1,1,1,1,1", "quantise": "update", "error_feedback": True, "sparsity": 0.3, "sparsify": "top-k",
        "sparse_block": 8, "downlink": "delta", "downlink_bit_width": 2, "downlink_sparsity": 0.6,
        "statistics_bit_width": 8}
    assert sparse_targets(SIGN_ROW, 66.0) == (64.0, None)
    assert sparse_targets(SIGN_ROW, 40.0) == (32.0, None)
    assert sparse_targets(SIGN_BOTH_WAYS, 66.0, 33.0) == (64.0, 32.0)
    assert sparse_targets(SIGN_BOTH_WAYS, 66.0, 20.0) == (32.0, 15.0)  # both ways short of 32x: the past-32x goals
    assert sparse_targets("2,2,2,2,2/update+ef") is None
    baseline = table_row("32,32,32,32,32", 6400, 6400, 0.700)
    rows = [baseline, table_row(SIGN_ROW, 98, 6400, 0.690), table_row(SIGN_BOTH_WAYS, 98, 300, 0.680)]
    lines = {line.split(")")[0].lstrip("| ("): line for line in goals(rows, baseline) if line.startswith("| (")}
    assert "uplink >= 64x smaller than 32 bits" in lines[SIGN_ROW] and lines[SIGN_ROW].endswith("| yes |")
    assert "uplink >= 64x and traffic both ways >= 32x" in lines[SIGN_BOTH_WAYS]
    assert lines[SIGN_BOTH_WAYS].endswith("| no |")  # 0.020 below 32 bits


def test_seeds_table_judges_a_sign_row_over_three_seeds_against_the_64x_goal(tmp_path):
    from benchmarks.qfedpolyp import seeds

    folders = []
    for seed, (dice32, dice) in {42: (0.70, 0.69), 43: (0.72, 0.70), 44: (0.68, 0.67)}.items():
        folder = tmp_path / str(seed)
        (folder / "runs" / "32-32-32-32-32").mkdir(parents=True)
        (folder / "runs" / "32-32-32-32-32" / "config.json").write_text(json.dumps({"seed": seed}))
        (folder / "runs" / "32-32-32-32-32" / "checkpoints").mkdir()  # 320 floats: 6400 B from 5 hospitals = 32 bits
        np.savez(folder / "runs" / "32-32-32-32-32" / "checkpoints" / "round-00020.npz",
                 **{"method/global/w": np.zeros(320, np.float32)})
        rows = [table_row("32,32,32,32,32", 6400, 6400, dice32), table_row(SIGN_ROW, 98, 6400, dice)]
        (folder / "table1.json").write_text(json.dumps(rows))
        folders.append(str(folder))
    table = tmp_path / "seeds.md"
    seeds.main([*folders, "--table", str(table)])
    line = next(line for line in table.read_text().splitlines() if line.startswith("| (1,"))
    assert line.split(" | ")[1:9] == ["0.490", "65.31x", "32.490", "1.97x", "+0.010", "+0.020", "+0.010", "+0.013"]
    assert "uplink >= 64x, mean gap <= 0.015" in line and line.endswith("| yes |")


def test_codec_frontier_measures_bits_and_the_share_of_an_update_each_code_keeps():
    """benchmarks.qfedpolyp.frontier: dense signs keep all of a +-c update and cost 1 bit; floats of the top half of
    the blocks cost 16 bits and 1/8 for the positions and keep the larger half exactly; what hospitals share and how
    alike consecutive updates are comes out of the updates."""
    from benchmarks.qfedpolyp.frontier import measure, parse, structure

    rng = np.random.default_rng(0)
    signs = rng.choice([-0.01, 0.01], size=65536).astype(np.float32)  # large enough for the header not to count
    scaled = (signs * np.repeat(rng.uniform(0.5, 2.0, 8192), 8)).astype(np.float32)
    updates = {1: {h: {"w": -scaled} for h in ("a", "b")},
               2: {"a": {"w": scaled}, "b": {"w": scaled}},
               3: {"a": {"w": signs}, "b": {"w": -signs}}}
    assert parse("1/top0.3/block8") == (1, 0.3, 8, 0.0) and parse("8/rank0.4") == (8, 1.0, 1, 0.4)
    equal = {1: updates[1], 2: {h: {"w": signs} for h in "ab"}}
    rows = {r["config"]: r for r in measure(equal, ["1", "32/top0.5/block8"])}
    assert rows["1"]["kept-own"] == pytest.approx(1.0)
    assert rows["1"]["bits-per-parameter"] == pytest.approx(1.0, abs=0.02)
    floats = rows["32/top0.5/block8"]
    assert floats["bits-per-parameter"] == pytest.approx(16 + 1 / 8, abs=0.02)
    assert floats["kept-own"] == pytest.approx(0.5) and floats["kept-mean"] == pytest.approx(0.5)  # equal blocks
    sparse = measure({1: updates[1], 2: updates[2]}, ["32/top0.5/block8"])[0]
    top_half = np.sort(np.square(scaled.reshape(-1, 8)).sum(1))[4096:].sum() / np.square(scaled).sum()
    assert sparse["kept-own"] == pytest.approx(top_half, rel=1e-4) and top_half > 0.6
    shape = structure(updates)
    assert [r["shared"] for r in shape] == pytest.approx([1.0, 1.0, 0.0])
    assert shape[1]["cosine-with-last"] == pytest.approx(-1.0) and "cosine-with-last" not in shape[0]
