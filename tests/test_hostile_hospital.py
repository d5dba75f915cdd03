"""One hostile or broken hospital can neither crash the round, poison the global model nor take another
hospital's place (issue 12): each attack below is refused with its reason, and the global model is what the
honest hospitals alone make of it."""

from __future__ import annotations

import io
import re
import tracemalloc
import zipfile

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from common.arrays import robust_average
from common.config import JobConfig
from common.engine.round_engine import RoundEngine, RoundReply
from common.engine.screening import capped_shares, norm_outliers
from common.engine.wire import PACKED_ARRAY, MalformedPayload, from_recorddict
from common.methods.base import HospitalInfo, Payload
from common.quantization.codec import encode_model
from strategies import FedAvgStrategy, QFedPolypStrategy

from .fake_grid import FakeGrid, hospital_node, simulated_hospitals

SMALL = dict(run_name="t", num_server_rounds=2, synthetic_samples=120, image_size=16, batch_size=16,
             min_partition_size=5, model="small-cnn")
HONEST = ["h-a", "h-b", "h-c"]
DECLARED = 40


def honest_arrays(reference: dict, seed: int) -> dict:
    """What an honest hospital sends: the received model moved a little."""
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, 0.01, v.shape).astype(v.dtype) if v.dtype.kind == "f" and
                not k.endswith("running_var") else v.copy()) for k, v in reference.items()}


def reply(name: str, arrays: dict | None = None, group: str = "model", n=DECLARED, **metrics) -> RoundReply:
    return RoundReply(HospitalInfo(name, DECLARED), Payload(arrays={group: arrays} if arrays is not None else {},
                                                            metrics={"num-examples": n, "server-round": 1, **metrics}))


def honest_round(engine: RoundEngine) -> list[RoundReply]:
    return [reply(name, honest_arrays(engine.method.global_arrays, seed)) for seed, name in enumerate(HONEST)]


def expected_without_attacker(cfg: JobConfig) -> dict:
    clean = RoundEngine(cfg)
    replies = honest_round(clean)
    clean.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    return clean.method.global_arrays


def attacked(cfg: JobConfig, forge) -> tuple[dict, dict]:
    """The round record and global model when an attacker ``h-x`` sends ``forge(global_arrays)``."""
    engine = RoundEngine(cfg)
    attack = forge(engine.method.global_arrays)
    replies = honest_round(engine) + [attack]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    return record, engine.method.global_arrays


def scaled(arrays: dict, factor: float) -> dict:
    return {k: (v * np.asarray(factor, v.dtype) if v.dtype.kind == "f" else v) for k, v in arrays.items()}


def with_running_var(arrays: dict, value: float) -> dict:
    name = next(k for k in arrays if k.endswith("running_var"))
    return {**honest_arrays(arrays, 9), name: np.full_like(arrays[name], value)}


ATTACKS = {
    "inflated sample count": (lambda g: reply("h-x", {k: np.zeros_like(v) for k, v in g.items()}, n=1e12),
                              "more than the 40 training samples it declared"),
    "weights x1000": (lambda g: reply("h-x", scaled(g, 1000.0)), "above screening.update-norm-limit"),
    "weights of 3e38": (lambda g: reply("h-x", {k: (np.full_like(v, 3e38) if v.dtype.kind == "f" else v)
                                               for k, v in g.items()}), "update-norm-limit"),
    "negative BatchNorm variance": (lambda g: reply("h-x", with_running_var(g, -1e6)), "variances must be positive"),
    "zero BatchNorm variance": (lambda g: reply("h-x", with_running_var(g, 0.0)), "variances must be positive"),
    "text metric": (lambda g: reply("h-x", honest_arrays(g, 9), **{"val-dice": "abc"}),
                    "metric 'val-dice'='abc' is not a number"),
    "list as sample count": (lambda g: reply("h-x", honest_arrays(g, 9), n=[3]),
                             "'num-examples' is a list ([3]), not a number"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_is_refused_and_the_global_model_is_the_honest_hospitals(attack):
    cfg = JobConfig(**SMALL)
    forge, reason = ATTACKS[attack]
    record, global_arrays = attacked(cfg, forge)
    assert record["aggregated"] == HONEST and reason in record["refused"]["h-x"]
    expected = expected_without_attacker(cfg)
    for name, value in expected.items():
        np.testing.assert_array_equal(global_arrays[name], value, err_msg=name)


def test_a_method_check_that_fails_unexpectedly_refuses_only_that_reply(monkeypatch):
    engine = RoundEngine(JobConfig(**SMALL))
    original = engine.method.check

    def fragile(update):
        if update.hospital.name == "h-x":
            raise TypeError("unorderable types")
        original(update)

    monkeypatch.setattr(engine.method, "check", fragile)
    replies = honest_round(engine) + [reply("h-x", honest_arrays(engine.method.global_arrays, 9))]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == HONEST
    assert record["refused"]["h-x"] == "could not be checked (TypeError: unorderable types)"


def test_forged_prototypes_influence_and_means_are_refused():
    proin = JobConfig(**SMALL, strategy="fedproin")
    engine = RoundEngine(proin)
    shape = engine.method.global_arrays["prototypes"].shape
    influence = [DECLARED // (shape[0] * shape[1])] * (shape[0] * shape[1])
    replies = [reply(name, honest_arrays(engine.method.global_arrays, seed), influence=influence)
               for seed, name in enumerate(HONEST)]
    huge = {**honest_arrays(engine.method.global_arrays, 9),
            "prototypes": np.full(shape, 1e30, np.float32)}
    replies.append(reply("h-x", huge, influence=influence))
    replies.append(reply("h-y", honest_arrays(engine.method.global_arrays, 8), n=DECLARED,
                         influence=[int(1e11)] * len(influence)))
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == HONEST
    assert "update-norm-limit" in record["refused"]["h-x"]
    assert "more than the 40 the hospital trained on" in record["refused"]["h-y"]
    assert np.abs(engine.method.global_arrays["prototypes"]).max() < 100

    proto = RoundEngine(JobConfig(**SMALL, strategy="fedproto"))
    means = proto.method.prototypes

    def with_means(name, seed, value=None):
        group = {"mean": (np.full_like(means, value) if value is not None
                          else means + np.random.default_rng(seed).normal(0, 0.1, means.shape).astype(np.float32)),
                 "count": np.full(len(means), 5, np.int64)}
        r = reply(name, honest_arrays(proto.method.global_arrays, seed))
        r.payload.arrays["prototypes"] = group
        return r

    replies = [with_means(name, seed) for seed, name in enumerate(HONEST)] + [with_means("h-x", 9, 1e30)]
    record = proto.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == HONEST and "update-norm-limit" in record["refused"]["h-x"]
    assert np.abs(proto.method.prototypes).max() < 10


def test_a_forged_quantisation_step_is_refused():
    cfg = JobConfig(**{**SMALL, "image_size": 16, "synthetic_samples": 30, "model": ""}, task="polyp-segmentation",
                    strategy="qfedpolyp")
    engine = RoundEngine(cfg)
    reference = engine.method.global_arrays
    for name in HONEST + ["h-x"]:
        engine.downlink(1, HospitalInfo(name, DECLARED))
    replies = [reply(name, encode_model(honest_arrays(reference, seed), 8), group="packed-model")
               for seed, name in enumerate(HONEST)]
    forged = encode_model(honest_arrays(reference, 9), 8)
    forged["ranges"] = forged["ranges"].copy()
    forged["ranges"][:, 1] = 1e30
    replies.append(reply("h-x", forged, group="packed-model"))
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == HONEST
    assert "update-norm-limit" in record["refused"]["h-x"]
    assert max(np.abs(v).max() for v in engine.method.global_arrays.values() if v.dtype.kind == "f") < 1e3


def test_the_norm_rule_compares_each_hospital_with_the_others_median():
    assert norm_outliers({"a": 1.0, "b": 1.5}, 10.0) == {}  # two honest hospitals
    refused = norm_outliers({"a": 1.0, "b": 50.0}, 10.0)
    assert list(refused) == ["b"] and "50x the median" in refused["b"]
    assert norm_outliers({"a": 1.0, "b": 50.0}, 0.0) == {}  # off
    assert norm_outliers({"a": 0.0, "b": 0.0, "c": 3.0}, 10.0) == {}  # nobody else moved: no scale to judge by


def test_no_hospital_weighs_more_than_the_cap():
    shares = capped_shares([1e6, 10, 30], 0.5)
    np.testing.assert_allclose(shares, [0.5, 0.125, 0.375])
    np.testing.assert_allclose(capped_shares([5, 5], 0.2), [0.5, 0.5])  # a cap below 1/n: equal shares
    np.testing.assert_allclose(capped_shares([1, 3], 1.0), [0.25, 0.75])


def test_a_capped_hospital_weighs_what_the_cap_allows():
    cfg = JobConfig(**SMALL, screening={"max-hospital-weight": 0.5})
    engine = RoundEngine(cfg)
    g = engine.method.global_arrays
    name = next(k for k, v in g.items() if v.dtype.kind == "f" and not k.endswith("running_var"))
    replies = [reply("h-a", {**g, name: g[name] + 1.0}, n=10), reply("h-b", {**g, name: g[name] + 2.0}, n=10),
               RoundReply(HospitalInfo("h-big", 10_000), Payload(arrays={"model": {**g, name: g[name] + 4.0}},
                                                                 metrics={"num-examples": 10_000, "server-round": 1}))]
    engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    np.testing.assert_allclose(engine.method.global_arrays[name], g[name] + 0.25 * 1 + 0.25 * 2 + 0.5 * 4, rtol=1e-5)


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_robust_aggregates_are_not_dragged_by_one_hospital(rule):
    arrays = [{"w": np.full(4, v, np.float32), "n": np.array(v, np.int64)} for v in (1.0, 2.0, 3.0, 4.0, 1e6)]
    result = robust_average(arrays, rule, trim_fraction=0.2)
    assert result["w"].dtype == np.float32 and np.all(result["w"] == 3.0)
    cfg = JobConfig(**SMALL, screening={"robust-aggregate": rule, "trim-fraction": 0.25, "update-norm-limit": 0.0})
    record, global_arrays = attacked(cfg, lambda g: reply("h-x", scaled(g, 1000.0)))
    assert record["aggregated"] == HONEST + ["h-x"]  # the norm rule is off: the aggregate itself resists
    engine = RoundEngine(cfg)
    for name, value in engine.method.global_arrays.items():
        if value.dtype.kind == "f" and not name.endswith("running_var"):
            assert np.abs(global_arrays[name] - value).max() < 0.1, name


def deflate_bomb(decompressed_mb: int) -> bytes:
    """A .npz of a float32 zero array that deflates ~1000:1."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("w.npy", "w", force_zip64=True) as entry:
            count = decompressed_mb * 250_000
            np.lib.format.write_array_header_1_0(entry, {"descr": "<f4", "fortran_order": False, "shape": (count,)})
            chunk = bytes(4_000_000)
            for _ in range(decompressed_mb // 4):
                entry.write(chunk)
    return buffer.getvalue()


def test_a_deflate_bomb_is_refused_before_it_is_decompressed():
    bomb = deflate_bomb(200)
    assert len(bomb) < 1_000_000
    content = RecordDict({"arrays": ArrayRecord({PACKED_ARRAY: Array(np.frombuffer(bomb, np.uint8))})})
    tracemalloc.start()
    with pytest.raises(MalformedPayload,
                       match=r"\(200\.0 MB\) once decompressed, more than the 10,000,000 bytes \(10\.0 MB\) allowed"):
        from_recorddict(content, limit=10_000_000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 20_000_000  # the bomb itself is < 1 MB; decompressing it would take 200 MB


def test_an_array_declaring_more_than_the_limit_is_refused_before_decoding():
    big = ArrayRecord({"w": Array(np.zeros(3_000_000, np.float32))})
    with pytest.raises(MalformedPayload,
                       match=r"12,000,\d+ bytes \(12\.0 MB\), more than the 1,000,000 bytes \(1\.0 MB\)"):
        from_recorddict(RecordDict({"arrays": big}), limit=1_000_000)


def test_a_size_refusal_below_a_megabyte_gives_the_real_numbers():
    small = ArrayRecord({"w": Array(np.zeros(1000, np.float32))})  # 4,000 bytes against a 1,000-byte limit
    with pytest.raises(MalformedPayload) as refused:
        from_recorddict(RecordDict({"arrays": small}), limit=1_000)
    assert re.search(r"take 4,\d{3} bytes, more than the 1,000 bytes allowed", str(refused.value))
    assert "0.0 MB" not in str(refused.value)


def identity_reply(name: str, count=DECLARED, **properties):
    def answer(message: Message) -> Message | None:
        if message.metadata.message_type != MessageType.QUERY:
            return None
        config = {"name": name, "num-examples": count, **{f"property.{k}": v for k, v in properties.items()}}
        return Message(RecordDict({"hospital": ConfigRecord(config)}), reply_to=message)
    return answer


def test_a_declared_bit_width_the_codec_lacks_is_refused_when_the_hospital_joins(tmp_path, caplog):
    config = {"task": "polyp-segmentation", "synthetic-samples": 30, "image-size": 16, "batch-size": 8,
              "min-partition-size": 5, "run-name": "t", "state-dir": str(tmp_path / "s")}
    nodes = simulated_hospitals(config, 2)
    strategy = QFedPolypStrategy(min_train_nodes=2, run_config=config)
    with caplog.at_level("WARNING", logger="fedmed"):
        strategy.start(FakeGrid({**nodes, 300: identity_reply("hospital-x", **{"bit-width": 33})}), num_rounds=1)
    assert 300 not in strategy.hospitals and "hospital-x: declared bit-width" in caplog.text
    assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01"]


def test_without_keys_a_contested_name_is_refused_to_both_nodes_until_one_is_stopped(tmp_path, caplog):
    config = {**{k.replace("_", "-"): v for k, v in SMALL.items()}, "state-dir": str(tmp_path / "s")}
    nodes = simulated_hospitals(config, 2)
    impostor = simulated_hospitals(config, 1, first_node_id=500)[500]  # partition 0: says it is hospital-00
    strategy = FedAvgStrategy(min_train_nodes=1, run_config=config)
    grid = FakeGrid(nodes)
    strategy.start(grid, num_rounds=1)
    grid.nodes[500] = impostor
    with caplog.at_level("WARNING", logger="fedmed"):
        strategy.start(grid, num_rounds=2)
    assert 101 not in strategy.hospitals and 500 not in strategy.hospitals  # neither trains while both claim it
    assert strategy.contested == {"hospital-00": {101, 500}}
    assert strategy.engine.history[1]["aggregated"] == ["hospital-01"]
    assert "node 500 claims to be hospital-00, which node 101 (still connected) is: names are not authenticated" \
        in caplog.text
    del grid.nodes[500]  # the operator stops the impostor
    strategy.start(grid, num_rounds=3)
    assert strategy.hospitals[101].name == "hospital-00" and not strategy.contested
    assert strategy.engine.history[2]["aggregated"] == ["hospital-00", "hospital-01"]


def key_pair(folder, name):
    """A hospital's ECDSA P-384 key pair in OpenSSH format, as deploy/make_hospital_keys.sh writes it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private = folder / name
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    (folder / f"{name}.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                        serialization.PublicFormat.OpenSSH))
    return private


def test_with_hospital_keys_a_name_is_accepted_only_with_that_hospitals_signature(tmp_path, caplog):
    registered, stolen = tmp_path / "registered", tmp_path / "attacker"
    registered.mkdir()
    stolen.mkdir()
    keys = {name: key_pair(registered, name) for name in ("hospital-00", "hospital-01")}
    other_key = key_pair(stolen, "hospital-00")  # a key pair that was never registered
    config = {**{k.replace("_", "-"): v for k, v in SMALL.items()}, "state-dir": str(tmp_path / "s"),
              "hospital-keys": str(registered)}
    def node(partition: int, node_id: int, key=None):
        signing = {"identity-key": str(key)} if key else {}
        return hospital_node(config, {"partition-id": partition, "num-partitions": 2, **signing}, node_id)

    honest = {101: node(0, 101, keys["hospital-00"]), 102: node(1, 102, keys["hospital-01"])}
    unsigned, forger = node(0, 500), node(0, 600, other_key)  # both say they are hospital-00
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    with caplog.at_level("WARNING", logger="fedmed"):
        strategy.start(FakeGrid({500: unsigned, 600: forger, **honest}), num_rounds=1)
    assert {node: h.name for node, h in strategy.hospitals.items()} == {101: "hospital-00", 102: "hospital-01"}
    assert "node 500 gave no usable identity (it claims to be 'hospital-00' but sent no signature" in caplog.text
    assert (f"node 600 gave no usable identity (it claims to be 'hospital-00' but its signature does not verify "
            f"with {registered / 'hospital-00.pub'})") in caplog.text
    assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01"]
