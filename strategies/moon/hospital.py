"""MOON (Li et al. 2021): FedAvg plus a model-contrastive term on each hospital's representation.

The representation z of a sample is pulled towards the received global model's and pushed away
from the hospital's own previous local model's (kept in its state store between the rounds it
trains in): -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau})).
z is the ResNet's pooled 512-d feature (no projection head, see docs/fedproin.md). On a
hospital's first round there is no previous model and the term is left out (with the previous
model equal to the global one, as in MOON's code, it has no gradient anyway).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.arrays import load_model_arrays
from common.methods.base import Payload
from common.methods.local_training import LocalTraining
from common.models.representations import ClassifierFeatures, FeatureTap, classifier_features, frozen_copy
from common.tasks.base import ExtraLoss
from common.trust.patient_dp import PER_SAMPLE, loss_term

from .settings import MoonSettings


def model_contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor,
                           temperature: float) -> torch.Tensor:
    """Cross-entropy of picking the global representation (positive) over the previous one (negative)."""
    logits = torch.stack([F.cosine_similarity(z, z_global, dim=1), F.cosine_similarity(z, z_previous, dim=1)], dim=1)
    return F.cross_entropy(logits / temperature, torch.zeros(len(z), dtype=torch.long, device=z.device))


def moon_term(model: torch.nn.Module, previous: torch.nn.Module, settings: MoonSettings,
              device: torch.device) -> tuple[ExtraLoss, FeatureTap]:
    """mu * model-contrastive loss for ``model`` as received; returns the term and its feature tap."""
    global_features = ClassifierFeatures(frozen_copy(model)).to(device)  # copy before tapping the original
    previous_features = ClassifierFeatures(frozen_copy(previous)).to(device)
    tap = classifier_features(model)

    def term(_net: torch.nn.Module, x: torch.Tensor, _y: torch.Tensor, _output: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z_global, z_previous = global_features(x), previous_features(x)
        return settings.mu * model_contrastive_loss(tap.value, z_global, z_previous, settings.temperature)

    return loss_term(term, PER_SAMPLE), tap  # each sample's own term: DP-SGD clips it with the task loss


class MoonHospital(LocalTraining):
    def train(self, rnd: int, payload: Payload) -> Payload:
        model = self.task.model_from_payload(payload)
        previous_arrays = self.site.state.load(before_round=rnd)
        term = tap = None
        if previous_arrays is not None and self.cfg.moon.mu > 0:
            previous = self.task.build_model()
            load_model_arrays(previous, previous_arrays)
            term, tap = moon_term(model, previous, self.cfg.moon, self.site.device)
        reply = self.train_model(rnd, model, term)
        if tap is not None:
            tap.remove()
        self.site.state.save(rnd, reply.arrays["model"])
        return reply
