"""Cross-site evaluation at the end of a run: every hospital scores the final models on its own validation data."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, MessageType
from flwr.serverapp import Grid

from common.engine.screening import cut
from common.engine.wire import MalformedPayload, from_recorddict
from common.methods.base import CROSS_SITE_KEY, TRAINS_ITSELF

from .grid_messages import messages_in_flight, send_and_receive

log = logging.getLogger("fedmed")

class CrossSiteEvaluation:
    def cross_site_evaluation(self, grid: Grid, timeout: float) -> dict[str, Any]:
        """Every connected hospital scores the final models on its own validation data (Flower evaluate
        messages; ``HospitalMethod.cross_site``): ``scores[hospital][model][metric]``, with the hospitals that
        failed (and why) or did not answer within ``timeout`` named. Also kept as ``self.cross_site``."""
        self.discover(grid)
        hospitals = sorted((h for h in self.hospitals.values() if not h.properties.get(TRAINS_ITSELF)),
                           key=lambda h: h.name)  # a ClientApp that trains itself has no cross-site handler
        rnd = self.engine.next_round  # what the hospitals would receive next: the final models
        self._evaluated = hospitals
        messages = self.hospital_messages(rnd, hospitals, ConfigRecord({CROSS_SITE_KEY: True}), MessageType.EVALUATE)
        scores: dict[str, dict[str, dict[str, float]]] = {}
        failed: dict[str, str] = {}
        for message in send_and_receive(grid, messages, timeout, messages_in_flight(self.job, grid)):
            hospital = self.hospitals.get(message.metadata.src_node_id)
            self.audit_message("received", message, rnd, hospital.name if hospital else None, cross_site=True)
            if hospital is None or hospital not in hospitals:
                continue
            try:
                if message.has_error():
                    raise MalformedPayload(cut(message.error.reason))
                metrics = from_recorddict(message.content, self.reply_limit(), self.records,
                                          self.reply_tensor_limit()).metrics
                scores[hospital.name] = models_of(metrics)
            except (MalformedPayload, ValueError) as error:
                failed[hospital.name] = str(error)
        missing = [h.name for h in hospitals if h.name not in scores and h.name not in failed]
        for name, reason in failed.items():
            log.warning("cross-site evaluation: %s could not score the final models: %s", name, reason)
        if missing:
            log.warning("cross-site evaluation: no answer from %s within %.0f s", ", ".join(missing), timeout)
        self.cross_site = {"after-round": rnd - 1, "scores": scores, "failed": failed, "missing": missing}
        return self.cross_site



def models_of(metrics: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{'global.dice': .8, 'own.dice': .9}`` -> ``{'global': {'dice': .8}, 'own': {'dice': .9}}`` (numbers only)."""
    models: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        model, _, metric = key.partition(".")
        if not metric or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"cross-site metric {key!r}={value!r} is not '<model>.<metric>' = a number")
        models.setdefault(model, {})[metric] = float(value)
    return models
