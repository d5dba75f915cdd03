"""Cross-site evaluation at the end of a run: every hospital scores the final models on its own validation data."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from common.engine.screening import cut
from common.engine.wire import MalformedPayload

from .grid_messages import send_and_receive
from .replies import ReplyIntake

log = logging.getLogger("fedmed")


class CrossSiteEvaluation:
    """Sends the final models' evaluate messages (``HospitalMethod.cross_site`` answers them) and reads the scores:
    each reply taken by ``intake`` (from the hospitals it knows, within its limits, logged on its audit trail),
    ``in_flight`` messages pending at once. ``HospitalStrategy.cross_site_evaluation`` builds one per run's end."""

    def __init__(self, intake: ReplyIntake, in_flight: int = 0):
        self.intake, self.in_flight = intake, in_flight

    def run(self, grid: Grid, messages: list[Message], server_round: int, timeout: float) -> dict[str, Any]:
        """``scores[hospital][model][metric]`` of the hospitals ``messages`` go to, with those that failed (and
        why) or did not answer within ``timeout`` named; ``after-round``: the last round trained."""
        asked = {message.metadata.dst_node_id: self.intake.hospitals[message.metadata.dst_node_id]
                 for message in messages}
        scores: dict[str, dict[str, dict[str, float]]] = {}
        failed: dict[str, str] = {}
        for message in send_and_receive(grid, messages, timeout, self.in_flight):
            hospital = asked.get(message.metadata.src_node_id)
            self.intake.audit.message("received", message, server_round,
                                      getattr(self.intake.hospitals.get(message.metadata.src_node_id), "name", None),
                                      cross_site=True)
            if hospital is None:
                continue
            try:
                if message.has_error():
                    raise MalformedPayload(cut(message.error.reason))
                scores[hospital.name] = models_of(self.intake.decode(hospital, message.content, training=False).metrics)
            except (MalformedPayload, ValueError) as error:
                failed[hospital.name] = str(error)
        missing = [h.name for h in asked.values() if h.name not in scores and h.name not in failed]
        for name, reason in failed.items():
            log.warning("cross-site evaluation: %s could not score the final models: %s", name, reason)
        if missing:
            log.warning("cross-site evaluation: no answer from %s within %.0f s", ", ".join(missing), timeout)
        return {"after-round": server_round - 1, "scores": scores, "failed": failed, "missing": missing}


def models_of(metrics: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{'global.dice': .8, 'own.dice': .9}`` -> ``{'global': {'dice': .8}, 'own': {'dice': .9}}`` (numbers only)."""
    models: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        model, _, metric = key.partition(".")
        if not metric or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"cross-site metric {key!r}={value!r} is not '<model>.<metric>' = a number")
        models.setdefault(model, {})[metric] = float(value)
    return models
