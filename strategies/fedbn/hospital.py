"""FedBN's hospital half: the received shared weights with its own normalisation layers (kept in its state folder
between the rounds it trains in; the server's initial ones the first time), trained as FedAvg trains."""

from __future__ import annotations

import torch

from common.arrays import load_model_arrays, model_arrays
from common.methods.base import Payload
from common.methods.local_training import LocalTraining

from .norm_layers import NORM_GROUP, norm_layer_names, split_norm_layers


class FedBNHospital(LocalTraining):
    def own_model(self, rnd: int, payload: Payload) -> torch.nn.Module:
        """The server's initial model (same seed) with the received shared weights and this hospital's last
        normalisation layers (the initial ones before it kept any): what the server sends for those layers is never
        loaded, so it is no training input (a secure round's replay memory leaves it out, ``secure.py``)."""
        self.task.adopt_spec(payload.config)
        torch.manual_seed(self.cfg.seed)
        model = self.task.initial_model()
        arrays = model_arrays(model)
        norms = norm_layer_names(model)
        arrays.update({k: v for k, v in payload.arrays["model"].items() if k not in norms})
        kept = self.site.state.load(before_round=rnd) or {}
        arrays.update({k: v for k, v in kept.items() if k in norms and k in arrays})
        load_model_arrays(model, arrays)
        return model

    def train(self, rnd: int, payload: Payload) -> Payload:
        model = self.own_model(rnd, payload)
        reply = self.train_model(rnd, model)
        shared, norms = split_norm_layers(reply.arrays["model"], norm_layer_names(model))
        self.site.state.save(rnd, norms)
        reply.arrays = {"model": shared, NORM_GROUP: norms}
        return reply

    def evaluate(self, rnd: int, payload: Payload) -> dict[str, float]:
        return self.task.evaluate(self.own_model(rnd, payload), self.site.val, self.site.device)

    def cross_site(self, rnd: int, payload: Payload) -> dict[str, dict[str, float]]:
        """Its own model, and the shared weights with the initial normalisation layers (what a new site gets)."""
        self.task.adopt_spec(payload.config)
        torch.manual_seed(self.cfg.seed)
        initial = self.task.initial_model()
        load_model_arrays(initial, {**model_arrays(initial), **payload.arrays["model"]})
        return {"global": self.task.evaluate(initial, self.site.val, self.site.device),
                "own": self.evaluate(rnd, payload)}
