"""FedProto's hospital half: its own model trained with cross-entropy + lambda * MSE(feature, global prototype
of the sample's class), replying with its per-class mean features (and the model, for the server's scoring)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from common.arrays import load_model_arrays
from common.methods.base import Payload
from common.methods.local_training import LocalTraining
from common.models.representations import classifier_features

from .server import PROTOTYPES, NearestPrototypeClassifier


class FedProtoHospital(LocalTraining):
    def own_model(self, rnd: int, payload: Payload) -> torch.nn.Module:
        """The network this hospital kept after its last round before ``rnd`` (the first time: the server's
        initial model, same seed)."""
        self.task.adopt_spec(payload.config)
        torch.manual_seed(self.cfg.seed)
        own = self.site.state.load(before_round=rnd)
        model = self.task.build_model() if own is not None else self.task.initial_model()
        if own is not None:
            load_model_arrays(model, own)
        return model

    def evaluate(self, rnd: int, payload: Payload) -> dict[str, float]:
        """Its own network, classifying by the nearest received global prototype (the server's evaluation)."""
        group = payload.arrays[PROTOTYPES]
        classifier = NearestPrototypeClassifier(self.own_model(rnd, payload), group["mean"], group["present"])
        return self.task.evaluate(classifier, self.site.val, self.site.device)

    def cross_site(self, rnd: int, payload: Payload) -> dict[str, dict[str, float]]:
        return {"own": self.evaluate(rnd, payload)}  # FedProto has no global network, only prototypes

    def train(self, rnd: int, payload: Payload) -> Payload:
        model = self.own_model(rnd, payload)
        group = payload.arrays[PROTOTYPES]
        device = self.site.device
        prototypes = torch.from_numpy(group["mean"]).to(device)
        present = torch.from_numpy(group["present"].astype(bool)).to(device)
        sums = torch.zeros_like(prototypes)
        counts = torch.zeros(len(prototypes), dtype=torch.long, device=device)
        tap = classifier_features(model)

        def term(_net: torch.nn.Module, _x: torch.Tensor, y: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
            features = tap.value
            sums.index_add_(0, y, features.detach())
            counts.index_add_(0, y, torch.ones_like(y))
            pulled = present[y]
            if not pulled.any():
                return output.new_zeros(())
            return self.cfg.fedproto.proto_weight * F.mse_loss(features[pulled], prototypes[y[pulled]])

        reply = self.train_model(rnd, model, term)
        tap.remove()
        means = sums / counts.clamp_min(1)[:, None]
        reply.arrays[PROTOTYPES] = {"mean": means.cpu().numpy().astype(np.float32), "count": counts.cpu().numpy()}
        self.site.state.save(rnd, reply.arrays["model"])
        return reply
