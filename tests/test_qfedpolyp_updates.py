"""QFedPolyp beyond the paper: hospitals send their round's update at b bits (optionally with error feedback
kept in their state folder), the server adds the mean update, and a quantised downlink is rebuilt by the
hospitals exactly as the server rebuilds it."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import ConfigError, load_job_config
from common.engine.inprocess import simulated_sites
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.site import HospitalStateStore
from common.quantization.codec import decode_model, encode_model
from strategies.qfedpolyp.hospital import QFedPolypHospital
from strategies.qfedpolyp.messages import PACKED, STATISTICS, is_statistic

pytestmark = pytest.mark.usefixtures("one_thread")

JOB = {"task": "polyp-segmentation", "strategy": "qfedpolyp", "synthetic-samples": 30, "image-size": 16,
       "batch-size": 8, "min-partition-size": 5, "run-name": "q", "qfedpolyp.quantise": "update"}


def job(**extra):
    return load_job_config({**JOB, **extra})


def one_round(cfg, sites, engine, rnd=1):
    infos = [QFedPolypHospital(cfg, site).info() for site in sites]
    chosen = engine.select(rnd, infos)
    replies = []
    for info, site in zip(chosen, sites):
        payload = engine.downlink(rnd, info)
        replies.append(RoundReply(info, QFedPolypHospital(cfg, site).timed_train(rnd, payload)))
    return replies


@pytest.mark.parametrize("rate", [1.0, 2.5])
def test_the_server_adds_the_weighted_mean_update_times_its_learning_rate_to_its_global_model(rate):
    cfg = job(**{"qfedpolyp.bit-widths": "4", "qfedpolyp.server-learning-rate": rate})
    sites = simulated_sites(cfg, 2)
    engine = RoundEngine(cfg)
    before = {k: v.copy() for k, v in engine.method.global_arrays.items()}
    replies = one_round(cfg, sites, engine)
    assert all(set(r.payload.arrays) == {PACKED, STATISTICS} for r in replies)
    statistics = [decode_model(r.payload.arrays[STATISTICS], expected_bits=32) for r in replies]  # the floats
    assert all(all(is_statistic(k) for k in sent) for sent in statistics)
    changes = [decode_model(r.payload.arrays[PACKED], expected_content="update") for r in replies]
    counts = np.array([r.payload.metrics["num-examples"] for r in replies], dtype=float)
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == [r.hospital.name for r in replies]
    for name, value in engine.method.global_arrays.items():
        if is_statistic(name):
            expected = sum(c * sent[name] for c, sent in zip(counts, statistics)) / counts.sum()
        else:
            expected = before[name] + rate * sum(c * d[name] for c, d in zip(counts, changes)) / counts.sum()
        np.testing.assert_allclose(value, expected, atol=2e-6, err_msg=name)


def test_a_weights_payload_where_an_update_is_expected_is_refused():
    cfg = job()
    sites = simulated_sites(cfg, 2)
    engine = RoundEngine(cfg)
    replies = one_round(cfg, sites, engine)
    replies[1].payload.arrays[PACKED] = encode_model(engine.method.global_arrays, 8)  # weights, tagged so
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == [replies[0].hospital.name]
    assert "payload is tagged 'weights', expected 'update'" in record["refused"][replies[1].hospital.name]


def test_error_feedback_is_kept_in_the_state_folder_and_replays_exactly_after_a_restart(tmp_path):
    cfg = job(**{"qfedpolyp.bit-widths": "2", "qfedpolyp.error-feedback": True})
    engine = RoundEngine(cfg)
    site = simulated_sites(cfg, 2)[0]
    site.state = HospitalStateStore(tmp_path / "state")
    info = QFedPolypHospital(cfg, site).info()
    engine.select(1, [info])
    QFedPolypHospital(cfg, site).train(1, engine.downlink(1, info))
    saved = site.state.load(before_round=2)
    assert saved is not None and (tmp_path / "state" / "state-r00001.npz").exists()
    assert max(float(np.abs(v).max()) for v in saved.values()) > 0  # 2 bits lose something

    replies = []
    for _ in range(2):  # the SuperNode restarted (a new store on the same folder), or the run resumed
        site.state = HospitalStateStore(tmp_path / "state")
        replies.append(QFedPolypHospital(cfg, site).train(2, engine.downlink(2, info)))
        (tmp_path / "state" / "state-r00002.npz").unlink()
    for key in ("header", "ranges", "data"):
        np.testing.assert_array_equal(replies[0].arrays[PACKED][key], replies[1].arrays[PACKED][key])


def test_error_feedback_makes_the_sum_of_what_was_sent_track_the_sum_of_the_updates():
    rng = np.random.default_rng(0)
    updates = [{"w": rng.normal(0, 1e-3, 500).astype(np.float32) + 2e-4} for _ in range(30)]

    def sent_total(feedback: bool) -> np.ndarray:
        residual, total = np.zeros(500, np.float32), np.zeros(500)
        for update in updates:
            change = update["w"] + (residual if feedback else 0)
            sent = decode_model(encode_model({"w": change}, 2, content="update"))["w"]
            residual = change - sent
            total += sent
        return total

    truth = sum(u["w"].astype(np.float64) for u in updates)
    with_feedback, without = np.abs(sent_total(True) - truth).max(), np.abs(sent_total(False) - truth).max()
    step = 2 * np.abs(updates[0]["w"]).max() / 3
    assert with_feedback <= step  # the error stays one residual, however many rounds
    assert without > 3 * with_feedback


def test_hospitals_rebuild_a_quantised_downlink_exactly_as_the_server_does():
    cfg = job(**{"qfedpolyp.downlink-bit-width": 8})
    engine = RoundEngine(cfg)
    site = simulated_sites(cfg, 2)[0]
    info = QFedPolypHospital(cfg, site).info()
    engine.select(1, [info])
    payload = engine.downlink(1, info)
    from common.arrays import model_arrays

    received = model_arrays(QFedPolypHospital(cfg, site).received_model(payload))
    server_view = engine.method.received_by_hospitals()
    assert received.keys() == server_view.keys()
    for name, value in received.items():
        assert np.array_equal(value, server_view[name]), name
    assert any(not np.array_equal(server_view[k], v) for k, v in engine.method.global_arrays.items())  # 8 bits


def test_error_feedback_and_a_server_learning_rate_need_update_quantisation():
    with pytest.raises(ConfigError, match="error-feedback=true needs qfedpolyp.quantise='update'"):
        load_job_config({**JOB, "qfedpolyp.quantise": "weights", "qfedpolyp.error-feedback": True})
    with pytest.raises(ConfigError, match="server-learning-rate=1.5 needs qfedpolyp.quantise='update'"):
        load_job_config({**JOB, "qfedpolyp.quantise": "weights", "qfedpolyp.server-learning-rate": 1.5})
    with pytest.raises(ConfigError, match="server-learning-rate"):
        load_job_config({**JOB, "qfedpolyp.server-learning-rate": 0})


def test_update_mode_trains_in_full_precision(monkeypatch):
    import strategies.qfedpolyp.hospital as qfedpolyp

    seen = []
    real = qfedpolyp.quantization_aware

    def recording(model, bits):
        seen.append(bits)
        return real(model, bits)

    monkeypatch.setattr(qfedpolyp, "quantization_aware", recording)
    for quantise, expected in (("update", 32), ("weights", 4)):
        cfg = job(**{"qfedpolyp.bit-widths": "4", "qfedpolyp.quantise": quantise})
        engine = RoundEngine(cfg)
        one_round(cfg, simulated_sites(cfg, 2)[:1], engine)
        assert seen[-1] == expected, quantise


def test_training_from_its_own_model_starts_at_the_received_model_plus_the_residual_and_sends_it_once(tmp_path):
    """train-from='own' (CHOCO-SGD's local copy) moves where the gradients are taken, not what is sent: with a
    training step that does not depend on the start, both modes send the same codes; the residual is not added
    twice."""
    import torch

    from common.arrays import model_arrays

    def run(train_from: str):
        cfg = job(**{"qfedpolyp.bit-widths": "2", "qfedpolyp.error-feedback": True,
                     "qfedpolyp.train-from": train_from})
        engine = RoundEngine(cfg)
        site = simulated_sites(cfg, 2)[0]
        site.state = HospitalStateStore(tmp_path / train_from)
        info = QFedPolypHospital(cfg, site).info()
        engine.select(1, [info])
        QFedPolypHospital(cfg, site).train(1, engine.downlink(1, info))  # leaves a residual
        hospital = QFedPolypHospital(cfg, site)
        starts = []

        def shift_weights(model, *args, **kwargs):  # the same step wherever it starts
            starts.append(model_arrays(model))
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1e-3)
            return {"train-loss": 0.0}

        hospital.task.fit = shift_weights
        payload = engine.downlink(2, info)
        received = model_arrays(hospital.received_model(payload, {}))
        reply = hospital.train(2, payload)
        return starts[0], received, site.state.load(before_round=2), reply

    start, received, residual, reply = run("own")
    same_start, _, _, same_reply = run("received")
    assert residual and max(float(np.abs(v).max()) for v in residual.values()) > 0
    for name, value in start.items():
        expected = received[name] + residual[name] if name in residual else received[name]
        np.testing.assert_allclose(value, expected, atol=1e-7, err_msg=name)
        if name not in residual:
            assert is_statistic(name), name  # only the statistics go without a residual
    assert any(not np.array_equal(start[k], same_start[k]) for k in residual)
    sent, same_sent = (decode_model(r.arrays[PACKED], expected_content="update") for r in (reply, same_reply))
    differing = sum(int((np.abs(sent[k] - same_sent[k]) > 1e-6).sum()) for k in sent)  # the ranges' last bits
    assert differing <= 1e-3 * sum(v.size for v in sent.values())  # float32 rounding may move a code or two;
    # adding the residual twice (it is up to half a 2-bit step) would move about half of them


def test_training_from_its_own_model_needs_error_feedback():
    with pytest.raises(ConfigError, match="train-from='own' needs qfedpolyp.error-feedback=true"):
        job(**{"qfedpolyp.train-from": "own"})
