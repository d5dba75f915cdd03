"""How a strategy's training rounds travel, chosen once when the strategy is built: :class:`PlainRounds` (the
training messages go out as built, every reply is screened and aggregated by the round engine, as Flower's FedAvg
does) or secure aggregation (``strategies/secure_aggregation.py``'s ``SecureAggregation``: key stages before the
training messages, masked replies summed and unmasked), as Flower runs SecAgg+ as a workflow beside the strategy.

Both answer the same few questions, so the strategy asks its workflow instead of testing which one it has."""

from __future__ import annotations

import logging
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from common.engine.round_engine import RoundEngine

log = logging.getLogger("fedmed")


class PlainRounds:
    """Rounds whose replies the server reads: the default workflow."""

    #: whether a hospital that trains the model itself gets fedmed's training messages (its mod masks its reply)
    masks_own_training = False
    #: whether a round's accepted replies may wait on disk for the round to close (``reply-store='disk'``)
    stores_replies = True

    def __init__(self, strategy: Any):
        self.strategy = strategy

    def round_engine(self) -> RoundEngine:
        """The strategy's round engine: replies screened one by one, aggregated by the method."""
        return RoundEngine(self.strategy.job, weight_key=self.strategy.weighted_by_key)

    def prepare(self, server_round: int, messages: list[Message], grid: Grid,
                sent: list[tuple] | None = None) -> list[Message]:
        """The round's training messages as they leave, their audit lines (``sent``) written."""
        if sent:
            self.strategy.audit_messages(sent)
        return list(messages)

    def unsigned_problem(self, what: str) -> str | None:
        """Why a hospital that cannot sign its name (a ClientApp with nothing of fedmed) cannot serve (None: it can)."""
        return None

    def hospital_without_count(self, name: str) -> None:
        """A hospital that trains the model itself declared no sample count (it weighs screening.max-samples)."""

    def central_dp_problem(self) -> str | None:
        """Why Flower's central-DP wrappers cannot wrap this workflow's rounds (None: they can)."""
        return None

    def who_trains_note(self) -> str:
        """What this workflow adds to the run's first line on whose train loop trains the rounds."""
        return ""
