"""The parts HospitalStrategy is built from, each on its own: how it finds Flower's wrappers (by what holds it, with
no wrapper's method on the call stack), the round workflow it chooses once (plain rounds or secure aggregation), and,
each built alone from the state it needs (no strategy, no Flower grid but tests/fake_grid.py's), the audit trail, the
reply intake, cross-site evaluation and the run folder. Discovery and identity: tests/test_hostile_hospital.py,
tests/test_flower_clientapp.py; the audit log itself and both ends' lines: tests/test_audit.py; the reply store on
disk: tests/test_reply_store.py, tests/test_streamed_rounds.py; the round record: tests/test_round_record.py; the round
loop and declined rounds: tests/test_flower_semantics.py; cross-site scores end to end: tests/test_evaluation.py."""

from __future__ import annotations

import fcntl
import gc
import os

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
)

from common.config import ConfigError
from common.engine.round_engine import RoundEngine
from common.engine.wire import MalformedPayload, RecordKeys, to_recorddict
from common.methods.base import TRAINS_ITSELF, HospitalInfo
from common.payload import Payload
from common.trust.audit import AUDIT_HEAD_MARK, RUN_ENDED_QUERY, message_digest, records_of, verify
from strategies import FedAvgStrategy, FedProInStrategy
from strategies.audit_trail import AuditTrail
from strategies.cross_site import CrossSiteEvaluation, models_of
from strategies.replies import PULL_BYTES, ReplyIntake, ReplyLimits, pull_at_once
from strategies.round_workflow import PlainRounds
from strategies.run_folder import RunFolder
from strategies.secure_aggregation import SecureAggregation, SecureRoundEngine, with_secure_aggregation
from strategies.wrappers import wrappers_of
from tests.fake_grid import FakeGrid


def test_wrappers_are_found_by_what_holds_the_strategy_from_outside_any_call():
    strategy = FedAvgStrategy()
    assert strategy.wrappers() == []
    inner = DifferentialPrivacyServerSideFixedClipping(strategy, 1.0, 0.5, 2)
    outer = DifferentialPrivacyClientSideFixedClipping(inner, 1.0, 0.5, 2)
    vars(outer)  # an instance dict made real: still found through it
    assert wrappers_of(strategy) == [inner, outer]  # no wrapper's method is running: none is on the call stack
    del outer
    gc.collect()
    assert strategy.wrappers() == [inner]
    inner.strategy = FedAvgStrategy()  # it wraps another now
    assert strategy.wrappers() == []


def test_the_round_workflow_is_chosen_once_when_the_strategy_is_built(tmp_path):
    small = {"model": "small-cnn", "image-size": 16, "synthetic-samples": 60, "results-dir": str(tmp_path)}
    plain = FedAvgStrategy(run_config=small)
    assert type(plain.workflow) is PlainRounds and plain.secure_aggregation is None
    assert type(plain.engine) is RoundEngine
    for secure in (FedAvgStrategy(run_config={**small, "secure-aggregation.enabled": True}),
                   with_secure_aggregation(FedProInStrategy)(run_config=small)):
        assert isinstance(secure.workflow, SecureAggregation) and secure.secure_aggregation is secure.workflow
        assert isinstance(secure.engine, SecureRoundEngine) and secure.engine.secure is secure.workflow
    # the questions the strategy asks its workflow: both answer every one, with different answers
    asked = [name for name in vars(PlainRounds) if not name.startswith("_")]
    assert all(hasattr(SecureAggregation, name) for name in asked)
    assert (PlainRounds.masks_own_training, PlainRounds.stores_replies) == (False, True)
    assert (SecureAggregation.masks_own_training, SecureAggregation.stores_replies) == (True, False)
    assert plain.workflow.central_dp_problem() is None and "masked sums" in secure.workflow.central_dp_problem()
    assert plain.workflow.unsigned_problem("x") is None and "HospitalClientApp" in secure.workflow.unsigned_problem("x")


# --- the audit trail (strategies/audit_trail.py) ----------------------------------------------------------------------
def test_the_audit_trail_writes_one_chained_line_per_message_with_the_hospitals_head(tmp_path):
    trail = AuditTrail(tmp_path / "server.jsonl", tmp_path, "run-a", "fedavg")
    FakeGrid({})  # a ServerApp's task identity, which Flower's replies carry
    sent = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=7, message_type=MessageType.TRAIN)
    reply = Message(RecordDict({"config": ConfigRecord({"audit-head": "ab" * 32})}), reply_to=sent)
    refusal = Message(Error(0, f"policy refused the job {AUDIT_HEAD_MARK}{'cd' * 32}]"), reply_to=sent)
    trail.message("sent", sent, 3, "north", 7)
    trail.messages([("received", reply, 3, "north"), ("received", refusal, 3, "north")])
    trail.nothing_aggregated("no reply was accepted")
    assert verify(trail.path).ok
    lines = [record for _, record in records_of(trail.path)]
    assert [(r["direction"], r["peer"], r["round"], r["run"], r["method"]) for r in lines[:3]] == [
        ("sent", "north", 3, "run-a", "fedavg"), *[("received", "north", 3, "run-a", "fedavg")] * 2]
    assert lines[0]["peer-node"] == 7 and lines[0]["sha256"] == message_digest(sent)["sha256"]
    assert [r.get("peer-audit-head") for r in lines[:3]] == [None, "ab" * 32, "cd" * 32]
    assert lines[3]["outcome"] == "nothing aggregated" and lines[3]["reason"] == "no reply was accepted"


def test_the_audit_trail_lives_in_the_run_folder_unless_named_or_none(tmp_path):
    job = FedAvgStrategy(run_config={"results-dir": str(tmp_path), "run-name": "r1"}).job
    assert AuditTrail.of(job).path == tmp_path / "r1" / "audit.jsonl"
    named = job.model_copy(update={"audit_log": str(tmp_path / "own.jsonl")})
    assert AuditTrail.of(named).path == tmp_path / "own.jsonl"
    off = AuditTrail("None", tmp_path, "r1", "fedavg")
    assert off.log() is None
    off.message("sent", Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN), 1)
    off.nothing_aggregated("x")
    assert not list(tmp_path.rglob("*.jsonl"))  # nothing written anywhere


def test_the_strategy_rebuilds_its_audit_trail_when_its_run_moves_to_a_new_name(tmp_path):
    strategy = FedAvgStrategy(run_config={"results-dir": str(tmp_path), "run-name": "r1"})
    assert strategy.audit_log().path == tmp_path / "r1" / "audit.jsonl"
    strategy.change_job(run_name="r2")
    assert strategy.audit.run == "r2" and strategy.audit_log().path == tmp_path / "r2" / "audit.jsonl"


def test_the_audit_trail_tells_each_hospital_the_end_twice_and_writes_its_final_line_between(tmp_path):
    trail = AuditTrail(tmp_path / "server.jsonl", tmp_path, "run-a", "fedavg")
    heads: dict[int, list] = {5: [], 6: []}

    def hospital(node):
        def answer(message):
            config = message.content.config_records["config"]
            assert config["query"] == RUN_ENDED_QUERY
            heads[node].append(config["head"])
            return Message(RecordDict({"config": ConfigRecord({"audit-head": f"{node}" * 64})}), reply_to=message)
        return answer

    grid = FakeGrid({5: hospital(5), 6: hospital(6), 9: hospital(9)})
    trail.announce_end(grid, {5: "north", 6: "south"}, 4, lambda: {"head": trail.log().head()}, "config", 5.0, 0)
    lines = [record for _, record in records_of(trail.path)]
    assert [(r.get("direction"), r.get("peer")) for r in lines[:2]] == [("sent", "north"), ("sent", "south")]
    received = {r["peer"]: r.get("peer-audit-head") for r in lines[2:4] if r["direction"] == "received"}
    assert received == {"north": "5" * 64, "south": "6" * 64}  # in the order they came
    assert len(lines) == 5 and lines[-1]["event"] == "run-ended" and lines[-1]["hospitals"] == ["north", "south"]
    assert all(r["round"] == 4 for r in lines)
    final = trail.log().head()
    assert heads[5][1] == heads[6][1] == final != heads[5][0]  # the second query carries the final line's head
    assert len(grid.sent) == 4 and verify(trail.path).ok  # node 9 was not told


# --- the reply intake (strategies/replies.py) -------------------------------------------------------------------------
def reply_from(node: int, content: RecordDict | Error) -> Message:
    FakeGrid({})  # a ServerApp's task identity, which Flower's replies carry
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN))


def intake_of(tmp_path, limit_bytes=10_000, masks_own_training=False) -> ReplyIntake:
    hospitals = {1: HospitalInfo("north", 10), 2: HospitalInfo("south", 10),
                 3: HospitalInfo("flower-app", 10, {TRAINS_ITSELF: True})}
    return ReplyIntake(hospitals, AuditTrail(tmp_path / "audit.jsonl", tmp_path, "run", "fedavg"), RecordKeys(),
                       ReplyLimits(limit_bytes, 8), lambda model: {"model": model, "groups": len(model)},
                       masks_own_training)


def fedmed_reply(node: int, size: int) -> Message:
    return reply_from(node, to_recorddict(Payload({"model": {"w": np.ones(size, np.float32)}}, metrics={"n": 1.0})))


def test_the_reply_intake_takes_chosen_hospitals_replies_and_refuses_an_over_size_one_by_hospital(tmp_path):
    intake = intake_of(tmp_path)
    error = reply_from(2, Error(1, "disk full"))
    stranger, unchosen = fedmed_reply(9, 10), fedmed_reply(2, 10)
    replies = list(intake.round_replies(1, [fedmed_reply(1, 10), fedmed_reply(1, 10_000), stranger, unchosen],
                                        ["north"], keep_arrays=False))
    assert [(r.hospital.name, r.error) for r in replies[:1]] == [("north", None)]
    assert replies[1].hospital.name == "north" and "malformed reply" in replies[1].error  # 40 kB, limit 10 kB
    assert "10000" in replies[1].error or "bytes" in replies[1].error
    assert len(replies) == 2  # the stranger's and the unchosen hospital's replies are ignored
    assert replies[0].payload.arrays["model"]["w"].shape == (10,) and replies[0].bytes_up > 0
    assert list(intake.kept) == ["north"] and not any(isinstance(r, ArrayRecord) for r in intake.kept["north"].values())
    assert [r.error for r in intake.round_replies(1, [error], ["south"])] == ["disk full"]
    logged = [record for _, record in records_of(tmp_path / "audit.jsonl")]
    assert [r.get("peer") for r in logged] == ["north", "north", None, "south", "south"]  # every reply, logged


def test_the_reply_intake_reads_a_flower_apps_reply_in_flowers_contract_unless_its_training_is_masked(tmp_path):
    flower = RecordDict({"whatever": ArrayRecord({"w": Array(np.ones(3, np.float32))}),
                         "m": MetricRecord({"num-examples": 10})})
    hospital = HospitalInfo("flower-app", 10, {TRAINS_ITSELF: True})
    payload = intake_of(tmp_path).decode(hospital, flower)
    assert payload.arrays["groups"] == 1 and payload.metrics["num-examples"] == 10  # sorted by the method
    assert intake_of(tmp_path).decode(hospital, RecordDict({"m": MetricRecord({"dice": .5})}),
                                      training=False).metrics == {"dice": .5}
    with pytest.raises(MalformedPayload):  # a secure round's training reply is fedmed's records (its mod's)
        intake_of(tmp_path, masks_own_training=True).decode(hospital, flower)
    with pytest.raises(MalformedPayload):  # a fedmed hospital's reply is never read in Flower's contract
        intake_of(tmp_path).decode(HospitalInfo("north", 10), flower)


def test_reply_limits_follow_the_methods_state_and_pulls_the_largest_message():
    state = {"a": np.zeros(1000, np.float32), "b": np.zeros(10, np.float32)}
    assert ReplyLimits.of(0, state) == ReplyLimits(4 * 4040 + 64_000_000, 2 * 2 + 64)
    assert ReplyLimits.of(2.5, state).bytes == 2_500_000
    assert pull_at_once({}) == 0 and pull_at_once({"a": 10, "b": PULL_BYTES // 2}) == 2
    assert pull_at_once({"a": 4 * PULL_BYTES}) == 1


# --- cross-site evaluation (strategies/cross_site.py) -----------------------------------------------------------------
def test_cross_site_evaluation_scores_each_model_on_each_site_and_names_who_failed_or_was_silent(tmp_path):
    def scoring(dice):
        return lambda message: Message(RecordDict({"config": ConfigRecord({}), "metrics": MetricRecord(
            {"global.dice": dice, "own.dice": dice + .1})}), reply_to=message)

    grid = FakeGrid({1: scoring(.5), 2: lambda m: Message(Error(1, "val/x.png cannot be read"), reply_to=m),
                     4: lambda m: Message(RecordDict({"metrics": MetricRecord({"dice": .3})}), reply_to=m),
                     5: lambda m: None, 6: scoring(.7)})
    intake = intake_of(tmp_path)
    intake.hospitals.update({4: HospitalInfo("east", 10), 5: HospitalInfo("west", 10), 6: HospitalInfo("far", 1)})
    asked = [1, 2, 4, 5]  # node 6 is known but not asked: its scores are not taken
    messages = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.EVALUATE) for node in asked]
    result = CrossSiteEvaluation(intake).run(grid, messages, 3, timeout=1.0)
    assert result["after-round"] == 2
    assert result["scores"] == {"north": {"global": {"dice": .5}, "own": {"dice": pytest.approx(.6)}}}
    assert result["failed"]["south"] == "val/x.png cannot be read" and "'dice'" in result["failed"]["east"]
    assert result["missing"] == ["west"]
    logged = [record for _, record in records_of(tmp_path / "audit.jsonl")]
    assert sorted((r["peer"], r["cross-site"]) for r in logged) == [("east", True), ("north", True), ("south", True)]
    assert models_of({"a.x": 1, "b.y": 2.5}) == {"a": {"x": 1.0}, "b": {"y": 2.5}}
    with pytest.raises(ValueError, match="'a.x'=True"):
        models_of({"a.x": True})


# --- the run folder (strategies/run_folder.py) ------------------------------------------------------------------------
def test_the_run_folder_refuses_a_second_claimant_of_a_chosen_name_and_moves_a_timestamp_on(tmp_path):
    (tmp_path / "r1").mkdir()
    other = os.open(tmp_path / "r1" / ".run.lock", os.O_RDWR | os.O_CREAT)  # another run's lock: its own open file
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        named = RunFolder()
        with pytest.raises(ConfigError, match="r1"):
            named.claim(tmp_path, "r1")
        assert named.path is None
        moved = RunFolder(chosen_for_it=True)
        assert moved.claim(tmp_path, "r1") == "r1-2" and moved.path == tmp_path / "r1-2"
        assert moved.claim(tmp_path, "r1") == "r1-2"  # held already: the name it holds
        moved.release()
        assert moved.path is None
    finally:
        os.close(other)
    free = RunFolder()
    assert free.claim(tmp_path, "r1") == "r1"  # let go: free for the next run
    free.release()
