"""QFedPolyp's core in one process: the b-bit packed codec, fake quantisation with straight-through
gradients, bit-width assignment, the server's checks and averaging, and a small in-process run."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from common.arrays import model_arrays, weighted_average
from common.config import ConfigError, JobConfig
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.base import HospitalInfo, Payload
from common.models.unet2d import PolypUNet
from common.quantization.codec import (
    WEIGHT_BIT_WIDTHS,
    PayloadError,
    decode_model,
    encode_model,
    pack_codes,
    packed_nbytes,
    quantise,
    unpack_codes,
)
from common.quantization.fake_quant import fake_quantize, quantization_aware
from strategies.qfedpolyp.messages import BIT_WIDTH_KEY, PACKED, assign_bit_width


def sample_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "conv.weight": rng.normal(0, 0.1, (8, 3, 3, 3)).astype(np.float32),
        "bn.running_var": rng.uniform(0.5, 2.0, 8).astype(np.float32),
        "constant": np.full(5, 0.25, np.float32),
        "single": np.array([-3.5], np.float32),
        "bn.num_batches_tracked": np.array(12345678901, np.int64),
        "wide": rng.normal(0, 1, 1001).astype(np.float64),
    }


# --- codec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", WEIGHT_BIT_WIDTHS)
def test_round_trip_within_half_a_step_for_every_bit_width(bits):
    original = sample_arrays(np.random.default_rng(bits))
    decoded = decode_model(encode_model(original, bits), reference=original, expected_bits=bits)
    assert list(decoded) == list(original)
    for name, value in original.items():
        assert decoded[name].dtype == value.dtype and decoded[name].shape == value.shape
        if value.dtype.kind != "f" or bits == 32:
            np.testing.assert_array_equal(decoded[name], value, err_msg=name)  # integers and floats at 32: exact
            continue
        step = (value.max() - value.min()) / (2 ** bits - 1)
        error = np.abs(decoded[name].astype(np.float64) - value)
        assert error.max() <= step / 2 + np.abs(value).max() * np.finfo(value.dtype).eps, name
        assert decoded[name].min() >= value.min(), name  # the minimum is exact: variances stay positive
        assert decoded[name].max() <= value.max() + step * 1e-6, name
    np.testing.assert_array_equal(decoded["constant"], original["constant"])  # a constant tensor is exact


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 7, 8, 11, 13, 16])
def test_codes_are_packed_at_exactly_b_bits(bits):
    codes = np.random.default_rng(bits).integers(0, 2 ** bits, 1001).astype(np.uint32)
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.size == packed_nbytes(1001, bits) == (1001 * bits + 7) // 8
    np.testing.assert_array_equal(unpack_codes(packed, 1001, bits), codes)


def test_packing_layout_two_codes_per_byte_at_4_bits_and_plain_bytes_at_8_and_16():
    np.testing.assert_array_equal(pack_codes(np.array([1, 2, 3]), 4), [0x21, 0x03])
    codes = np.arange(300, dtype=np.uint32) * 200 % 65536
    np.testing.assert_array_equal(pack_codes(codes % 256, 8), (codes % 256).astype(np.uint8))
    np.testing.assert_array_equal(pack_codes(codes, 16), codes.astype("<u2").view(np.uint8))
    assert pack_codes(np.full(8, 7), 3).tolist() == [0xFF, 0xFF, 0xFF]


def test_a_whole_unet_shrinks_by_about_32_over_b():
    arrays = model_arrays(PolypUNet())
    sizes = {bits: sum(a.nbytes for a in encode_model(arrays, bits).values()) for bits in (2, 4, 8, 16, 32)}
    float_bytes = sum(a.nbytes for a in arrays.values())
    assert float_bytes <= sizes[32] <= float_bytes + 8000  # header + ranges only
    assert float_bytes / sizes[8] >= 3.95 and float_bytes / sizes[4] >= 7.85 and float_bytes / sizes[2] >= 15.5
    encoded = encode_model(arrays, 4)
    float_values = sum(a.size for a in arrays.values() if a.dtype.kind == "f")
    integer_bytes = sum(a.nbytes for a in arrays.values() if a.dtype.kind != "f")
    assert encoded["data"].size < float_values / 2 + len(arrays) + integer_bytes  # two codes per byte


def tampered(encoded: dict, **header_changes) -> dict:
    header = json.loads(encoded["header"].tobytes())
    header.update(header_changes)
    return {**encoded, "header": np.frombuffer(json.dumps(header).encode(), np.uint8).copy()}


def test_malformed_payloads_are_refused_with_the_reason():
    original = sample_arrays(np.random.default_rng(0))
    good = encode_model(original, 8)
    decode_model(good, original, 8)
    header = json.loads(good["header"].tobytes())

    with pytest.raises(PayloadError, match="tag is 4, but 8 was assigned"):
        decode_model(encode_model(original, 4), original, expected_bits=8)
    with pytest.raises(PayloadError, match="bit-width tag: 33 is not a bit-width"):
        decode_model(tampered(good, bits=33), original)
    with pytest.raises(PayloadError, match="truncated"):
        decode_model({**good, "data": good["data"][:-1]}, original)
    with pytest.raises(PayloadError, match="padded"):
        decode_model({**good, "data": np.concatenate([good["data"], np.zeros(1, np.uint8)])}, original)
    reshaped = [[n, [24, 3, 3, 1] if n == "conv.weight" else s, d] for n, s, d in header["tensors"]]
    with pytest.raises(PayloadError, match=r"conv.weight has shape \(24, 3, 3, 1\), expected \(8, 3, 3, 3\)"):
        decode_model(tampered(good, tensors=reshaped), original)  # same element count: only the shape is wrong
    with pytest.raises(PayloadError, match="truncated"):
        grown = [[n, [9, 3, 3, 3] if n == "conv.weight" else s, d] for n, s, d in header["tensors"]]
        decode_model(tampered(good, tensors=grown), original)
    renamed = [["other" if n == "single" else n, s, d] for n, s, d in header["tensors"]]
    with pytest.raises(PayloadError, match="missing \\['single'\\], unexpected \\['other'\\]"):
        decode_model(tampered(good, tensors=renamed), original)
    nan_ranges = good["ranges"].copy()
    nan_ranges[0, 1] = np.nan
    with pytest.raises(PayloadError, match="conv.weight: min/step are not finite"):
        decode_model({**good, "ranges": nan_ranges}, original)
    negative = good["ranges"].copy()
    negative[1, 1] = -1.0
    with pytest.raises(PayloadError, match="bn.running_var: min/step are not finite and non-negative"):
        decode_model({**good, "ranges": negative}, original)
    plain = encode_model(original, 32)
    data = plain["data"].copy()
    data[:4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)  # first value of conv.weight
    with pytest.raises(PayloadError, match="conv.weight holds NaN"):
        decode_model({**plain, "data": data}, original)
    with pytest.raises(PayloadError, match="not JSON"):
        decode_model({**good, "header": np.frombuffer(b"{not json", np.uint8)}, original)
    with pytest.raises(PayloadError, match="lacks \\['ranges'\\]"):
        decode_model({"header": good["header"], "data": good["data"]}, original)
    with pytest.raises(PayloadError, match="ranges are float32"):
        decode_model({**good, "ranges": good["ranges"].astype(np.float32)}, original)


def test_encoding_refuses_nan_weights():
    arrays = {"w": np.array([0.0, np.nan], np.float32)}
    with pytest.raises(PayloadError, match="w: holds NaN"):
        encode_model(arrays, 8)


# --- fake quantisation ----------------------------------------------------------------------------
def test_straight_through_gradient_and_the_codec_grid():
    torch.manual_seed(0)
    weight = torch.randn(64, 9, requires_grad=True)
    upstream = torch.randn(64, 9)
    quantised = fake_quantize(weight, 4)
    (upstream * quantised).sum().backward()
    torch.testing.assert_close(weight.grad, upstream)  # d/dw = d/dw~: the rounding is skipped
    assert quantised.detach().unique().numel() <= 16
    codes, low, step = quantise(weight.detach().numpy(), 4)
    rebuilt = torch.from_numpy((low + codes * step).reshape(64, 9)).float()
    torch.testing.assert_close(quantised.detach(), rebuilt, atol=1e-6, rtol=0)  # what the server rebuilds

    constant = torch.full((3, 3), 0.5, requires_grad=True)
    out = fake_quantize(constant, 2)
    out.sum().backward()
    assert torch.equal(out.detach(), constant.detach()) and torch.equal(constant.grad, torch.ones(3, 3))
    assert fake_quantize(weight, 32) is weight


def test_training_inside_quantization_aware_updates_the_full_precision_weights():
    torch.manual_seed(0)
    model = PolypUNet(widths=(4, 8, 8, 8))
    names_before = sorted(model.state_dict())
    params_before = {id(p) for p in model.parameters()}
    latent_before = model.enc1.conv1.weight.detach().clone()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with quantization_aware(model, 3):
        assert model.enc1.conv1.weight.unique().numel() <= 8 and model.up1.weight.unique().numel() <= 8
        assert {id(p) for p in model.parameters()} == params_before
        loss = model(torch.randn(2, 3, 16, 16)).square().mean()
        loss.backward()
        optimizer.step()
        seen_in_forward = model.enc1.conv1.weight.detach().clone()
    assert sorted(model.state_dict()) == names_before
    latent = model.enc1.conv1.weight.detach()
    assert not torch.equal(latent, latent_before)  # Adam moved the full-precision weights
    assert latent.unique().numel() > 8  # ... which are not on the grid themselves
    decoded = decode_model(encode_model(model_arrays(model), 3))
    np.testing.assert_allclose(decoded["enc1.conv1.weight"], seen_in_forward.numpy(), atol=1e-6)


# --- bit-widths and the server ----------------------------------------------------------------------
def test_bit_widths_come_from_node_config_or_the_list_in_name_order():
    roster = ["hospital-02", "hospital-00", "hospital-01"]
    widths = [4, 8, 16]
    assert [assign_bit_width(HospitalInfo(n, 1), roster, widths) for n in sorted(roster)] == [4, 8, 16]
    assert assign_bit_width(HospitalInfo("hospital-02", 1, {"bit-width": 32}), roster, widths) == 32
    assert assign_bit_width(HospitalInfo("anyone", 1), roster, [6]) == 6
    with pytest.raises(ConfigError,
                       match="qfedpolyp.bit-widths: lists 3 bit-widths, but hospital-03 is hospital number 4"):
        assign_bit_width(HospitalInfo("hospital-03", 1), roster, widths)
    with pytest.raises(ValueError, match="'bit-width': 20 is not a bit-width"):
        assign_bit_width(HospitalInfo("hospital-00", 1, {"bit-width": 20}), roster, widths)


def test_bad_bit_width_lists_are_named_by_their_key():
    from common.config import load_job_config

    with pytest.raises(ConfigError, match="'qfedpolyp.bit-widths'.*bit-width 0: 0 is not a bit-width"):
        load_job_config({"qfedpolyp.bit-widths": "8,8,0"})
    with pytest.raises(ConfigError, match="bit-widths='8,8,1': 1 bit .*needs qfedpolyp.quantise='update'"):
        load_job_config({"qfedpolyp.bit-widths": "8,8,1"})  # signs carry a change, never weights
    with pytest.raises(ConfigError, match="downlink-bit-width=1 .*needs qfedpolyp.downlink='delta'"):
        load_job_config({"qfedpolyp.downlink-bit-width": 1})
    with pytest.raises(ConfigError, match="'qfedpolyp.bit-widths'.*comma-separated"):
        load_job_config({"qfedpolyp.bit-widths": "8 16"})
    with pytest.raises(ConfigError, match="'qfedpolyp.downlink-bit-width'"):
        load_job_config({"qfedpolyp.downlink-bit-width": 17})
    assert load_job_config({"qfedpolyp.bit-widths": 4}).qfedpolyp.bit_width_list == [4]


@pytest.fixture
def polyp_job():
    return JobConfig(run_name="q", task="polyp-segmentation", strategy="qfedpolyp", num_server_rounds=2,
                     synthetic_samples=30, image_size=16, batch_size=8, min_partition_size=5,
                     qfedpolyp={"bit-widths": "4,8,32"}, screening={"max-hospital-weight": 1.0})  # plain weights


def test_too_few_bit_widths_stop_the_run_before_any_message_of_round_1(polyp_job):
    job = polyp_job.model_copy(update={"qfedpolyp": polyp_job.qfedpolyp.model_copy(update={"bit_widths": "4,8"})})
    engine = RoundEngine(job)
    with pytest.raises(ConfigError, match="lists 2 bit-widths, but hospital-02 is hospital number 3"):
        engine.select(1, [HospitalInfo(f"hospital-0{i}", 10) for i in range(3)])


def test_server_refuses_mismatched_payloads_and_averages_the_rest_by_sample_count(polyp_job, caplog):
    engine = RoundEngine(polyp_job)
    server = engine.method
    names = ["hospital-00", "hospital-01", "hospital-02"]
    infos = ([HospitalInfo(n, count) for n, count in zip(names, (10, 30, 60))]
             + [HospitalInfo("hospital-03", 10, {"bit-width": 8}), HospitalInfo("hospital-04", 10, {"bit-width": 8})])
    chosen = engine.select(1, infos)
    assert [server.downlink(1, h).config[BIT_WIDTH_KEY] for h in chosen] == [4, 8, 32, 8, 8]
    rng = np.random.default_rng(0)
    models = [{k: (v + rng.normal(0, 0.01, v.shape).astype(v.dtype) if v.dtype.kind == "f" else v + i)
               for k, v in server.global_arrays.items()} for i in range(5)]

    def reply(index, bits, n):
        encoded = encode_model(models[index], bits)
        return RoundReply(infos[index], Payload(arrays={PACKED: encoded},
                                                metrics={"num-examples": n, "server-round": 1}))

    good = [reply(0, 4, 10), reply(1, 8, 30), reply(2, 32, 60)]
    wrong_tag = reply(3, 4, 10)  # hospital-03 was assigned 8
    truncated = reply(4, 8, 10)
    truncated.payload.arrays[PACKED]["data"] = truncated.payload.arrays[PACKED]["data"][:100]
    with caplog.at_level(logging.WARNING, logger="fedmed"):
        record = engine.complete_round(1, chosen, [*good, wrong_tag, truncated], 0.0)
    assert record["aggregated"] == names
    assert "tag is 4, but 8 was assigned" in record["refused"]["hospital-03"]
    assert "truncated" in record["refused"]["hospital-04"]
    assert "refused the update of hospital-03" in caplog.text
    assert record["method"]["bit-widths"] == {"hospital-00": 4, "hospital-01": 8, "hospital-02": 32}
    expected = weighted_average([decode_model(r.payload.arrays[PACKED]) for r in good], [10, 30, 60])
    for name, value in expected.items():
        np.testing.assert_array_equal(server.global_arrays[name], value, err_msg=name)
    assert not any(name.endswith("num_batches_tracked") for name in server.global_arrays)  # counters stay local


def test_a_hospital_that_drops_out_does_not_shift_the_others_bit_widths_even_after_a_resume(polyp_job):
    server = RoundEngine(polyp_job).method
    everyone = [HospitalInfo(f"hospital-0{i}", 10) for i in range(3)]
    server.hospitals_available(1, everyone)
    server.hospitals_available(2, [everyone[0], everyone[2]])  # hospital-01 is gone
    assert server.downlink(2, everyone[2]).config[BIT_WIDTH_KEY] == 32
    restarted = RoundEngine(polyp_job).method
    restarted.load_state_dict(server.state_dict())
    restarted.hospitals_available(3, [everyone[2]])
    assert restarted.downlink(3, everyone[2]).config[BIT_WIDTH_KEY] == 32


def test_two_in_process_rounds_with_mixed_bit_widths_and_a_quantised_downlink(polyp_job):
    from common.engine.inprocess import run_rounds, simulated_sites

    cfg = polyp_job.model_copy(update={"qfedpolyp": polyp_job.qfedpolyp.model_copy(update={"downlink_bit_width": 8})})
    engine = RoundEngine(cfg)
    initial = {k: v.copy() for k, v in engine.method.global_arrays.items()}
    run_rounds(cfg, simulated_sites(cfg, 3, device="cpu"), engine)
    first, last = engine.history
    assert last["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"] and not last["refused"]
    assert last["method"]["bit-widths"] == {"hospital-00": 4, "hospital-01": 8, "hospital-02": 32}
    assert {h: m["bit-width"] for h, m in last["hospital_metrics"].items()} == last["method"]["bit-widths"]
    up = {h: t["up"] for h, t in last["traffic"].items()}
    float_bytes = sum(v.nbytes for v in engine.method.global_arrays.values())
    assert up["hospital-02"] > float_bytes and up["hospital-02"] / up["hospital-01"] > 3.9
    assert up["hospital-02"] / up["hospital-00"] > 7.7
    assert all(t["down"] < float_bytes / 3.9 for t in last["traffic"].values())  # the 8-bit downlink
    assert 0.0 <= last["test"]["dice"] <= 1.0 and "val-dice" in last["train"]
    moved = [k for k, v in engine.method.global_arrays.items() if not np.array_equal(v, initial[k])]
    assert len(moved) == len(initial)  # every weight and BatchNorm statistic moved
