"""Secure aggregation (SecAgg+ on Flower's primitives, docs/secure-aggregation.md): the protocol sums and survives
dropouts up to its threshold, each method's secure sums give what its plain aggregation gives within the quantisation
error (FedProIn's NIA included), and what the server receives (FakeGrid records every reply) shows no single update.
The attacks (a lying server, replays, a hospital's policy, hostile shares) are tests/test_secure_aggregation_attacks.py.
What it costs is benchmarks/secure_aggregation/run.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Context, Message, MessageType, RecordDict

from client_app.secure_aggregation import stage_of
from common.config import ConfigError, load_job_config
from common.engine.round_engine import RoundEngine
from common.engine.wire import from_recorddict, message_nbytes
from common.methods.base import HospitalInfo, HospitalUpdate, Payload
from common.trust.audit import cross_check
from common.trust.secure_aggregation import (
    INTEGER,
    Entry,
    Layout,
    SecureAggregationSettings,
    decode_sum,
    encode,
    modulus_bits,
    pack_values,
    unpack_values,
)
from common.trust.secure_aggregation.hospital import HospitalRound, SecureAggregationRefusal, hospital_stage
from common.trust.secure_aggregation.inprocess import InProcess
from common.trust.secure_aggregation.messages import (
    COLLECT,
    CONSISTENCY,
    MASKED_ARRAY,
    MASKED_GROUP,
    SETUP,
    UNMASK,
)
from common.trust.secure_aggregation.methods import float_names
from common.trust.secure_aggregation.server import (
    add_masked_vector,
    consistency_config,
    setup_config,
    unmask_config,
)
from server_app.results import aggregated_in
from strategies import (
    FedAvgStrategy,
    FedBNStrategy,
    FedMEPDStrategy,
    FedProInStrategy,
    FedProtoStrategy,
    FedProxStrategy,
    MoonStrategy,
    QFedPolypStrategy,
)
from strategies.fedproin.secure import SECURE as FEDPROIN_SECURE
from strategies.fedproin.server import normalised_influence_aggregation
from strategies.qfedpolyp.secure import code_ranges
from strategies.records import arrays_of
from strategies.secure_aggregation import with_secure_aggregation

from .fake_grid import FakeGrid

SMALL_CLASSIFICATION = {"model": "small-cnn", "image-size": 16, "synthetic-samples": 120, "batch-size": 16,
                        "min-partition-size": 5}
SMALL_POLYP = {"task": "polyp-segmentation", "synthetic-samples": 30, "image-size": 16, "batch-size": 8,
               "min-partition-size": 5}
STEP = 2 * 8.0 / 2**22  # Flower's default quantisation step (clipping range 8, quantisation range 2^22)

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the protocol, without transport -------------------------------------------------------------------------------
def run_protocol(nodes, vectors, settings, silent_at=None, size=None):
    return InProcess(nodes, settings, size or len(next(iter(vectors.values())))).run(vectors, silent_at)


def test_a_hospitals_state_between_stages_is_kept_whole_in_one_value():
    """What the ClientApp keeps in context.state between stages: every key, seed, share and name, read back as it
    was written (the protocol then runs on from the copy)."""
    from common.trust.secure_aggregation.hospital import HospitalRound

    protocol = InProcess([3, 5, 8], SecureAggregationSettings(enabled=True), 10)
    protocol.keys()
    for node, state in protocol.states.items():
        copy = HospitalRound.from_bytes(state.to_bytes())
        assert vars(copy.flower) == vars(state.flower) and len(copy.flower.ss2_dict) == 2
        assert (copy.run, copy.rnd, copy.session, copy.names) == (state.run, state.rnd, state.session, state.names)
        protocol.states[node] = copy
    vectors = {n: np.arange(10) * n for n in (3, 5, 8)}
    for node, vector in vectors.items():
        add_masked_vector(protocol.plan, node, protocol.mask(node, vector))
    np.testing.assert_array_equal(protocol.unmask(), sum(vectors.values()))


def test_the_protocol_sums_and_survives_dropouts_up_to_its_threshold():
    nodes = [7, 19, 23, 42, 101]
    rng = np.random.default_rng(0)
    vectors = {n: rng.integers(0, 2**20, 300) for n in nodes}
    settings = SecureAggregationSettings(enabled=True)
    plan, total = run_protocol(nodes, vectors, settings)
    assert (plan.num_shares, plan.threshold) == (5, 3)  # more than half the shares, by default
    np.testing.assert_array_equal(total, sum(vectors.values()))

    # one hospital stops before its masked vector, one before the unmask stage: the sum is the 4 masked ones'
    silent = {42: COLLECT, 101: UNMASK}
    plan, total = run_protocol(nodes, vectors, settings, silent)
    assert plan.dropped == {42} and plan.masked == {7, 19, 23, 101}
    np.testing.assert_array_equal(total, sum(vectors[n] for n in plan.masked))

    # one lost at setup never enters anybody's masks
    plan, total = run_protocol(nodes, vectors, settings, {7: SETUP, 19: COLLECT})
    assert plan.keyed == {19, 23, 42, 101} and plan.masked == {23, 42, 101}
    np.testing.assert_array_equal(total, sum(vectors[n] for n in plan.masked))

    # three of five stop before masking: two live neighbours each, below the threshold of 3
    plan, problem = run_protocol(nodes, vectors, settings, dict.fromkeys([7, 19, 23], COLLECT))
    assert "fewer live neighbours than the reconstruction threshold 3" in problem

    # SecAgg+ proper: 3 shares per hospital over 7, each hospital masks with its two ring neighbours only
    nodes = list(range(1, 8))
    vectors = {n: rng.integers(0, 2**20, 50) for n in nodes}
    plan, total = run_protocol(nodes, vectors, SecureAggregationSettings(num_shares=3, reconstruction_threshold=2),
                               {3: COLLECT})
    assert plan.num_shares == 3 and all(len(n) == 3 for n in plan.neighbours.values())
    np.testing.assert_array_equal(total, sum(vectors[n] for n in plan.masked))


def test_a_masked_vector_says_nothing_of_its_vector():
    rng = np.random.default_rng(1)
    vectors = {n: rng.integers(0, 2**22, 20_000) for n in (1, 2, 3)}
    vectors[1][:] = 0  # a hospital whose update is all zeros...
    protocol = InProcess([1, 2, 3], SecureAggregationSettings(), 20_000)
    protocol.keys()
    masked, other = protocol.mask(1, vectors[1]), protocol.mask(2, vectors[2])
    # ...sends values spread evenly over [0, 2^32): mean 2^31, a quarter in each quarter, not correlated with others'
    # (the keys are fresh each run: bounds at 5 standard errors of 20,000 uniform draws, so a chance failure is ~1e-6)
    assert abs(masked.mean() / 2**32 - 0.5) < 0.01
    assert np.allclose(np.histogram(masked, bins=4, range=(0, 2**32))[0] / masked.size, 0.25, atol=0.016)
    assert abs(np.corrcoef(other, vectors[2])[0, 1]) < 0.036


def test_a_hospital_refuses_what_would_unmask_it():
    protocol = InProcess([1, 2, 3], SecureAggregationSettings(), 10)
    config = setup_config(protocol.plan)
    with pytest.raises(SecureAggregationRefusal, match="threshold below 2"):
        hospital_stage(HospitalRound.new(), SETUP, {**config, "secagg.threshold": 1}, 1, protocol.rules[1])
    with pytest.raises(SecureAggregationRefusal, match="expects stage 'setup'"):  # the stages' order
        hospital_stage(HospitalRound.new(), UNMASK, unmask_config(protocol.plan, 1), 1, protocol.rules[1])
    protocol.keys()
    for n in (1, 2):
        add_masked_vector(protocol.plan, n, protocol.mask(n, np.zeros(10)))
    for n in (1, 2):
        protocol.ask(n, CONSISTENCY, consistency_config(protocol.plan, n))
    asked = unmask_config(protocol.plan, 1)
    both = {**asked, "secagg.active_nids": [1, 2, 3], "secagg.dead_nids": [2]}  # its mask seed and its key
    with pytest.raises(SecureAggregationRefusal, match="never both"):
        protocol.ask(1, UNMASK, both)
    with pytest.raises(SecureAggregationRefusal, match="expects stage 'setup'"):  # a refusal ends its round
        protocol.ask(1, UNMASK, asked)
    answer = protocol.ask(2, UNMASK, unmask_config(protocol.plan, 2))
    assert sorted(answer["secagg.nids"]) == [1, 2, 3]
    done = protocol.states[2].flower
    assert done.sk1 == b"" and done.rd_seed == b"" and not getattr(done, "rd_seed_share_dict", {})  # nothing kept
    with pytest.raises(SecureAggregationRefusal, match="expects stage 'setup'"):  # and it is not asked twice
        protocol.ask(2, UNMASK, unmask_config(protocol.plan, 2))


def test_contributions_encode_and_pack_exactly():
    layout = Layout((Entry("weight", ()), Entry("model/w", (3, 4)), Entry("counts", (5,), INTEGER, 100)))
    rng = np.random.default_rng(2)
    contributions = [{"weight": np.asarray(w), "model/w": rng.normal(0, 0.01, (3, 4)),
                      "counts": rng.integers(0, 101, 5)} for w in (0.2, 0.3, 0.5)]
    total = sum(encode(layout, c, 8.0, 2**22) for c in contributions)
    sums = decode_sum(layout, total, 3, 8.0, 2**22)
    np.testing.assert_allclose(sums["model/w"], sum(c["model/w"] for c in contributions), atol=3 * STEP)
    assert abs(sums["weight"] - 1.0) <= 3 * STEP
    np.testing.assert_array_equal(sums["counts"], sum(c["counts"] for c in contributions))
    for bits in (5, 12, 16, 32, 40):
        values = rng.integers(0, 2**bits, 70_001)
        packed = pack_values(values, bits)
        assert packed.size == math.ceil(values.size * bits / 8)
        np.testing.assert_array_equal(unpack_values(packed, bits, values.size), values)


# --- FedProIn: NIA from two secure sums ----------------------------------------------------------------------------
def test_fedproin_secure_nia_equals_plain_nia_within_the_quantisation_error():
    job = load_job_config({**SMALL_CLASSIFICATION, "strategy": "fedproin", "run-name": "nia"})
    method = RoundEngine(job).method
    glob = {k: v.copy() for k, v in method.global_arrays.items()}
    classes, per_class = glob["prototypes"].shape[:2]
    rng = np.random.default_rng(3)
    hospitals = [HospitalInfo(f"h{i}", n) for i, n in enumerate((40, 25, 60))]
    trained, influences = [], []
    for hospital in hospitals:
        model = {k: (v + rng.normal(0, 0.02, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
                 for k, v in glob.items()}
        counts = rng.multinomial(hospital.num_examples, np.full(classes * per_class, 1 / (classes * per_class)))
        counts = counts.reshape(classes, per_class)
        counts[0, 1] = 0  # prototype (0, 1): nobody uses it, it keeps its previous value
        counts[1, 0] = 1 if hospital.name == "h0" else 0  # (1, 0): one sample of one hospital
        trained.append(model)
        influences.append(counts)
    settings = SecureAggregationSettings(enabled=True)
    plan = FEDPROIN_SECURE.plan(method, hospitals, settings, 0.0)
    vectors = {}
    for i, hospital in enumerate(hospitals):
        received = Payload(arrays={"model": glob})
        reply = Payload(arrays={"model": trained[i]}, metrics={"num-examples": hospital.num_examples,
                                                                "influence": influences[i].ravel().tolist()})
        values, _ = FEDPROIN_SECURE.contribution(received, reply, plan.common, plan.layout)
        vectors[i + 1] = encode(plan.layout, values, settings.clipping_range, settings.quantization_range)
    protocol, total = run_protocol([1, 2, 3], vectors, settings)
    sums = decode_sum(plan.layout, total, 3, settings.clipping_range, settings.quantization_range)
    said = [HospitalUpdate(h, Payload(metrics={"num-examples": h.num_examples})) for h in hospitals]
    record = FEDPROIN_SECURE.apply(method, 1, sums, plan, said)

    plain = normalised_influence_aggregation([t["prototypes"] for t in trained], influences, glob["prototypes"])
    usage = np.sum(influences, axis=0)
    np.testing.assert_array_equal(record["prototype-usage"], usage.tolist())  # counts are summed exactly
    secure = method.global_arrays["prototypes"]
    np.testing.assert_array_equal(secure[0, 1], glob["prototypes"][0, 1])  # unused: the previous prototype
    # each hospital's I x D / W_I is within a quantisation step; NIA multiplies their sum by W_I / sum I
    bound = 3 * STEP * plan.context["influence-bound"] / np.maximum(usage, 1)[..., None] + 1e-6
    assert (np.abs(secure - plain) <= bound).all()
    assert np.abs(secure - plain).max() < 1e-3
    encoder = [k for k in glob if k != "prototypes" and glob[k].dtype.kind == "f"]
    weights = [h.num_examples for h in hospitals]
    for name in encoder:
        expected = sum(w * t[name].astype(np.float64) for w, t in zip(weights, trained)) / sum(weights)
        np.testing.assert_allclose(method.global_arrays[name], expected, atol=5 * STEP * 3 + 1e-6, err_msg=name)


# --- over a Flower Grid: FakeGrid nodes answering with fedmed's ClientApp handlers ---------------------------------
def secure_node(run_config, node_config, node_id, silent_at=None, tamper=None, tamper_reply=None):
    """A hospital answering with fedmed's ClientApp handlers (``Hospital.answer`` runs the stages: ``secure_train``);
    ``silent_at``: the stage from which it stops answering (as when its SuperNode dies); ``tamper``: changes each
    message it receives first (a hostile hospital ignoring what the server set); ``tamper_reply``: changes each
    reply it sends (a hostile hospital's own answers)."""
    from client_app import app as client
    from client_app.node_config import every_hospital_in_this_process

    context = Context(run_id=1, node_id=node_id, node_config=dict(node_config), state=RecordDict(),
                      run_config=dict(run_config))
    gone = [False]

    def answer(message: Message) -> Message | None:
        try:
            stage = stage_of(message)
        except ValueError:  # a stage no hospital knows: the hospital's own handler refuses it
            stage = None
        if gone[0] or (silent_at is not None and stage == silent_at):
            gone[0] = True
            return None
        kind = message.metadata.message_type
        if tamper is not None:
            tamper(message)
        handlers = {MessageType.TRAIN: client.train, MessageType.QUERY: client.query,
                    MessageType.EVALUATE: client.evaluate}
        with every_hospital_in_this_process():  # one operator runs them all, as Flower's simulation engine does
            reply = handlers[kind](message, context)
        if tamper_reply is not None and not reply.has_error():
            tamper_reply(stage, reply)
        return reply

    return answer


def secure_hospitals(run_config, count, silent=None, **node_config):
    silent = silent or {}
    return {101 + pid: secure_node(run_config, {"partition-id": pid, "num-partitions": count, **node_config},
                                   101 + pid, silent.get(pid)) for pid in range(count)}


def plain_hospitals(run_config, count, silent=()):
    from .fake_grid import hospital_node

    nodes = {}
    for pid in range(count):
        handler = hospital_node(run_config, {"partition-id": pid, "num-partitions": count}, 101 + pid)
        nodes[101 + pid] = (lambda m: None) if pid in silent else handler
    return nodes


def config_of(tmp_path, base, name, **extra):
    return {**base, "run-name": name, "state-dir": str(tmp_path / name / "state"),
            "results-dir": str(tmp_path / name / "results"), "round-timeout": 3.0, **extra}


def masked_replies(grid: FakeGrid) -> list[Message]:
    return [m for m in grid.replies if not m.has_error() and stage_of_reply(m) == COLLECT]


def stage_of_reply(message: Message) -> str | None:
    for record in message.content.config_records.values():
        if "secagg.stage" in record:
            return record["secagg.stage"]
    return None


@pytest.mark.parametrize("signed", [False, True])
def test_rounds_after_the_first_set_up_ahead_and_sum_as_plain_rounds(tmp_path, signed):
    """The next round's key stages ride on this round's last ones, so a run of the same hospitals has one setup
    stage, in round 1: without signatures each unmask stage carries the next round's setup (its keys answered with
    the shares), and every round opens with the share-keys stage; with the consortium's keys (``signed``) the
    consistency stage carries the next round's setup and the unmask stage its key sharing, so every later round
    opens with its collect stage (one round trip fewer). The model after three rounds is the plain run's, up to
    quantisation; the last round sets up nothing; each round is claimed once in every hospital's memory."""
    from .test_hostile_hospital import key_pair

    plain_config = config_of(tmp_path, SMALL_CLASSIFICATION, "plain")
    expected = arrays_of(FedAvgStrategy(min_train_nodes=3, min_available_nodes=3, run_config=plain_config).start(
        FakeGrid(plain_hospitals(plain_config, 3)), num_rounds=3).arrays)
    keys = tmp_path / "keys"
    keys.mkdir()
    extra = {"hospital-keys": str(keys)} if signed else {}
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "secure", **extra)
    nodes = secure_hospitals(config, 3)
    if signed:
        nodes = {101 + pid: secure_node(config, {"partition-id": pid, "num-partitions": 3, "peer-keys": str(keys),
                                                 "identity-key": str(key_pair(keys, f"hospital-{pid:02d}"))}, 101 + pid)
                 for pid in range(3)}
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=3, min_available_nodes=3, run_config=config)
    grid = FakeGrid(nodes)
    final = arrays_of(strategy.start(grid, num_rounds=3).arrays)
    start = initial_model(plain_config)
    moved = np.concatenate([(expected[k] - v).ravel() for k, v in start.items()])
    apart = np.concatenate([(final[k] - expected[k]).ravel() for k in start])
    # masks that did not cancel would throw the model anywhere below the modulus; what is left is round 1's
    # quantisation error, carried through two more trainings (Adam's steps are normalised: tiny changes grow)
    assert np.linalg.norm(apart) < 0.05 * np.linalg.norm(moved), (np.linalg.norm(apart), np.linalg.norm(moved))
    stages = [set(r["secure-aggregation"]["stages"]) for r in strategy.engine.history]
    assert ["setup" in s for s in stages] == [True, False, False]
    assert ["share_keys" in s for s in stages] == [True, not signed, not signed]
    sent = grid.sent_of_type(MessageType.TRAIN)
    for stage, rides in ((CONSISTENCY, signed), (UNMASK, True)):
        ahead = [int(m.content["config"].get("secagg.ahead.server-round", 0)) for m in sent
                 if stage_of_message(m) == stage]
        assert ahead == ([2, 2, 2, 3, 3, 3, 0, 0, 0] if rides else [0] * len(ahead))  # round 3 sets up nothing
    shared = [m for m in sent
              if stage_of_message(m) == UNMASK and "secagg.ahead.secagg.neighbours" in m.content["config"]]
    assert len(shared) == (6 if signed else 0)  # the unmask stage shares the next round's keys
    memory = (tmp_path / "secure" / "state" / "hospital-00" / "secure-aggregation.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in memory if '"rounds"' in line] == [1, 2, 3]


def test_a_round_keyed_ahead_that_the_server_cannot_use_is_set_up_again(tmp_path):
    """With the consortium's keys, a round's keys are shared ahead with the last round's unmask stage; where the next
    round samples other hospitals, the server sets it up afresh, and the hospitals that shared keys ahead take part
    (a round is claimed where a hospital first adds to it: its collect stage)."""
    import random

    from .test_hostile_hospital import key_pair

    keys = tmp_path / "keys"
    keys.mkdir()
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "secure", **{"hospital-keys": str(keys)})
    nodes = {101 + pid: secure_node(config, {"partition-id": pid, "num-partitions": 4, "peer-keys": str(keys),
                                             "identity-key": str(key_pair(keys, f"hospital-{pid:02d}"))}, 101 + pid)
             for pid in range(4)}
    random.seed(3)  # Flower's sampling: three of the four hospitals a round
    strategy = with_secure_aggregation(FedAvgStrategy)(fraction_train=0.75, min_train_nodes=3, min_available_nodes=4,
                                                       run_config=config)
    strategy.start(FakeGrid(nodes), num_rounds=4)
    history = strategy.engine.history
    trained = [sorted(r["aggregated"]) for r in history]
    assert all(len(names) == 3 for names in trained) and not any(r.get("skipped") for r in history)
    again = [r["round"] for r in history[1:] if "setup" in r["secure-aggregation"]["stages"]]
    assert again and all(trained[rnd - 1] != trained[rnd - 2] for rnd in again)  # set up afresh where it changed


def test_a_hospital_silent_after_its_update_came_in_is_named_missing_in_the_round_it_cost(tmp_path):
    """With the consortium's keys every survivor signs the survivor set before anyone unmasks: hospital-02, whose
    masked update is in the sum but which stops answering at the consistency stage (its SuperNode killed), leaves
    the others refusing to unmask, and the skipped round names it missing (not aggregated, not merely lost in the
    protocol's summary); the model is unchanged."""
    from .test_hostile_hospital import key_pair

    keys = tmp_path / "keys"
    keys.mkdir()
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "killed", **{"hospital-keys": str(keys)})
    nodes = {101 + pid: secure_node(config, {"partition-id": pid, "num-partitions": 3, "peer-keys": str(keys),
                                             "identity-key": str(key_pair(keys, f"hospital-{pid:02d}"))}, 101 + pid,
                                    silent_at=CONSISTENCY if pid == 2 else None)
             for pid in range(3)}
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, min_available_nodes=3, run_config=config)
    before = arrays_of(strategy.initial_arrays())
    strategy.start(FakeGrid(nodes), num_rounds=1)
    record = strategy.engine.history[0]
    assert "skipped" in record and record["missing"] == ["hospital-02"]
    assert aggregated_in(record) == []
    assert record["secure-aggregation"]["lost"]["hospital-02"].startswith(f"{CONSISTENCY}: no reply")
    for name, value in arrays_of(strategy.initial_arrays()).items():
        np.testing.assert_array_equal(value, before[name])


def stage_of_message(message: Message) -> str | None:
    return message.content["config"].get("secagg.stage")


def test_fedavg_over_a_grid_the_server_sees_only_masked_vectors_and_gets_the_mean(tmp_path):
    plain_config = config_of(tmp_path, SMALL_CLASSIFICATION, "plain")
    plain = FedAvgStrategy(min_train_nodes=2, run_config=plain_config)
    plain_grid = FakeGrid(plain_hospitals(plain_config, 3))
    expected = arrays_of(plain.start(plain_grid, num_rounds=1).arrays)

    config = config_of(tmp_path, SMALL_CLASSIFICATION, "secure")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    grid = FakeGrid(secure_hospitals(config, 3))
    result = strategy.start(grid, num_rounds=1)
    final = arrays_of(result.arrays)
    for name, value in expected.items():  # the same hospitals trained the same way: only quantisation differs
        np.testing.assert_allclose(final[name], value, atol=3 * STEP + 1e-6, err_msg=name)
    record = strategy.engine.history[0]
    assert record["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"] and "skipped" not in record
    secure = record["secure-aggregation"]
    assert secure["hospitals-in-sum"] == 3 and secure["lost"] == {} and secure["threshold"] == 2
    # no signatures to check (no hospital-keys): no consistency stage, the hospitals check the set at unmasking
    assert set(secure["stages"]) == {"setup", "share_keys", "collect_masked_vectors", "unmask"}
    assert secure["hostile-shares"] == {}
    assert result.train_metrics_clientapp[1]["bytes-up.hospital-00"] > 0

    # what the server received: per hospital one masked vector and numbers, no model array; the vector is
    # unrelated to the hospital's update, which the plain run's reply shows
    replies = masked_replies(grid)
    assert len(replies) == 3
    initial = initial_model(plain_config)  # what every hospital received in round 1
    updates = {}
    for reply in plain_grid.replies:
        if reply.metadata.message_type == MessageType.TRAIN:
            model = from_recorddict(reply.content).arrays["model"]
            updates[reply.metadata.src_node_id] = np.concatenate([(model[k] - v).ravel() for k, v in initial.items()])
    for reply in replies:
        payload = from_recorddict(reply.content)
        assert set(payload.arrays) == {MASKED_GROUP} and set(payload.arrays[MASKED_GROUP]) == {MASKED_ARRAY}
        assert all(not isinstance(v, list) for v in payload.metrics.values())
        masked = unpack_values(payload.arrays[MASKED_GROUP][MASKED_ARRAY], 32, secure["values"])
        update = updates[reply.metadata.src_node_id]
        assert abs(np.corrcoef(masked[1:].astype(np.float64), update)[0, 1]) < 0.05
        assert abs(masked.mean() / 2**32 - 0.5) < 0.02


def initial_model(run_config):
    arrays = arrays_of(FedAvgStrategy(run_config=run_config).initial_arrays())
    return {k: v.astype(np.float64) for k, v in arrays.items() if v.dtype.kind == "f"}


def test_hospitals_that_drop_out_after_sharing_keys_do_not_stop_the_round(tmp_path):
    # hospital-03 stops answering at the collect stage (after sharing its keys): its masks are removed with the
    # others' shares and the round is FedAvg over the other three, as a plain round without it
    plain_config = config_of(tmp_path, SMALL_CLASSIFICATION, "plain")
    expected = arrays_of(FedAvgStrategy(min_train_nodes=2, run_config=plain_config).start(
        FakeGrid(plain_hospitals(plain_config, 4, silent={3})), num_rounds=1).arrays)
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "drop")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    grid = FakeGrid(secure_hospitals(config, 4, silent={3: COLLECT}))
    final = arrays_of(strategy.start(grid, num_rounds=1).arrays)
    record = strategy.engine.history[0]
    assert record["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"] and "skipped" not in record
    assert record["missing"] == ["hospital-03"]
    assert record["secure-aggregation"]["lost"]["hospital-03"].startswith("collect_masked_vectors: no reply")
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, atol=3 * STEP + 1e-6, err_msg=name)
    # the unmask stage asked the live ones for hospital-03's key shares
    unmask = [m for m in grid.sent_of_type(MessageType.TRAIN) if stage_of(m) == UNMASK]
    assert len(unmask) == 3 and all(m.content["config"]["secagg.dead_nids"] == [104] for m in unmask)


def test_below_the_threshold_the_round_is_skipped_with_its_reason(tmp_path, caplog):
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "below")
    strategy = with_secure_aggregation(FedAvgStrategy)(
        min_train_nodes=2, run_config=config, secure_aggregation={"reconstruction-threshold": 3})
    before = arrays_of(strategy.initial_arrays())
    grid = FakeGrid(secure_hospitals(config, 3, silent={2: COLLECT}))
    strategy.start(grid, num_rounds=1)
    record = strategy.engine.history[0]
    assert "fewer than 3" in record["skipped"] and "unchanged" in record["skipped"]
    assert "fewer than 3" in caplog.text
    for name, value in arrays_of(strategy.initial_arrays()).items():
        np.testing.assert_array_equal(value, before[name])
    assert not [m for m in grid.sent_of_type(MessageType.TRAIN) if stage_of(m) == UNMASK]


@pytest.mark.parametrize("breaks,why", [("its weight", "weights sum to"), ("the norm bound", "exceeds the norm bound")])
def test_a_sum_no_honest_hospitals_could_have_sent_is_refused(tmp_path, monkeypatch, breaks, why):
    """Masking hides who broke their bounds, not that someone did: a hospital that weighs itself five times above
    its samples, or skips the norm bound, gives a sum the server refuses (FedAvg family)."""
    import strategies.fedavg.secure as fedavg_secure
    from common.trust.secure_aggregation.messages import NORM_BOUND_KEY, OWN_NAME_KEY

    honest = fedavg_secure.SECURE.contribution

    def contribution(received, reply, params, layout):
        if params.get(OWN_NAME_KEY) != "hospital-02":
            return honest(received, reply, params, layout)
        if breaks == "the norm bound":
            return honest(received, reply, {**params, NORM_BOUND_KEY: 0.0}, layout)
        values, metrics = honest(received, reply, params, layout)
        return {k: 5.0 * v for k, v in values.items()}, metrics

    monkeypatch.setattr(fedavg_secure.SECURE, "contribution", contribution)
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "hostile")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config,
                                                       secure_aggregation={"update-norm-bound": 1e-3})
    nodes = secure_hospitals(config, 3)
    before = arrays_of(strategy.initial_arrays())
    strategy.start(FakeGrid(nodes), num_rounds=1)
    record = strategy.engine.history[0]
    assert why in record["skipped"] and "outside its bounds" in record["skipped"]
    for name, value_ in arrays_of(strategy.initial_arrays()).items():
        np.testing.assert_array_equal(value_, before[name])


def test_a_hospital_lost_at_the_unmask_stage_stays_in_the_sum(tmp_path):
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "late")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    grid = FakeGrid(secure_hospitals(config, 3, silent={0: UNMASK}))
    strategy.start(grid, num_rounds=1)
    record = strategy.engine.history[0]
    assert record["secure-aggregation"]["hospitals-in-sum"] == 3 and "skipped" not in record
    assert "hospital-00" in record["secure-aggregation"]["lost"]


SECURE_CASES = [(FedProxStrategy, SMALL_CLASSIFICATION, {}), (MoonStrategy, SMALL_CLASSIFICATION, {}),
                (FedBNStrategy, SMALL_CLASSIFICATION, {}), (FedProInStrategy, SMALL_CLASSIFICATION, {})]


@pytest.mark.parametrize("strategy_type,base,extra", SECURE_CASES, ids=[c[0].__name__ for c in SECURE_CASES])
def test_each_method_sums_securely_what_it_aggregates(tmp_path, strategy_type, base, extra):
    plain_config = config_of(tmp_path, base, "plain", **extra)
    plain = strategy_type(min_train_nodes=2, run_config=plain_config)
    expected = arrays_of(plain.start(FakeGrid(plain_hospitals(plain_config, 2)), num_rounds=1).arrays)
    config = config_of(tmp_path, base, "secure", **extra)
    strategy = with_secure_aggregation(strategy_type)(min_train_nodes=2, run_config=config)
    grid = FakeGrid(secure_hospitals(config, 2))
    final = arrays_of(strategy.start(grid, num_rounds=1).arrays)
    assert "skipped" not in strategy.engine.history[0]
    influence = plain.engine.history[0]["method"].get("prototype-usage")
    for name, value in expected.items():
        atol = 3 * STEP + 1e-6
        if name == "prototypes":  # NIA divides the sum by the prototype's influence
            atol = 2 * STEP * max(h.num_examples for h in strategy.hospitals.values()) + 1e-6
            assert strategy.engine.history[0]["method"]["prototype-usage"] == influence
        np.testing.assert_allclose(final[name], value, atol=atol, err_msg=name)
    for reply in masked_replies(grid):
        payload = from_recorddict(reply.content)
        assert set(payload.arrays) == {MASKED_GROUP} and "influence" not in payload.metrics


def test_qfedpolyp_sums_codes_in_the_integer_domain_and_its_bytes(tmp_path):
    plain_config = config_of(tmp_path, SMALL_POLYP, "plain", **{"qfedpolyp.bit-widths": "4,8"})
    plain = QFedPolypStrategy(min_train_nodes=2, run_config=plain_config)
    plain_grid = FakeGrid(plain_hospitals(plain_config, 2))
    expected = arrays_of(plain.start(plain_grid, num_rounds=1).arrays)
    config = config_of(tmp_path, SMALL_POLYP, "secure", **{"qfedpolyp.bit-widths": "4,8"})
    strategy = with_secure_aggregation(QFedPolypStrategy)(min_train_nodes=2, run_config=config)
    grid = FakeGrid(secure_hospitals(config, 2))
    final = arrays_of(strategy.start(grid, num_rounds=1).arrays)
    record = strategy.engine.history[0]
    assert "skipped" not in record and record["method"]["grid-bits"] == 8
    assert record["secure-aggregation"]["modulus-bits"] == 8 + 1 + 1  # b + ceil(log2 H) + 1
    # the hospitals' models re-coded on the server's shared grid: within about a cell of the 4-bit hospital's grid
    initial = arrays_of(plain.initial_arrays())
    lows, highs = code_ranges(initial, strategy.secure_aggregation.settings.code_range_margin)
    for name, low, high in zip(float_names(initial), lows, highs):
        assert np.abs(final[name] - expected[name]).max() <= 1.5 * (high - low) / 2**4 + 1e-6, name
    out_of_range = [r["secagg-out-of-range"] for r in record["hospital_metrics"].values()]
    assert max(out_of_range) < 1e-4

    sizes = message_sizes(plain_grid, grid)
    assert sizes["masked"][1] / sizes["plain"][1] == pytest.approx(10 / 8, rel=0.1)  # the 8-bit hospital


SMALL_BRAIN = {"task": "brain-tumour-segmentation", "batch-size": 2, "brain.widths": "4,8,16,32", "brain.crop-size": 16,
               "brain.synthetic-size": 24, "brain.synthetic-cases": 12,
               "brain.hospital-modalities": "flair,t1ce;flair,t2", "device": "cpu", "fedmepd.warmup-rounds": 0,
               "fedmepd.patience": 1, "fedmepd.num-anchors": 2}


def test_fedmepd_sums_shared_encoders_and_the_decoder_per_filter(tmp_path, monkeypatch):
    from strategies.fedmepd.server import FedMEPDServer

    monkeypatch.setattr(FedMEPDServer, "server_step", lambda self, rnd: {})  # the aggregate itself is compared
    plain_config = config_of(tmp_path, SMALL_BRAIN, "plain")
    plain = FedMEPDStrategy(min_train_nodes=2, run_config=plain_config)
    initial = arrays_of(plain.initial_arrays())
    expected = arrays_of(plain.start(FakeGrid(plain_hospitals(plain_config, 2)), num_rounds=1).arrays)
    config = config_of(tmp_path, SMALL_BRAIN, "secure")
    strategy = with_secure_aggregation(FedMEPDStrategy)(min_train_nodes=2, run_config=config)
    final = arrays_of(strategy.start(FakeGrid(secure_hospitals(config, 2)), num_rounds=1).arrays)
    record = strategy.engine.history[0]
    assert "skipped" not in record and record["method"]["encoder-contributors"] == {"flair": 2, "t1ce": 1, "t2": 1}
    assert record["method"]["hospital-average"]  # the hospitals' own scores, which they state in the clear
    for name, value in expected.items():
        if name.startswith(("encoders.t1ce.", "encoders.t2.")):  # one hospital each: never summed, never sent
            np.testing.assert_array_equal(final[name], initial[name], err_msg=name)
        elif name.startswith(("encoders.flair.", "decoder.")) and value.dtype.kind == "f":
            np.testing.assert_allclose(final[name], value, atol=3 * STEP + 1e-6, err_msg=name)


def message_sizes(plain_grid: FakeGrid, grid: FakeGrid) -> dict[str, list[int]]:
    plain = [message_nbytes(m) for m in plain_grid.replies if m.metadata.message_type == MessageType.TRAIN]
    masked = [message_nbytes(m) for m in masked_replies(grid)]
    return {"plain": plain, "masked": masked}


def test_methods_it_cannot_sum_are_refused_when_the_strategy_is_built(tmp_path):
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "no")
    with pytest.raises(ConfigError, match="not available for strategy 'fedproto'"):
        with_secure_aggregation(FedProtoStrategy)(run_config=config)
    with pytest.raises(ConfigError, match="robust-aggregate"):
        with_secure_aggregation(FedAvgStrategy)(run_config={**config, "screening.robust-aggregate": "median"})
    with pytest.raises(ConfigError, match="quantise='weights'"):
        with_secure_aggregation(QFedPolypStrategy)(run_config={**config_of(tmp_path, SMALL_POLYP, "q"),
                                                               "qfedpolyp.quantise": "update"})
    with pytest.raises(ValueError, match="power of 2"):
        SecureAggregationSettings(modulus_range=3 * 2**20)


def test_the_settings_import_without_flower():
    """``common.config`` imports the settings, and the methods' halves import it on GPU machines without Flower; each
    method's package says what it sums (``MethodSpec.secure``), and the list comes from the registry."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['flwr'] = None\n"
            "from common.trust.secure_aggregation import SecureAggregationSettings, Layout, Entry\n"
            "from common.trust.secure_aggregation.methods import secure_method_names\n"
            "print(SecureAggregationSettings(enabled=True).reconstruction_threshold, secure_method_names())")
    from common.methods.registry import methods

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"0.5 {sorted(name for name, spec in methods().items() if spec.secure)}"


def test_modulus_bits_name_the_wire_width():
    assert modulus_bits(2**32) == 32 and modulus_bits(2**12) == 12
    with pytest.raises(ValueError):
        modulus_bits(12)


def test_a_plain_strategy_with_secure_aggregation_on_in_its_run_config_masks_every_reply(tmp_path):
    """No mixin, no own ClientApp: the run config switches it on, fedmed's own ClientApp answers the stages."""
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, simulated_hospitals

    config = config_of(tmp_path, SMALL_CLASSIFICATION, "plain", **{"secure-aggregation.enabled": True})
    strategy = FedAvgStrategy(min_train_nodes=3, min_available_nodes=3, run_config=config)
    assert strategy.secure_aggregation is not None
    grid = FakeGrid(simulated_hospitals(config, 3))
    strategy.start(grid, num_rounds=1)
    assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"]
    trained = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN and not m.has_error()]
    assert trained and not any(len(m.content.array_records.get("arrays", {})) for m in trained)  # never a model
    # every answer, each key stage's included, carries the hospital's audit head, which the server's log records
    server_log = tmp_path / "plain" / "results" / "plain" / "audit.jsonl"
    received = [json.loads(line) for line in server_log.read_text().splitlines()
                if json.loads(line).get("direction") == "received"]
    assert len(received) >= 3 * 5 and all(r.get("peer-audit-head") for r in received)  # query + 4 stages each
    for name in ("hospital-00", "hospital-01", "hospital-02"):
        assert cross_check(tmp_path / "plain" / "state" / name / "audit.jsonl", server_log, name) == []


# --- Shamir's sharing (common/trust/secure_aggregation/sharing.py) ---------------------------------------------------
def test_any_threshold_of_the_shares_rebuild_the_secret_and_fewer_do_not():
    import itertools

    from common.trust.secure_aggregation.sharing import combine_shares, create_shares

    secret = bytes(range(32))
    shares = create_shares(secret, 4, 7)
    assert len(shares) == 7 and len({s[4:] for s in shares}) == 7
    for subset in itertools.combinations(shares, 4):
        assert combine_shares(list(subset)) == secret
    with pytest.raises(ValueError):  # three points of a degree-3 polynomial: another secret (here no well-formed one)
        assert combine_shares(shares[:3]) != secret
    assert create_shares(secret, 4, 7)[0] != shares[0]  # fresh coefficients every time
    assert combine_shares(create_shares(b"\x00" * 5, 2, 3)[1:]) == b"\x00" * 5  # leading zeros survive
    with pytest.raises(ValueError, match="not of one secret"):
        combine_shares([shares[0], shares[0], shares[1], shares[2]])  # an index twice

    from common.trust.secure_aggregation.keys import new_key_pair, public_key_of

    private, public = new_key_pair()  # a private key is shared as its 32 raw bytes
    assert public_key_of(combine_shares(create_shares(private, 3, 5)[2:])) == public
