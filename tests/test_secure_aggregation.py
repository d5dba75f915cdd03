"""Secure aggregation (SecAgg+ on Flower's primitives, docs/secure-aggregation.md): the protocol sums and survives
dropouts up to its threshold, hospitals refuse what would unmask them, each method's secure sums give what its plain
aggregation gives within the quantisation error (FedProIn's NIA included), and what the server receives (FakeGrid
records every reply) shows no single update. ``python -m tests.test_secure_aggregation`` prints the cost table of
docs/secure-aggregation.md."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.common.secure_aggregation.secaggplus_constants import Stage

from client_app.secure_aggregation import stage_of
from common.config import ConfigError, load_job_config
from common.methods.base import HospitalInfo, HospitalUpdate, Payload
from common.round_engine import RoundEngine
from common.secure_aggregation import (
    INTEGER,
    MASKED_ARRAY,
    MASKED_GROUP,
    Entry,
    Layout,
    SecureAggregationSettings,
    add_masked_vector,
    code_ranges,
    collect_config,
    decode_sum,
    encode,
    fedproin_apply,
    fedproin_contribution,
    fedproin_plan,
    float_names,
    hospital_stage,
    modulus_bits,
    ours,
    pack_values,
    plan_round,
    receive_key_shares,
    receive_public_keys,
    setup_config,
    share_keys_config,
    threshold_problem,
    unmask_config,
    unmask_sum,
    unpack_values,
)
from common.wire import from_recorddict, message_nbytes
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
from strategies.fedproin.server import normalised_influence_aggregation
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
    """Every stage at the server and at each hospital; ``silent_at``: node -> the stage it stops answering at.
    Returns the protocol state and the unmasked sum (or the reason the round cannot go on)."""
    silent_at = silent_at or {}
    plan = plan_round(nodes, settings, [0, 1], size or len(next(iter(vectors.values()))))
    states = {n: SecAggPlusState() for n in nodes}

    def answers(stage, config_of, alive):
        out = {}
        for node in sorted(alive):
            if silent_at.get(node) == stage:
                continue
            states[node], answer = hospital_stage(states[node], stage, config_of(node), node)
            out[node] = ours(answer)
        return out

    receive_public_keys(plan, answers(Stage.SETUP, lambda n: setup_config(plan), nodes))
    receive_key_shares(plan, answers(Stage.SHARE_KEYS, lambda n: share_keys_config(plan, n), plan.setup_done))
    for node in sorted(plan.keyed):
        if silent_at.get(node) != Stage.COLLECT_MASKED_VECTORS:
            states[node], masked = hospital_stage(states[node], Stage.COLLECT_MASKED_VECTORS,
                                                  collect_config(plan, node), node, vectors[node])
            add_masked_vector(plan, node, masked)
    problem = threshold_problem(plan, plan.masked, plan.masked | plan.dropped)
    if problem:
        return plan, problem
    return plan, unmask_sum(plan, answers(Stage.UNMASK, lambda n: unmask_config(plan, n), plan.masked))


def test_the_protocol_sums_and_survives_dropouts_up_to_its_threshold():
    nodes = [7, 19, 23, 42, 101]
    rng = np.random.default_rng(0)
    vectors = {n: rng.integers(0, 2**20, 300) for n in nodes}
    settings = SecureAggregationSettings(enabled=True, reconstruction_threshold=3)
    plan, total = run_protocol(nodes, vectors, settings)
    assert (plan.num_shares, plan.threshold) == (5, 3)
    np.testing.assert_array_equal(total, sum(vectors.values()))

    # one hospital stops before its masked vector, one before the unmask stage: the sum is the 4 masked ones'
    silent = {42: Stage.COLLECT_MASKED_VECTORS, 101: Stage.UNMASK}
    plan, total = run_protocol(nodes, vectors, settings, silent)
    assert plan.dropped == {42} and plan.masked == {7, 19, 23, 101}
    np.testing.assert_array_equal(total, sum(vectors[n] for n in plan.masked))

    # one lost at setup never enters anybody's masks
    plan, total = run_protocol(nodes, vectors, settings, {7: Stage.SETUP, 19: Stage.COLLECT_MASKED_VECTORS})
    assert plan.keyed == {19, 23, 42, 101} and plan.masked == {23, 42, 101}
    np.testing.assert_array_equal(total, sum(vectors[n] for n in plan.masked))

    # three of five stop before masking: two live neighbours each, below the threshold of 3
    plan, problem = run_protocol(nodes, vectors, settings, dict.fromkeys([7, 19, 23], Stage.COLLECT_MASKED_VECTORS))
    assert "fewer live neighbours than the reconstruction threshold 3" in problem

    # SecAgg+ proper: 3 shares per hospital over 7, each hospital masks with its two ring neighbours only
    nodes = list(range(1, 8))
    vectors = {n: rng.integers(0, 2**20, 50) for n in nodes}
    plan, total = run_protocol(nodes, vectors, SecureAggregationSettings(num_shares=3, reconstruction_threshold=2),
                               {3: Stage.COLLECT_MASKED_VECTORS})
    assert plan.num_shares == 3 and all(len(n) == 3 for n in plan.neighbours.values())
    np.testing.assert_array_equal(total, sum(vectors[n] for n in plan.masked))


def test_a_masked_vector_says_nothing_of_its_vector():
    nodes = [1, 2, 3]
    rng = np.random.default_rng(1)
    vectors = {n: rng.integers(0, 2**22, 20_000) for n in nodes}
    vectors[1][:] = 0  # a hospital whose update is all zeros...
    plan = plan_round(nodes, SecureAggregationSettings(), [0, 2], 20_000)
    states = {n: SecAggPlusState() for n in nodes}
    keys = {}
    for n in nodes:
        states[n], answer = hospital_stage(states[n], Stage.SETUP, setup_config(plan), n)
        keys[n] = ours(answer)
    receive_public_keys(plan, keys)
    shares = {}
    for n in nodes:
        states[n], answer = hospital_stage(states[n], Stage.SHARE_KEYS, share_keys_config(plan, n), n)
        shares[n] = ours(answer)
    receive_key_shares(plan, shares)
    _, masked = hospital_stage(states[1], Stage.COLLECT_MASKED_VECTORS, collect_config(plan, 1), 1, vectors[1])
    _, other = hospital_stage(states[2], Stage.COLLECT_MASKED_VECTORS, collect_config(plan, 2), 2, vectors[2])
    # ...sends values spread evenly over [0, 2^32): mean 2^31, a quarter in each quarter, not correlated with others'
    assert abs(masked.mean() / 2**32 - 0.5) < 0.01
    assert np.allclose(np.histogram(masked, bins=4, range=(0, 2**32))[0] / masked.size, 0.25, atol=0.01)
    assert abs(np.corrcoef(other, vectors[2])[0, 1]) < 0.03


def test_a_hospital_refuses_what_would_unmask_it():
    plan = plan_round([1, 2, 3], SecureAggregationSettings(), [0, 1], 10)
    config = setup_config(plan)
    with pytest.raises(ValueError, match="threshold below 2"):
        hospital_stage(SecAggPlusState(), Stage.SETUP, {**config, "secagg.threshold": 1}, 1)
    with pytest.raises(ValueError, match="expect setup stage, but receive unmask"):  # Flower's stage order
        hospital_stage(SecAggPlusState(), Stage.UNMASK, unmask_config(plan, 1), 1)
    states, answers = {}, {}
    for n in (1, 2, 3):
        states[n], answer = hospital_stage(SecAggPlusState(), Stage.SETUP, config, n)
        answers[n] = ours(answer)
    receive_public_keys(plan, answers)
    shares = {}
    for n in (1, 2, 3):
        states[n], answer = hospital_stage(states[n], Stage.SHARE_KEYS, share_keys_config(plan, n), n)
        shares[n] = ours(answer)
    receive_key_shares(plan, shares)
    for n in (1, 2):
        states[n], _ = hospital_stage(states[n], Stage.COLLECT_MASKED_VECTORS, collect_config(plan, n), n,
                                      np.zeros(10))
    both = {"secagg.active_nids": [1, 2, 3], "secagg.dead_nids": [2]}  # its mask seed and its key: its update
    with pytest.raises(ValueError, match="both alive and dropped"):
        hospital_stage(states[1], Stage.UNMASK, both, 1)
    with pytest.raises(ValueError, match="expect setup stage"):  # and it is not asked twice
        hospital_stage(states[1], Stage.UNMASK, {"secagg.active_nids": [1, 2], "secagg.dead_nids": [3]}, 1)
    done, answer = hospital_stage(states[2], Stage.UNMASK, {"secagg.active_nids": [1, 2], "secagg.dead_nids": [3]}, 2)
    assert sorted(answer["nids"]) == [1, 2, 3] and done.sk1 == b"" and done.rd_seed == b""  # nothing kept


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
    plan = fedproin_plan(method, hospitals, settings, 0.0)
    vectors = {}
    for i, hospital in enumerate(hospitals):
        received = Payload(arrays={"model": glob})
        reply = Payload(arrays={"model": trained[i]}, metrics={"num-examples": hospital.num_examples,
                                                                "influence": influences[i].ravel().tolist()})
        values, _ = fedproin_contribution(received, reply, plan.hospital_config[hospital.name], plan.layout)
        vectors[i + 1] = encode(plan.layout, values, settings.clipping_range, settings.quantization_range)
    protocol, total = run_protocol([1, 2, 3], vectors, settings)
    sums = decode_sum(plan.layout, total, 3, settings.clipping_range, settings.quantization_range)
    said = [HospitalUpdate(h, Payload(metrics={"num-examples": h.num_examples})) for h in hospitals]
    record = fedproin_apply(method, 1, sums, plan, said)

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
def secure_node(run_config, node_config, node_id, silent_at=None, tamper=None):
    """A hospital answering with fedmed's ClientApp handlers (``Hospital.answer`` runs the stages: ``secure_train``);
    ``silent_at``: the stage from which it stops answering (as when its SuperNode dies); ``tamper``: changes each
    message it receives first (a hostile hospital ignoring what the server set)."""
    from client_app import app as client

    context = Context(run_id=1, node_id=node_id, node_config=dict(node_config), state=RecordDict(),
                      run_config=dict(run_config))
    gone = [False]

    def answer(message: Message) -> Message | None:
        stage = stage_of(message)
        if gone[0] or (silent_at is not None and stage == silent_at):
            gone[0] = True
            return None
        kind = message.metadata.message_type
        if tamper is not None:
            tamper(message)
        handlers = {MessageType.TRAIN: client.train, MessageType.QUERY: client.query,
                    MessageType.EVALUATE: client.evaluate}
        return handlers[kind](message, context)

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
    return [m for m in grid.replies if not m.has_error() and stage_of_reply(m) == Stage.COLLECT_MASKED_VECTORS]


def stage_of_reply(message: Message) -> str | None:
    for record in message.content.config_records.values():
        if "secagg.stage" in record:
            return record["secagg.stage"]
    return None


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
    assert set(secure["stages"]) == {"setup", "share_keys", "collect_masked_vectors", "unmask"}
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
    grid = FakeGrid(secure_hospitals(config, 4, silent={3: Stage.COLLECT_MASKED_VECTORS}))
    final = arrays_of(strategy.start(grid, num_rounds=1).arrays)
    record = strategy.engine.history[0]
    assert record["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"] and "skipped" not in record
    assert record["missing"] == ["hospital-03"]
    assert record["secure-aggregation"]["lost"]["hospital-03"].startswith("collect_masked_vectors: no reply")
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, atol=3 * STEP + 1e-6, err_msg=name)
    # the unmask stage asked the live ones for hospital-03's key shares
    unmask = [m for m in grid.sent_of_type(MessageType.TRAIN) if stage_of(m) == Stage.UNMASK]
    assert len(unmask) == 3 and all(m.content["config"]["secagg.dead_nids"] == [104] for m in unmask)


def test_below_the_threshold_the_round_is_skipped_with_its_reason(tmp_path, caplog):
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "below")
    strategy = with_secure_aggregation(FedAvgStrategy)(
        min_train_nodes=2, run_config=config, secure_aggregation={"reconstruction-threshold": 3})
    before = arrays_of(strategy.initial_arrays())
    grid = FakeGrid(secure_hospitals(config, 3, silent={2: Stage.COLLECT_MASKED_VECTORS}))
    strategy.start(grid, num_rounds=1)
    record = strategy.engine.history[0]
    assert "fewer than 3" in record["skipped"] and "unchanged" in record["skipped"]
    assert "fewer than 3" in caplog.text
    for name, value in arrays_of(strategy.initial_arrays()).items():
        np.testing.assert_array_equal(value, before[name])
    assert not [m for m in grid.sent_of_type(MessageType.TRAIN) if stage_of(m) == Stage.UNMASK]


@pytest.mark.parametrize("key,value,why", [("secagg.weight-bound", 1.0, "weights sum to"),
                                           ("secagg.norm-bound", 0.0, "exceeds the norm bound")])
def test_a_sum_no_honest_hospitals_could_have_sent_is_refused(tmp_path, key, value, why):
    """Masking hides who broke their bounds, not that someone did: a hospital that weighs itself above its cap, or
    skips the norm bound, gives a sum the server refuses (FedAvg family)."""
    def hostile(message: Message) -> None:
        if stage_of(message) == Stage.COLLECT_MASKED_VECTORS:
            message.content["config"][key] = value

    config = config_of(tmp_path, SMALL_CLASSIFICATION, "hostile")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config,
                                                       secure_aggregation={"update-norm-bound": 1e-3})
    nodes = secure_hospitals(config, 3)
    nodes[103] = secure_node(config, {"partition-id": 2, "num-partitions": 3}, 103, tamper=hostile)
    before = arrays_of(strategy.initial_arrays())
    strategy.start(FakeGrid(nodes), num_rounds=1)
    record = strategy.engine.history[0]
    assert why in record["skipped"] and "outside its bounds" in record["skipped"]
    for name, value_ in arrays_of(strategy.initial_arrays()).items():
        np.testing.assert_array_equal(value_, before[name])


def test_a_hospital_lost_at_the_unmask_stage_stays_in_the_sum(tmp_path):
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "late")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    grid = FakeGrid(secure_hospitals(config, 3, silent={0: Stage.UNMASK}))
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
    """``common.config`` imports the settings, and the methods' halves import it on GPU machines without Flower."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['flwr'] = None\n"
            "from common.secure_aggregation import SecureAggregationSettings, Layout, Entry, SECURE_METHODS\n"
            "print(SecureAggregationSettings(enabled=True).reconstruction_threshold, sorted(SECURE_METHODS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("0.5 ['fedavg', 'fedbn', 'fedmepd'")


def test_modulus_bits_name_the_wire_width():
    assert modulus_bits(2**32) == 32 and modulus_bits(2**12) == 12
    with pytest.raises(ValueError):
        modulus_bits(12)


# --- the cost table of docs/secure-aggregation.md ------------------------------------------------------------------
def measure(root, rounds: int = 3) -> str:
    """Seconds per round and bytes per hospital, plain against secure, on FakeGrid (in-process hospitals): the
    means over rounds 2..``rounds``."""
    from benchmarks.machine import cpu_name

    rows = []
    for label, strategy_type, base, count, extra in (
            ("FedAvg small-cnn", FedAvgStrategy, SMALL_CLASSIFICATION, 5, {}),
            ("FedProIn small-cnn", FedProInStrategy, SMALL_CLASSIFICATION, 5, {}),
            ("QFedPolyp U-Net, 8 bits", QFedPolypStrategy, SMALL_POLYP, 5, {"qfedpolyp.bit-widths": "8"})):
        measured = {}
        for kind in ("plain", "secure"):
            config = config_of(root, base, f"{label}-{kind}".replace(" ", "-").replace(",", ""), **extra)
            config["min-partition-size"] = 2
            if kind == "plain":
                strategy, grid = strategy_type(min_train_nodes=2, run_config=config), \
                    FakeGrid(plain_hospitals(config, count))
            else:
                strategy = with_secure_aggregation(strategy_type)(min_train_nodes=2, run_config=config)
                grid = FakeGrid(secure_hospitals(config, count))
            strategy.start(grid, num_rounds=rounds)
            later = strategy.engine.history[1:]
            reply = (masked_replies(grid) if kind == "secure" else
                     [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN])[-1]
            mean = lambda values: float(np.mean(list(values)))  # noqa: E731
            row = {"seconds": mean(r["seconds"] for r in later), "reply": message_nbytes(reply),
                   "up": mean(r["bytes_up"] / count for r in later),
                   "down": mean(r["bytes_down"] / count for r in later)}
            if kind == "secure":
                stages = [r["secure-aggregation"]["stages"] for r in later]
                row["keys"] = " / ".join(f"{mean(s[stage]['seconds'] for s in stages):.2f}"
                                         for stage in ("setup", "share_keys", "unmask"))
                row["sum"] = mean(s["unmask"]["sum-seconds"] for s in stages)
                row["mask"] = mean(max(m["secagg-seconds"] for m in r["hospital_metrics"].values()) for r in later)
            measured[kind] = row
        plain, secure = measured["plain"], measured["secure"]
        rows.append(f"| {label} | {count} | {plain['seconds']:.2f} | {secure['seconds']:.2f} | {secure['keys']} | "
                    f"{secure['mask']:.3f} | {secure['sum']:.3f} | {plain['reply']:,} | {secure['reply']:,} | "
                    f"{plain['up']:,.0f} | {secure['up']:,.0f} | {plain['down']:,.0f} | {secure['down']:,.0f} |")
    header = (f"FakeGrid, hospitals in the server's process, {cpu_name()}, means of rounds 2-{rounds}.\n\n"
              "| case | hospitals | s/round plain | s/round secure | key stages s (setup / share / unmask) | "
              "masking s (slowest hospital) | unmask + sums s (server) | training reply B plain | masked reply B | "
              "up B/hospital plain | up B/hospital secure | down B/hospital plain | down B/hospital secure |\n"
              "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    return "\n".join([header, *rows])


def measure_protocol(values: int = 11_200_000, count: int = 5) -> str:
    """The protocol alone at a ResNet-18's size (11.2 M float values), no training: one hospital's quantisation and
    masking, and the server's sum and unmasking, in seconds; the masked vector's bytes."""
    settings = SecureAggregationSettings(enabled=True)
    layout = Layout((Entry("weight", ()), Entry("model/all", (values,))))
    rng = np.random.default_rng(0)
    update = rng.normal(0, 1e-3, values)
    started = time.perf_counter()
    vector = encode(layout, {"weight": np.asarray(0.2), "model/all": 0.2 * update}, 8.0, 2**22)
    quantised = time.perf_counter() - started
    vectors = dict.fromkeys(range(1, count + 1), vector)
    plan = plan_round(list(vectors), settings, [0, 1], vector.size)
    states = {n: SecAggPlusState() for n in vectors}
    answers = {}
    for n in vectors:
        states[n], answer = hospital_stage(states[n], Stage.SETUP, setup_config(plan), n)
        answers[n] = ours(answer)
    receive_public_keys(plan, answers)
    answers = {}
    for n in vectors:
        states[n], answer = hospital_stage(states[n], Stage.SHARE_KEYS, share_keys_config(plan, n), n)
        answers[n] = ours(answer)
    receive_key_shares(plan, answers)
    masking = []
    for n in vectors:
        started = time.perf_counter()
        states[n], masked = hospital_stage(states[n], Stage.COLLECT_MASKED_VECTORS, collect_config(plan, n), n, vector)
        packed = pack_values(masked, 32)
        masking.append(time.perf_counter() - started)
        started = time.perf_counter()
        add_masked_vector(plan, n, unpack_values(packed, 32, vector.size))
        masking[-1] = (masking[-1], time.perf_counter() - started)
    answers = {}
    for n in vectors:
        states[n], answer = hospital_stage(states[n], Stage.UNMASK, unmask_config(plan, n), n)
        answers[n] = ours(answer)
    started = time.perf_counter()
    total = unmask_sum(plan, answers)
    sums = decode_sum(layout, total, count, 8.0, 2**22)
    unmasking = time.perf_counter() - started
    error = float(np.abs(sums["model/all"] - count * 0.2 * update).max())
    mask, add = np.mean([m for m, _ in masking]), np.mean([a for _, a in masking])
    return (f"Protocol alone, {values / 1e6:.1f} M float values (a ResNet-18), {count} hospitals: a hospital "
            f"quantises in {quantised:.2f} s and masks and packs in {mask:.2f} s; the server unpacks and adds one "
            f"vector in {add:.2f} s and unmasks and decodes the sum in {unmasking:.2f} s; a masked vector is "
            f"{packed.size:,} B (float32: {4 * values:,} B); the sum's largest error is {error:.2g}.")


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    print(measure_protocol())
    with tempfile.TemporaryDirectory() as folder:
        print(measure(Path(folder)))


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
