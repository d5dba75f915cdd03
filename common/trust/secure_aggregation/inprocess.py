"""One protocol run with every hospital in this process: the server's functions (:mod:`.server`) and each hospital's
:func:`~.hospital.hospital_stage` under its own rules, with no transport. What tests (playing an honest or a lying
server) and the benchmark's protocol-alone timing run."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np

from .hospital import HospitalRound, HospitalRules, hospital_stage
from .messages import COLLECT, CONSISTENCY, SETUP, SHARE_KEYS, UNMASK
from .server import (
    ServerRound,
    add_masked_vector,
    collect_config,
    consistency_config,
    plan_round,
    receive_key_shares,
    receive_public_keys,
    receive_survivor_signatures,
    setup_config,
    share_keys_config,
    threshold_problem,
    unmask_config,
    unmask_sum,
)
from .settings import SecureAggregationSettings


class InProcess:
    """A round over ``nodes`` summing vectors of ``size`` values; ``rules``: each hospital's (default: its name and
    nothing else). :meth:`run` is an honest server; a lying one calls :meth:`ask` with configs of its own."""

    def __init__(self, nodes: list[int], settings: SecureAggregationSettings, size: int,
                 rules: Mapping[int, HospitalRules] | None = None):
        self.plan: ServerRound = plan_round(nodes, settings, [0, 1], size)
        self.rules = dict(rules) if rules is not None else {n: HospitalRules(self.plan.name(n)) for n in nodes}
        self.states = {n: HospitalRound.new() for n in nodes}

    def ask(self, node: int, stage: str, config: Mapping[str, Any], vector: np.ndarray | None = None) -> dict:
        """``node``'s answer to one stage (SecureAggregationRefusal when it will not)."""
        self.states[node], answer = hospital_stage(self.states[node], stage, config, node, self.rules[node], vector)
        return answer

    def answers(self, stage: str, config_of: Callable[[int], Mapping[str, Any]], nodes: Iterable[int],
                silent_at: Mapping[int, str] | None = None) -> dict[int, dict]:
        return {n: self.ask(n, stage, config_of(n)) for n in sorted(nodes) if (silent_at or {}).get(n) != stage}

    def keys(self, silent_at: Mapping[int, str] | None = None) -> None:
        """Setup and share keys."""
        plan = self.plan
        receive_public_keys(plan, self.answers(SETUP, lambda n: setup_config(plan), plan.nodes, silent_at))
        receive_key_shares(plan, self.answers(SHARE_KEYS, lambda n: share_keys_config(plan, n), plan.setup_done,
                                              silent_at))

    def mask(self, node: int, vector: np.ndarray) -> np.ndarray:
        return self.ask(node, COLLECT, collect_config(self.plan, node), vector)["masked"]

    def unmask(self, silent_at: Mapping[int, str] | None = None) -> np.ndarray:
        """The consistency and unmask stages over the masked nodes, and the unmasked sum."""
        plan = self.plan
        receive_survivor_signatures(plan, self.answers(CONSISTENCY, lambda n: consistency_config(plan, n),
                                                       plan.masked, silent_at))
        return unmask_sum(plan, self.answers(UNMASK, lambda n: unmask_config(plan, n), plan.masked, silent_at))

    def run(self, vectors: Mapping[int, np.ndarray], silent_at: Mapping[int, str] | None = None):
        """Every stage, honestly; ``silent_at``: node -> the stage it stops answering at. The protocol state and the
        unmasked sum (or the reason the round cannot go on)."""
        silent_at, plan = silent_at or {}, self.plan
        self.keys(silent_at)
        for node in sorted(plan.keyed):
            if silent_at.get(node) != COLLECT:
                add_masked_vector(plan, node, self.mask(node, vectors[node]))
        problem = threshold_problem(plan, plan.masked, plan.masked | plan.dropped)
        if problem:
            return plan, problem
        return plan, self.unmask(silent_at)
