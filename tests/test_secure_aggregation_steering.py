"""A secure sum no coordinator can steer (issue 56): nothing the server sends one hospital alone changes what that
hospital adds to a sum, one model is revealed once across interleaved runs, invented or padded survivors are
refused where the documented deployment holds the consortium's keys, and a deleted replay memory stops secure
rounds until it is rebuilt from the audit log. Each attack runs as a lying server would run it over FakeGrid, with
fedmed's ClientApp at the hospitals, on FedAvg and FedBN (both weigh hospitals by their samples)."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, MessageType

from cli.audit import main as audit_main
from client_app.secure_aggregation import stage_of
from common.trust.secure_aggregation import SecureAggregationSettings
from common.trust.secure_aggregation.hospital import HospitalRules, SecureAggregationRefusal
from common.trust.secure_aggregation.inprocess import InProcess
from common.trust.secure_aggregation.messages import (
    COLLECT,
    CONSISTENCY,
    NAMES_KEY,
    NORM_BOUND_KEY,
    OWN_NAME_KEY,
    PLAN_KEY,
    SESSION_KEY,
    SIGNATURES_KEY,
    SURVIVORS_KEY,
    UNMASK,
)
from common.trust.secure_aggregation.server import add_masked_vector
from strategies import FedAvgStrategy, FedBNStrategy
from strategies.secure_aggregation import with_secure_aggregation

from .fake_grid import FakeGrid
from .test_hostile_hospital import key_pair
from .test_secure_aggregation import SMALL_CLASSIFICATION, STEP, config_of, secure_node

pytestmark = pytest.mark.usefixtures("one_thread")

WEIGHING = {"fedavg": FedAvgStrategy, "fedbn": FedBNStrategy}
TARGET = "hospital-03"


def correlation(a, b) -> float:
    return float(np.corrcoef(np.asarray(a, np.float64), np.asarray(b, np.float64))[0, 1])


def consortium(tmp_path: Path, count: int, signed: bool, run: str, **extra) -> tuple[dict, dict]:
    """A run config and ``count`` hospitals' node configs: with ``signed``, as the documented deployment sets them
    (each its identity key and the folder of the consortium's registered keys, the server hospital-keys)."""
    registered = tmp_path / "registered"
    registered.mkdir(exist_ok=True)
    config = config_of(tmp_path, SMALL_CLASSIFICATION, run, **extra)
    nodes = {}
    for pid in range(count):
        node = {"partition-id": pid, "num-partitions": count}
        if signed:
            key = registered / f"hospital-{pid:02d}"
            node.update({"identity-key": str(key if key.exists() else key_pair(registered, key.name)),
                         "peer-keys": str(registered)})
        nodes[101 + pid] = node
    if signed:
        config["hospital-keys"] = str(registered)
    return config, nodes


@pytest.fixture
def contributions(monkeypatch):
    """What each hospital adds to the sum (its method's contribution, by hospital), as the hospitals compute it."""
    seen: dict[str, dict[str, np.ndarray]] = {}
    for method in WEIGHING:
        module = importlib.import_module(f"strategies.{method}.secure")
        honest = module.SECURE.contribution

        def recording(received, reply, params, layout, honest=honest):
            values, metrics = honest(received, reply, params, layout)
            seen[params[OWN_NAME_KEY]] = {k: np.asarray(v, np.float64) for k, v in values.items()}
            return values, metrics

        monkeypatch.setattr(module.SECURE, "contribution", recording)
    return seen


def lying_server(strategy, tamper) -> list[dict]:
    """``strategy`` as a lying server runs it: ``tamper(hospital, config)`` changes each collect message before it
    leaves; the sums the server unmasks are recorded (before any check the honest server makes of them)."""
    secure = strategy.secure_aggregation
    prepare, sums_seen = secure.prepare, []

    def tampering(server_round, messages, grid, *sent):
        prepared = prepare(server_round, messages, grid, *sent)
        for message in prepared:
            tamper(strategy.hospitals[message.metadata.dst_node_id].name,
                   message.content.config_records[strategy.records.config])
        return prepared

    def seeing(method, rnd, sums, plan, updates, apply=secure.method.apply):
        sums_seen.append({k: np.asarray(v, np.float64) for k, v in sums.items()})
        return apply(method, rnd, sums, plan, updates)

    secure.prepare = tampering
    secure.method = copy.copy(secure.method)  # its own: the methods' instances are shared
    secure.method.apply = seeing
    return sums_seen


def model_part(values: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([values[k].ravel() for k in sorted(values) if k.startswith("model/")])


@pytest.mark.parametrize("method", list(WEIGHING))
@pytest.mark.parametrize("signed", [False, True], ids=["simulation", "documented-deployment"])
def test_weights_and_norm_bounds_sent_to_some_hospitals_change_nothing(tmp_path, contributions, method, signed):
    """The issue's attack: weight 0 (or a norm bound of 1e-9) to every hospital but T. Hospitals weigh themselves
    and read the norm bound from the round plan only, so the sum is every hospital's, as an honest server's."""
    config, nodes = consortium(tmp_path, 4, signed, "weights")
    strategy = with_secure_aggregation(WEIGHING[method])(min_train_nodes=2, run_config=config,
                                                         secure_aggregation={"update-norm-bound": 5.0})

    def zero_all_but_t(hospital, record):
        if hospital != TARGET:
            record["secagg.weight-share"], record["secagg.norm-bound"], record["secagg.weight-count"] = 0.0, 1e-9, 1.0

    seen = lying_server(strategy, zero_all_but_t)
    strategy.start(FakeGrid({n: secure_node(config, node, n) for n, node in nodes.items()}), num_rounds=1)
    record = strategy.engine.history[0]
    assert "skipped" not in record and len(record["aggregated"]) == 4
    total, parts = model_part(seen[0]), {h: model_part(v) for h, v in contributions.items()}
    np.testing.assert_allclose(total, sum(parts.values()), atol=4 * 3 * STEP)  # the sum of all four, as sent
    others = [correlation(total, part) for h, part in parts.items() if h != TARGET]
    assert correlation(total, parts[TARGET]) <= max(others) + 0.05, (correlation(total, parts[TARGET]), others)
    weights = {h: float(v["weight"]) for h, v in contributions.items()}
    assert all(w > 0.3 for w in weights.values()), weights  # each its own samples, not the server's word


@pytest.mark.parametrize("method", list(WEIGHING))
@pytest.mark.parametrize("signed", [False, True], ids=["simulation", "documented-deployment"])
def test_a_plan_told_to_some_hospitals_only_reveals_nothing(tmp_path, contributions, method, signed):
    """The same attack in the one place the server could still put it: the round plan, told with a norm bound of
    1e-9 to every hospital but T. The plan's SHA-256 binds the pairwise masks, so the masks of hospitals told
    different plans do not cancel and the unmasked "sum" is noise; with the consortium's keys nobody even unmasks
    (each survivor must have signed the same plan)."""
    config, nodes = consortium(tmp_path, 4, signed, "plans")
    strategy = with_secure_aggregation(WEIGHING[method])(min_train_nodes=2, run_config=config,
                                                         secure_aggregation={"update-norm-bound": 5.0})

    def another_plan(hospital, record):
        if hospital != TARGET:
            plan = json.loads(record[PLAN_KEY])
            plan[NORM_BOUND_KEY] = 1e-9
            record[PLAN_KEY] = json.dumps(plan, sort_keys=True, separators=(",", ":"))

    seen = lying_server(strategy, another_plan)
    grid = FakeGrid({n: secure_node(config, node, n) for n, node in nodes.items()})
    before = {k: v.copy() for k, v in strategy.engine.method.global_arrays.items()}
    strategy.start(grid, num_rounds=1)
    record = strategy.engine.history[0]
    for name, value in strategy.engine.method.global_arrays.items():
        np.testing.assert_array_equal(value, before[name])  # nothing of it reached the model
    assert "skipped" in record
    target = model_part(contributions[TARGET])
    if signed:
        assert seen == []  # nothing was unmasked
        refusals = [m.error.reason for m in grid.replies if m.has_error()]
        assert len(refusals) == 4 and all("survivors signed the survivor set and the round plan" in r
                                          for r in refusals)
        assert not [m for m in grid.replies if not m.has_error() and stage_of(m) == UNMASK]
    else:
        assert len(seen) == 1 and abs(correlation(model_part(seen[0]), target)) < 0.05  # noise, not T's update
        assert "outside its bounds" in record["skipped"]


def test_interleaved_runs_cannot_both_reveal_one_model(tmp_path):
    """Run A waits before its consistency stage while run B (without hospital H) is taken to completion; then A
    goes on. Every hospital of B revealed shares for a sum trained from that model, so at A's unmask stage they
    refuse: the difference of two sums never exists. The memory is checked at unmask, not only at collect."""
    shared = {"state-dir": str(tmp_path / "hospitals")}
    config_a, nodes = consortium(tmp_path, 4, False, "run-a", **shared)
    config_b = {**config_a, "run-name": "run-b", "results-dir": str(tmp_path / "run-b")}
    run_a = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config_a)
    grid_a = FakeGrid({n: secure_node(config_a, node, n) for n, node in nodes.items()})
    run_a.discover(grid_a)
    collect = run_a.configure_train(1, run_a.initial_arrays(), ConfigRecord(), grid_a)
    assert len(collect) == 4 and all(stage_of(m) == COLLECT for m in collect)
    replies = list(grid_a.send_and_receive(collect))
    assert all(not r.has_error() for r in replies)  # A's masked vectors are in; it waits

    run_b = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config_b)
    without_h = {n: secure_node(config_b, node, n) for n, node in nodes.items() if n != 104}
    run_b.start(FakeGrid(without_h), num_rounds=1)
    assert "skipped" not in run_b.engine.history[0] and len(run_b.engine.history[0]["aggregated"]) == 3

    run_a.aggregate_train(1, replies)
    record = run_a.engine.history[-1]
    assert "skipped" in record
    lost = record["secure-aggregation"]["lost"]
    refused = [name for name, why in lost.items() if "already helped unmask a sum trained from this model" in why]
    assert sorted(refused) == ["hospital-00", "hospital-01", "hospital-02"], lost


def signed_rules(tmp_path, nodes) -> dict[int, HospitalRules]:
    registered = tmp_path / "registered"
    registered.mkdir(exist_ok=True)
    return {n: HospitalRules(f"node-{n}", str(key_pair(registered, f"node-{n}")), str(registered)) for n in nodes}


def test_a_survivor_set_padded_with_invented_nodes_is_refused_with_the_consortiums_keys(tmp_path):
    """Two real hospitals whose policy wants four per sum, two node ids the server made up: the survivor set has
    four members, but two never signed it with a registered key, so neither real hospital unmasks."""
    protocol = InProcess([1, 2], SecureAggregationSettings(), 100, signed_rules(tmp_path, [1, 2]))
    protocol.keys()  # a round of two (what the server's setup stage would pad, hospitals count at consistency)
    for node in (1, 2):
        add_masked_vector(protocol.plan, node, protocol.mask(node, np.zeros(100, np.int64)))
        protocol.rules[node].min_hospitals_per_sum = 4
    padded = [1, 2, 98, 99]
    signatures = {node: protocol.ask(node, CONSISTENCY, {SURVIVORS_KEY: padded, SESSION_KEY: protocol.plan.session})
                  for node in (1, 2)}
    request = {"secagg.active_nids": [1, 2], "secagg.dead_nids": [], SURVIVORS_KEY: padded,
               SESSION_KEY: protocol.plan.session, NAMES_KEY: [f"node-{n}" for n in padded],
               SIGNATURES_KEY: [signatures[n]["secagg.signature"] if n in signatures else b"" for n in padded]}
    for node in (1, 2):
        with pytest.raises(SecureAggregationRefusal, match=r"2 of the 4 survivors signed .* nodes \[98, 99\]"):
            protocol.ask(node, UNMASK, request)


def test_sybils_are_refused_by_a_hospital_of_the_documented_deployment(tmp_path):
    """The server surrounds T with hospitals of its own (keys nobody registered): T, configured as the deployment
    scripts configure it, refuses at the share-keys stage; its update never leaves masked or not."""
    config, nodes = consortium(tmp_path, 4, True, "sybils")
    own = tmp_path / "server-keys"
    own.mkdir()
    for node_id, node in nodes.items():
        if node_id != 104:  # the server's own "hospitals", under the real hospitals' names
            node["identity-key"] = str(key_pair(own, Path(node["identity-key"]).name))
            node["peer-keys"] = str(own)
    del config["hospital-keys"]  # the lying server does not check the names itself
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    grid = FakeGrid({n: secure_node(config, node, n) for n, node in nodes.items()})
    strategy.start(grid, num_rounds=1)
    assert strategy.nothing_aggregated  # a Result, and why (strategies/outcome.py)
    lost = strategy.engine.history[0]["secure-aggregation"]["lost"]
    assert "not signed by its registered key" in lost[TARGET]
    assert not [m for m in grid.sent_of_type(MessageType.TRAIN) if stage_of(m) == COLLECT
                and m.metadata.dst_node_id == 104]  # T trained nothing


def test_a_deployed_hospital_requiring_secure_aggregation_needs_the_consortiums_keys(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("require-secure-aggregation = true\n")
    config, nodes = consortium(tmp_path, 3, False, "unsigned")
    nodes[101] = {"hospital": "hospital-00", "policy-file": str(policy), "state-dir": str(tmp_path / "h0"),
                  "partition-id": 0, "num-partitions": 3}
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    strategy.start(FakeGrid({n: secure_node(config, node, n) for n, node in nodes.items()}), num_rounds=1)
    lost = strategy.engine.history[0]["secure-aggregation"]["lost"]
    assert "require-secure-aggregation in a deployment needs the consortium's keys pinned" in lost["hospital-00"]


def test_the_replay_memory_is_appended_to_and_a_line_cut_short_stops_it(tmp_path):
    """One line an entry, appended (never rewritten), each first a line of the audit log; a write cut short (a
    crash mid-line) is never read as an empty memory: the hospital refuses until the memory is rebuilt."""
    from common.trust.audit import AuditLog
    from common.trust.secure_aggregation.hospital import ReplayMemory, rebuild_memory

    audit = AuditLog(tmp_path / "audit.jsonl")
    memory = ReplayMemory(tmp_path, audit)
    memory.claim_round("r", 1, "s1")
    memory.revealed("a" * 64, "r", 1)
    memory.claim_round("r", 2, "s2")
    file = tmp_path / "secure-aggregation.jsonl"
    first = file.read_bytes()
    assert [json.loads(line)["memory"] for line in first.splitlines()] == ["rounds", "revealed", "rounds"]
    with pytest.raises(SecureAggregationRefusal, match="already took part .* run 'r' round 2"):
        memory.claim_round("r", 2, "s3")
    file.write_bytes(first + b'{"memory":"revealed","mo')  # cut short
    with pytest.raises(SecureAggregationRefusal, match="cannot be read .*last line is cut short.*rebuild-secagg"):
        ReplayMemory(tmp_path, audit).check_model("b" * 64)
    assert rebuild_memory(audit.path, tmp_path) == {"rounds": 2, "revealed": 1}
    from common.trust.secure_aggregation.messages import parse_memory

    assert parse_memory(file.read_bytes()) == parse_memory(first)  # grouped by kind, the same entries
    with pytest.raises(SecureAggregationRefusal, match="already helped unmask a sum trained from this model"):
        ReplayMemory(tmp_path, audit).check_model("a" * 64)


@pytest.mark.parametrize("damage", ["deleted", "rolled back", "edited"])
def test_a_damaged_replay_memory_stops_secure_rounds_until_rebuilt_from_the_log(tmp_path, damage, capsys):
    shared = {"state-dir": str(tmp_path / "hospitals")}
    config, nodes = consortium(tmp_path, 3, False, "first", **shared)
    first = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    first.start(FakeGrid({n: secure_node(config, node, n) for n, node in nodes.items()}), num_rounds=1)
    assert "skipped" not in first.engine.history[0]
    folder = tmp_path / "hospitals" / "hospital-00"
    memory = folder / "secure-aggregation.jsonl"
    kept = [json.loads(line) for line in memory.read_text().splitlines()]
    if damage == "deleted":
        memory.unlink()
    elif damage == "rolled back":
        memory.write_text("".join(json.dumps(e) + "\n" for e in kept if e["memory"] == "rounds"))
    else:
        edited = [{**e, "model": "0" * 64} if e["memory"] == "revealed" else e for e in kept]
        memory.write_text("".join(json.dumps(e) + "\n" for e in edited))

    other = {**config, "run-name": "another-model", "results-dir": str(tmp_path / "second"), "seed": 7}
    again = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=other)
    again.start(FakeGrid({n: secure_node(other, node, n) for n, node in nodes.items()}), num_rounds=1)
    record = again.engine.history[0]
    why = record["secure-aggregation"]["lost"]["hospital-00"]
    assert "memory of past rounds" in why and "fedmed audit rebuild-secagg-memory" in why
    assert ("deleted or rolled back" if damage != "edited" else "it was edited") in why
    assert record["aggregated"] == ["hospital-01", "hospital-02"]  # the others go on

    assert audit_main(["audit", "rebuild-secagg-memory", str(folder / "audit.jsonl"), str(folder)]) == 0
    assert "1 round(s), 1 model(s) revealed" in capsys.readouterr().out  # the refused round claimed nothing
    third = {**config, "run-name": "third-look", "results-dir": str(tmp_path / "third")}
    last = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=third)
    last.start(FakeGrid({n: secure_node(third, node, n) for n, node in nodes.items()}), num_rounds=1)
    assert "already helped unmask a sum trained from this model" in last.nothing_aggregated
    assert "hospital-00" in last.engine.history[0]["refused"]  # the rebuilt memory remembers round 1's model


def test_the_last_line_of_the_servers_audit_log_is_the_last_head_every_hospital_records(tmp_path):
    """Issue 64: the closing query carries the head of the server's final line (``run-ended``), and nothing is
    written after it, so no line of the server's log lies beyond what the hospitals anchored."""
    from common.trust.audit import records_of

    config, nodes = consortium(tmp_path, 4, True, "anchored")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    strategy.start(FakeGrid({n: secure_node(config, node, n) for n, node in nodes.items()}), num_rounds=1)
    server = [record for _, record in records_of(strategy.audit_log().path)]
    assert server[-1]["event"] == "run-ended" and len(server[-1]["hospitals"]) == 4
    logs = [path for path in tmp_path.rglob("audit.jsonl") if path != Path(strategy.audit_log().path)]
    assert len(logs) == 4
    for path in logs:
        heads = [r["peer-audit-head"] for _, r in records_of(path) if r.get("peer") == "server"
                 and r.get("peer-audit-head")]
        assert heads[-1] == server[-1]["hash"], path  # the server's final line, anchored at every hospital
