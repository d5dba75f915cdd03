"""The strategy's own round loop (``HospitalStrategy.start``): Flower's ``Strategy.start`` with hospitals by name,
streamed replies, faster polling, resume, cross-site evaluation and the run's end told to the hospitals."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from common.methods.base import CROSS_SITE_KEY, FLOWER_ONLY, TRAINS_ITSELF

from .cross_site import CrossSiteEvaluation
from .grid_messages import (
    messages_in_flight,
    replies_as_they_arrive,
    retry_unavailable_objects_sooner,
    send_and_receive,
    warn_unsent,
)
from .outcome import why_nothing_aggregated
from .records import numbers
from .replies import pull_at_once

log = logging.getLogger("fedmed")

EvaluateFn = Callable[[int, ArrayRecord], "MetricRecord | None"]


class OwnRoundLoop:
    """A mixin of HospitalStrategy, not a part it holds: the loop is the strategy's own ``Strategy.start`` (as in
    Flower, where the round loop is a method of the strategy) and drives the strategy's configure and aggregate
    methods, which a subclass or a Flower wrapper may override; the run's end it closes with the parts it holds."""

    def run_rounds(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                   timeout: float | None, train_config: ConfigRecord | None, evaluate_config: ConfigRecord | None,
                   evaluate_fn: EvaluateFn | None) -> Result:
        """:meth:`start` once the run folder is this run's."""
        num_rounds = num_rounds or self.job.num_server_rounds
        timeout = timeout or self.job.round_timeout
        if num_rounds != self.job.num_server_rounds or timeout != self.job.round_timeout:
            self.change_job(num_server_rounds=num_rounds, round_timeout=timeout)
        if initial_arrays is not None and len(initial_arrays) and self.engine.next_round == 1:
            self.adopt_initial_arrays(initial_arrays, "initial_arrays")
        train_config = train_config or ConfigRecord()
        evaluate_config = evaluate_config or ConfigRecord()
        self.nothing_aggregated = None
        self.summary()
        result = Result()
        arrays = self.initial_arrays()
        if evaluate_fn is not None and self.engine.next_round == 1:
            central = evaluate_fn(0, arrays)
            if central is not None:
                result.evaluate_metrics_serverapp[0] = central
        first = self.engine.next_round
        self._in_own_loop = True
        in_flight = messages_in_flight(self.job, grid)
        retry_unavailable_objects_sooner()
        try:
            for rnd in range(first, num_rounds + 1):
                log.info("[ROUND %d/%d]", rnd, num_rounds)  # as Flower's Strategy.start announces each round
                messages = list(self.configure_train(rnd, arrays, train_config, grid))
                streamed = self.reply_folder() is not None
                if streamed:  # handed to aggregate_train as they arrive
                    replies = replies_as_they_arrive(grid, set(), timeout, queued=messages, in_flight=in_flight,
                                                     pull_at_once=pull_at_once(self._bytes_down))
                else:  # every reply at once, as Flower's loop hands them
                    replies = drain(send_and_receive(grid, messages, timeout, in_flight))
                aggregated, metrics = self.aggregate_train(rnd, replies)
                for _ in replies:  # an override that took only some: the round waits for all, as Flower's loop does
                    pass
                if streamed:
                    warn_unsent(messages, timeout, in_flight)
                if aggregated is not None:
                    arrays = result.arrays = aggregated  # as in Flower's loop: the last aggregate, else none
                if metrics is not None:
                    result.train_metrics_clientapp[rnd] = metrics
                evaluation = list(self.configure_evaluate(rnd, arrays, evaluate_config, grid))
                record = self.round_record(rnd)
                evaluated = self.aggregate_evaluate(
                    rnd, send_and_receive(grid, evaluation, timeout, in_flight) if evaluation else [])
                if evaluated is not None:
                    result.evaluate_metrics_clientapp[rnd] = evaluated
                    log.info("round %d: the hospitals' evaluation: %s", rnd, metrics_text(evaluated))
                central = numbers(record.get("test", {}))
                if evaluate_fn is not None:
                    own = evaluate_fn(rnd, arrays)
                    if own is not None:
                        record["central"] = dict(own)
                        central.update(dict(own))
                        log.info("round %d: evaluate_fn: %s", rnd, metrics_text(own))
                if central:
                    result.evaluate_metrics_serverapp[rnd] = MetricRecord(central)
                self.round_ended(record)
        finally:
            self._in_own_loop = False
        ran = [r for r in self.engine.history if r["round"] >= first]
        if ran and not any(r["aggregated"] for r in ran):
            self.record_nothing_aggregated(why_nothing_aggregated(ran, first, num_rounds))
        if self.job.cross_site_evaluation:
            self.cross_site_evaluation(grid, timeout)
        self.announce_end(grid, timeout)
        return result

    def reply_folder(self) -> Path | None:
        """Where a round's accepted replies wait, on disk, for the round to close (``<run>/.round-<n>``, removed
        then): the run folder in this loop with ``reply-store='disk'``, so the ServerApp holds one reply at a time
        whatever the number of hospitals. None (every reply in memory) under Flower's own loop, whose
        ``Grid.send_and_receive`` has every reply in memory already, and with secure aggregation, whose masked
        vectors are summed as they come."""
        if not self._in_own_loop or self.job.reply_store != "disk" or not self.workflow.stores_replies:
            return None
        return self.job.run_dir

    def cross_site_evaluation(self, grid: Grid, timeout: float) -> dict[str, Any]:
        """Every connected hospital scores the final models on its own validation data (Flower evaluate
        messages; :class:`CrossSiteEvaluation`): ``scores[hospital][model][metric]``, with the hospitals that
        failed (and why) or did not answer within ``timeout`` named. Also kept as ``self.cross_site``."""
        self.discover(grid)
        self._evaluated = sorted((h for h in self.hospitals.values() if not h.properties.get(TRAINS_ITSELF)),
                                 key=lambda h: h.name)  # a ClientApp that trains itself has no cross-site handler
        rnd = self.engine.next_round  # what the hospitals would receive next: the final models
        messages = self.hospital_messages(rnd, self._evaluated, ConfigRecord({CROSS_SITE_KEY: True}),
                                          MessageType.EVALUATE)
        evaluation = CrossSiteEvaluation(self.reply_intake(), messages_in_flight(self.job, grid))
        self.cross_site = evaluation.run(grid, messages, rnd, timeout)
        return self.cross_site

    def record_nothing_aggregated(self, reason: str) -> None:
        """The run aggregated nobody: why, logged, kept as ``nothing_aggregated`` and written to the audit log."""
        self.nothing_aggregated = reason
        log.error("%s: %s; the Result holds no arrays, as Flower's", self.job.run_name, reason)
        self.audit.nothing_aggregated(reason)

    def announce_end(self, grid: Grid, timeout: float) -> None:
        """Tell every hospital with an audit log that the run ended (:meth:`AuditTrail.announce_end`); a Flower
        ClientApp that trains the model itself has no log and no query handler to answer."""
        told = {node: hospital.name for node, hospital in sorted(self.hospitals.items())
                if not hospital.properties.get(FLOWER_ONLY)}
        rnd = self.engine.next_round - 1
        self.audit.announce_end(grid, told, rnd, lambda: self.hospital_config(rnd), self.records.config,
                                min(timeout, 30.0), messages_in_flight(self.job, grid, True))


def metrics_text(metrics: Mapping[str, Any]) -> str:
    """``accuracy=0.8125, loss=0.4310``: a round's numbers for its log line (lists left out)."""
    return ", ".join(f"{key}={value:.4g}" for key, value in numbers(metrics).items()) or "no numbers"


def drain(messages: list[Message]) -> Iterator[Message]:
    """The messages one by one, each dropped from the list as it is handed out (so it can be freed once used)."""
    while messages:
        yield messages.pop(0)
