"""The parts HospitalStrategy is built from, each on its own: how it finds Flower's wrappers (by what holds it, with
no wrapper's method on the call stack) and the round workflow it chooses once (plain rounds or secure aggregation).
Discovery and identity: tests/test_hostile_hospital.py, tests/test_flower_clientapp.py; the audit trail:
tests/test_audit.py; replies and the reply store: tests/test_reply_store.py, tests/test_streamed_rounds.py; the round
record: tests/test_round_record.py; the round loop and declined rounds: tests/test_flower_semantics.py."""

from __future__ import annotations

import gc

from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
)

from common.engine.round_engine import RoundEngine
from strategies import FedAvgStrategy, FedProInStrategy
from strategies.round_workflow import PlainRounds
from strategies.secure_aggregation import SecureAggregation, SecureRoundEngine, with_secure_aggregation
from strategies.wrappers import wrappers_of


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
