"""The strategy's own round loop (``HospitalStrategy.start``): Flower's ``Strategy.start`` with hospitals by name,
streamed replies, faster polling, resume, cross-site evaluation and the run's end told to the hospitals."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from .grid_messages import (
    messages_in_flight,
    replies_as_they_arrive,
    retry_unavailable_objects_sooner,
    send_and_receive,
    warn_unsent,
)
from .outcome import why_nothing_aggregated
from .records import numbers

log = logging.getLogger("fedmed")

EvaluateFn = Callable[[int, ArrayRecord], "MetricRecord | None"]


class OwnRoundLoop:
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
                                                     pull_at_once=self.pull_at_once())
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


def metrics_text(metrics: Mapping[str, Any]) -> str:
    """``accuracy=0.8125, loss=0.4310``: a round's numbers for its log line (lists left out)."""
    return ", ".join(f"{key}={value:.4g}" for key, value in numbers(metrics).items()) or "no numbers"


def drain(messages: list[Message]) -> Iterator[Message]:
    """The messages one by one, each dropped from the list as it is handed out (so it can be freed once used)."""
    while messages:
        yield messages.pop(0)
