"""A round streamed (each reply screened as it arrives, what the method aggregates kept on disk and read back one
tensor at a time) ends exactly as the round with every reply in memory: the same global arrays bit for bit, the
same method state and the same round record, for every method, with refusals in the round (a malformed reply, an
unchanged one, a norm outlier) and over several rounds, so that state carried between rounds (FedMEPD's
personalisation, FedBN's and FedProto's per-hospital arrays, QFedPolyp's held model) is compared too."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from flwr.app import MessageType

import strategies.replies
from benchmarks.memory.grid import SyntheticGrid
from common.config import load_job_config
from common.engine.inprocess import simulated_sites
from common.engine.reply_store import StoredArrays
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.base import HospitalInfo, Payload
from common.methods.registry import hospital_class, methods
from common.quantization.codec import decode_model, encode_model
from common.quantization.low_rank import decode_low_rank, encode_low_rank
from common.quantization.sparse import decode_sparse, encode_sparse
from strategies import FedAvgStrategy
from strategies.fedproto.server import PROTOTYPES
from strategies.qfedpolyp.messages import (
    BIT_WIDTH_KEY,
    PACKED,
    STATISTICS,
    pack_statistics,
    split_statistics,
    unpack_statistics,
)
from strategies.records import arrays_of

from .fake_grid import FakeGrid, simulated_hospitals

pytestmark = pytest.mark.usefixtures("one_thread")

HOSPITALS = 7
CLASSIFICATION = {"model": "small-cnn", "image-size": 16, "synthetic-samples": 150, "batch-size": 16,
                  "min-partition-size": 5}
POLYP = {"task": "polyp-segmentation", "synthetic-samples": 60, "image-size": 16, "batch-size": 8,
         "min-partition-size": 5, "qfedpolyp.bit-widths": "4,8,32,8,4,8,4"}
BRAIN = {"task": "brain-tumour-segmentation", "batch-size": 2, "brain.widths": "4,8,16,32", "brain.crop-size": 16,
         "brain.synthetic-size": 24, "brain.synthetic-cases": 24, "brain.crops-per-case": 1,
         "brain.hospital-modalities": "t1ce;flair,t2;t1,t1ce,flair,t2;t2;flair;t1ce,t2;t1,flair", "device": "cpu",
         "fedmepd.warmup-rounds": 0, "fedmepd.patience": 1, "fedmepd.num-anchors": 2}
#: the run config of a method's first task (the one it is built for)
TASK_SETTINGS = {"classification": CLASSIFICATION, "polyp-segmentation": POLYP, "brain-tumour-segmentation": BRAIN}
#: every registered method on its first task, and the variants whose aggregation takes another path
CASES = {
    **{name: (name, TASK_SETTINGS[spec.tasks[0]]) for name, spec in methods().items()},
    "fedavg-median": ("fedavg", {**CLASSIFICATION, "screening.robust-aggregate": "median"}),
    "fedavg-trimmed-mean": ("fedavg", {**CLASSIFICATION, "screening.robust-aggregate": "trimmed-mean"}),
    "fedbn-median": ("fedbn", {**CLASSIFICATION, "screening.robust-aggregate": "median"}),
    "qfedpolyp-update": ("qfedpolyp", {**POLYP, "qfedpolyp.quantise": "update"}),
    "qfedpolyp-delta": ("qfedpolyp", {**POLYP, "qfedpolyp.quantise": "update", "qfedpolyp.downlink": "delta"}),
    "qfedpolyp-sparse": ("qfedpolyp", {**POLYP, "qfedpolyp.quantise": "update", "qfedpolyp.sparsity": 0.25}),
    "qfedpolyp-signs": ("qfedpolyp", {**POLYP, "qfedpolyp.bit-widths": "1", "qfedpolyp.quantise": "update",
                                      "qfedpolyp.sparsity": 0.3, "qfedpolyp.sparse-block": 8,
                                      "qfedpolyp.downlink": "delta", "qfedpolyp.downlink-bit-width": 2,
                                      "qfedpolyp.statistics-bit-width": 8}),
    "qfedpolyp-low-rank": ("qfedpolyp", {**POLYP, "qfedpolyp.bit-widths": "4", "qfedpolyp.quantise": "update",
                                         "qfedpolyp.error-feedback": True, "qfedpolyp.low-rank-bits": 0.45}),
}
#: hospital-00, -01 and -05 are honest, -06 reports an error; the others:
MALFORMED, UNCHANGED, OUTLIER, FAILED = "hospital-03", "hospital-02", "hospital-04", "hospital-06"


def scaled(received: dict, sent: dict, factor: float) -> dict:
    """``received`` plus ``factor`` times the change ``sent - received`` (weights; BatchNorm statistics as sent)."""
    return {k: (received[k].astype(np.float64) + factor * (v.astype(np.float64) - received[k])).astype(v.dtype)
            if v.dtype.kind == "f" and "running_" not in k else v.copy() for k, v in sent.items()}


def hostile(engine: RoundEngine, rnd: int, name: str, down: Payload, reply: Payload) -> Payload:
    """``name``'s reply as the test's hostile hospitals send it: malformed, unchanged or a norm outlier."""
    reply = copy.deepcopy(reply)
    method, arrays = engine.method, reply.arrays
    if not arrays:  # fedmepd-local: the reply is metrics alone
        if name == MALFORMED:
            reply.metrics["num-examples"] = "many"
        return reply
    if method.name == "qfedpolyp":
        return hostile_qfedpolyp(engine, name, down, reply)
    if method.name == "fedproto":
        if name == MALFORMED:
            del arrays[PROTOTYPES]["count"]
        elif name == UNCHANGED:
            arrays["model"] = copy.deepcopy(method.local_models.get(name, method.global_arrays))
            arrays[PROTOTYPES]["mean"] = method.prototypes.copy()
        elif name == OUTLIER:
            arrays[PROTOTYPES]["mean"] = arrays[PROTOTYPES]["mean"] * np.float32(1000.0)
        return reply
    received = down.arrays["model"]
    if name == MALFORMED:
        del arrays["model"][list(arrays["model"])[-1]]
    elif name == UNCHANGED:
        arrays["model"] = {k: v.copy() for k, v in received.items()}
    elif name == OUTLIER:
        arrays["model"] = scaled(received, arrays["model"], 1e4)
    return reply


def hostile_qfedpolyp(engine: RoundEngine, name: str, down: Payload, reply: Payload) -> Payload:
    server, settings = engine.method, engine.method.cfg.qfedpolyp
    bits, received = down.config[BIT_WIDTH_KEY], server.received_by_hospitals()
    weights, statistics = split_statistics(received)
    packed = reply.arrays[PACKED]
    if name == MALFORMED:
        packed["data"] = packed["data"][:100]
        return reply
    if settings.quantise == "weights":
        if name == UNCHANGED:  # hospital-02 sends at 32 bits: the received model exactly
            reply.arrays[PACKED] = encode_model(received, bits)
        elif name == OUTLIER:
            reply.arrays[PACKED] = encode_model(scaled(received, decode_model(packed, reference=received), 1e4), bits)
        return reply
    sparse, budget = settings.sparsity < 1.0, settings.low_rank_bits
    change = (decode_low_rank(packed, weights, bits, budget) if budget else
              decode_sparse(packed, reference=weights) if sparse else decode_model(packed, reference=weights))
    change = {k: (np.zeros_like(v) if name == UNCHANGED else v * np.float32(1e4)).astype(weights[k].dtype)
              for k, v in change.items()}
    stats_bits = settings.statistics_bit_width
    if name == UNCHANGED:
        reply.arrays[STATISTICS] = pack_statistics(statistics, stats_bits)
    if name == OUTLIER:  # BatchNorm's statistics move most here: they grow too (variances stay positive)
        sent = unpack_statistics(reply.arrays, statistics, stats_bits, name)
        reply.arrays[STATISTICS] = pack_statistics({k: v * v.dtype.type(1e4) if v.dtype.kind == "f" else v
                                                    for k, v in sent.items()}, stats_bits)
    reply.arrays[PACKED] = (encode_low_rank(change, bits, budget) if budget else
                            encode_sparse(change, bits, settings.sparsity, settings.sparsify, seed=(1, 2),
                                          content="update", block=settings.sparse_block) if sparse
                            else encode_model(change, bits, content="update"))
    return reply


def assert_same(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for key, value in a.items():
        np.testing.assert_array_equal(b[key], value, err_msg=f"{what}: {key}")
        assert np.asarray(b[key]).tobytes() == np.asarray(value).tobytes(), f"{what}: {key} differs in its bits"


#: the 3D brain baselines take tens of seconds each: the long tier; the first brain method keeps the fast tier's check
FIRST_BRAIN = next(name for name, (_, settings) in CASES.items() if settings is BRAIN)
STREAMED_CASES = [pytest.param(case, marks=pytest.mark.slow) if settings is BRAIN and case != FIRST_BRAIN else case
                  for case, (_, settings) in CASES.items()]


@pytest.mark.parametrize("case", STREAMED_CASES)
def test_a_streamed_round_equals_the_round_with_every_reply_in_memory(tmp_path, case):
    method, settings = CASES[case]
    cfg = load_job_config({**settings, "strategy": method, "num-server-rounds": 2, "min-train-hospitals": 2,
                           "run-name": "t", "results-dir": str(tmp_path / "results")})
    sites = simulated_sites(cfg, HOSPITALS, tmp_path / "state")
    hospital = hospital_class(method)
    infos = [hospital(cfg, site).info() for site in sites]
    in_memory, streamed = RoundEngine(cfg), RoundEngine(cfg)
    seen: list[type] = []
    aggregate = streamed.method.aggregate

    def spy(rnd, updates):
        seen.extend(type(arrays) for u in updates for arrays in u.payload.arrays.values())
        return aggregate(rnd, updates)

    streamed.method.aggregate = spy
    folder = tmp_path / "replies"
    for rnd in (1, 2):
        chosen = in_memory.select(rnd, infos)
        assert streamed.select(rnd, infos) == chosen
        replies = []
        for info, site in zip(chosen, sites):
            down = in_memory.downlink(rnd, info)
            assert_same(down.arrays.get("model", {}), streamed.downlink(rnd, info).arrays.get("model", {}),
                        f"round {rnd} downlink to {info.name}")
            if info.name == FAILED:
                replies.append(RoundReply(info, None, "RuntimeError: out of memory"))
                continue
            reply = hospital(cfg, site).timed_train(rnd, down)
            replies.append(RoundReply(info, hostile(in_memory, rnd, info.name, down, reply), None, reply.nbytes()))
        records = [in_memory.complete_round(rnd, chosen, copy.deepcopy(replies), 0.0, evaluate=False),
                   streamed.complete_round(rnd, chosen, reversed(copy.deepcopy(replies)), 0.0, evaluate=False,
                                           reply_folder=folder)]
        assert not (folder / f".round-{rnd}").exists()  # removed once the round closed
        for record in records:
            record.pop("seconds")
        assert records[0] == records[1]
        assert_same(in_memory.method.state_dict(), streamed.method.state_dict(), f"round {rnd} method state")
        refused = records[0]["refused"]
        assert "missing" in refused[MALFORMED] or "truncated" in refused[MALFORMED] or \
            "not a number" in refused[MALFORMED], refused
        assert "out of memory" in refused[FAILED]
        if case != "fedmepd-local":  # a reply of metrics alone has no update to weigh
            assert "refuse-unchanged" in refused[UNCHANGED] and "update-norm-limit" in refused[OUTLIER], refused
        assert records[0]["aggregated"] == sorted(["hospital-00", "hospital-01", "hospital-05"] +
                                                  (["hospital-02", "hospital-04"] if case == "fedmepd-local" else []))
    if case != "fedmepd-local":
        assert seen and all(kind is StoredArrays for kind in seen)  # the streamed rounds aggregated from disk


def run_strategy(tmp_path, store: str, grid, **extra):
    folder = tmp_path / store[0]  # folders named alike: the state folder's name travels in every message
    config = {**CLASSIFICATION, "run-name": "run", "results-dir": str(folder / "results"),
              "state-dir": str(folder / "state"), "reply-store": store, "evaluate-every": 1000, **extra}
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    return strategy, strategy.start(grid(config), num_rounds=2)


def test_our_loop_streams_the_replies_and_ends_as_with_every_reply_in_memory(tmp_path):
    def grid(config):
        nodes = simulated_hospitals({**config, "strategy": "fedavg"}, 4)
        honest = nodes[104]
        nodes[104] = lambda message: unchanged(honest, message)  # the last hospital returns what it received
        return FakeGrid(nodes)

    def unchanged(honest, message):
        reply = honest(message)
        if message.metadata.message_type == MessageType.TRAIN:
            reply.content["arrays"] = message.content["arrays"]
        return reply

    runs = {store: run_strategy(tmp_path, store, grid) for store in ("memory", "disk")}
    (in_memory, kept), (streamed, final) = runs["memory"], runs["disk"]
    assert_same(dict(arrays_of(kept.arrays)), dict(arrays_of(final.arrays)), "final model")
    for a, b in zip(in_memory.engine.history, streamed.engine.history, strict=True):
        assert untimed(a) == untimed(b)
        assert "refuse-unchanged" in a["refused"]["hospital-03"]
    assert not list(streamed.job.run_dir.glob(".round-*"))


def untimed(record: dict) -> dict:
    """A round record without what the clock says."""
    return {**{k: v for k, v in record.items() if k not in ("seconds", "identity-seconds", "train")},
            "hospital_metrics": {h: {k: v for k, v in m.items() if k != "hospital-seconds"}
                                 for h, m in record["hospital_metrics"].items()},
            "train": {k: v for k, v in record["train"].items() if k != "hospital-seconds"}}


def test_the_servers_memory_does_not_grow_with_the_hospitals_when_replies_are_streamed(tmp_path, monkeypatch):
    """tracemalloc's peak over a round (NumPy's arrays and Flower's bytes are traced): with every reply in memory it
    grows by about two models per hospital (the message and its decoded copy); streamed, not at all."""
    import tracemalloc

    monkeypatch.setattr(strategies.replies, "PULL_BYTES", 1)  # one reply per pull (by default, 64 MB of them)
    model = {"model": "resnet18", "resnet-width": 0.25, "image-size": 16, "synthetic-samples": 30,
             "audit-log": "none"}
    growth, model_bytes = {}, 0
    for store in ("memory", "disk"):
        peaks = []
        for hospitals in (3, 12):
            config = {**model, "run-name": f"{store}-{hospitals}", "results-dir": str(tmp_path), "reply-store": store,
                      "min-available-hospitals": hospitals, "evaluate-every": 1000}
            strategy = FedAvgStrategy(run_config=config)
            model_bytes = sum(a.nbytes for a in strategy.engine.method.global_arrays.values())
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                strategy.start(SyntheticGrid(hospitals), num_rounds=1)
                peaks.append(tracemalloc.get_traced_memory()[1] - base)
            finally:
                tracemalloc.stop()
            assert strategy.engine.history[0]["aggregated"] == [f"hospital-{i:04d}" for i in range(hospitals)]
        growth[store] = (peaks[1] - peaks[0]) / model_bytes  # in model sizes, for 9 more hospitals
    assert growth["memory"] > 9, growth
    assert growth["disk"] < 0.5, growth


BOUNDED = {
    "fedproin": {"model": "resnet18", "resnet-width": 0.25, "image-size": 16, "synthetic-samples": 40},
    "qfedpolyp": {"task": "polyp-segmentation", "image-size": 16, "synthetic-samples": 30},
    "fedmepd": {**BRAIN, "brain.widths": "8,16,32,64", "brain.synthetic-cases": 8, "fedmepd.warmup-rounds": 0},
}


def synthetic_reply(engine: RoundEngine, info, rnd: int, rng: np.random.Generator) -> RoundReply:
    """A hospital's reply without training: what it received, moved a little (BatchNorm's variances kept positive)."""
    down, method = engine.downlink(rnd, info), engine.method

    def moved(arrays):
        return {k: (v * v.dtype.type(1.01) if "running_var" in k else
                    v + rng.normal(0, 0.01, v.shape).astype(v.dtype)) if v.dtype.kind == "f" else v.copy()
                for k, v in arrays.items()}

    metrics = {"num-examples": 10, "server-round": rnd}
    if method.name == "qfedpolyp":
        arrays = {PACKED: encode_model(moved(method.received_by_hospitals()), down.config[BIT_WIDTH_KEY])}
    else:
        arrays = {"model": moved(down.arrays["model"])}
    if method.name == "fedproin":
        influence = np.zeros(method.global_arrays["prototypes"].shape[:2], dtype=np.int64)
        influence[:, 0] = 1
        metrics["influence"] = influence.ravel().tolist()
    return RoundReply(info, Payload(arrays=arrays, metrics=metrics), None, 0)


@pytest.mark.parametrize("method", list(BOUNDED))
def test_each_methods_server_holds_one_reply_at_a_time_when_streamed(tmp_path, method):
    """tracemalloc's peak over a round of 3 and of 12 hospitals, the replies made as the engine asks for them: with
    every reply in memory it grows with each hospital's model (QFedPolyp's rebuilt one); streamed (on disk,
    FedMEPD's per-modality sums, decoder and server-side training, QFedPolyp's decoding, FedProIn's NIA) it does
    not grow."""
    import tracemalloc

    modalities = ["t1ce", "flair,t2", "t1,t1ce,flair,t2"]
    growth, model_bytes = {}, 0
    for store in ("warm-up", "memory", "disk"):  # the first round in a process loads data and caches: not measured
        peaks = []
        for hospitals in (3, 12) if store != "warm-up" else (3,):
            cfg = load_job_config({**BOUNDED[method], "strategy": method, "run-name": "t", "device": "cpu",
                                   "results-dir": str(tmp_path), "min-train-hospitals": 2})
            engine = RoundEngine(cfg)
            model_bytes = sum(a.nbytes for a in engine.method.global_arrays.values())
            infos = [HospitalInfo(f"h{i:02d}", 10, {"modalities": modalities[i % 3]} if method == "fedmepd" else {})
                     for i in range(hospitals)]
            chosen = engine.select(1, infos)
            rng = np.random.default_rng(0)
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                record = engine.complete_round(1, chosen, (synthetic_reply(engine, info, 1, rng) for info in chosen),
                                               0.0, evaluate=False,
                                               reply_folder=tmp_path if store == "disk" else None)
                peaks.append(tracemalloc.get_traced_memory()[1] - base)
            finally:
                tracemalloc.stop()
            assert record["aggregated"] == [h.name for h in infos], record["refused"]
        if store != "warm-up":
            growth[store] = (peaks[1] - peaks[0]) / model_bytes  # in model sizes, for 9 more hospitals
    assert growth["memory"] > 3, growth  # (a FedMEPD hospital sends only its own modalities' encoders)
    assert growth["disk"] < 0.5, growth
