"""FedProto (Tan et al. 2022): hospitals keep their own models and share only class prototypes.

Hospital: continues its own model (state store; the job-seeded initial model the first time),
trains it with cross-entropy + lambda * MSE(feature, global prototype of the sample's class), and
replies with its per-class mean features over the round's training draws. Server: each class's
global prototype is the unweighted mean of the hospitals' prototypes of that class.

There is no global model. As in the FedProIn paper, the server scores the hospitals' own models
(prediction: nearest global prototype) on its test set and reports the mean over hospitals, so the
reply also carries the local model, for that evaluation only (docs/fedproin.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from common.arrays import ArraysMismatch, NamedArrays, check_like, load_model_arrays, model_arrays
from common.engine.reply_store import materialized
from common.engine.round_engine import weighted_mean_metrics
from common.methods.base import HospitalUpdate, Payload, RejectedUpdate, ServerMethod
from common.models.prototype_net import squared_distances
from common.models.representations import ClassifierFeatures, classifier_head, frozen_copy

PROTOTYPES = "prototypes"  # array group: "mean" (C, d); downlink "present" (C,), reply "count" (C,)


class NearestPrototypeClassifier(torch.nn.Module):
    """A hospital's network scored by its features' distance to the global prototypes."""

    def __init__(self, model: torch.nn.Module, prototypes: np.ndarray, present: np.ndarray):
        super().__init__()
        self.features = ClassifierFeatures(frozen_copy(model))
        self.register_buffer("prototypes", torch.from_numpy(prototypes).float()[:, None, :])
        self.register_buffer("absent", torch.from_numpy(~present.astype(bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = -squared_distances(self.features(x), self.prototypes).squeeze(2)
        return scores.masked_fill(self.absent, float("-inf"))


class FedProtoServer(ServerMethod):
    name = "fedproto"

    def initialize(self) -> None:
        torch.manual_seed(self.cfg.seed)  # hospitals rebuild this initial model from the same seed
        model = self.task.initial_model()
        self.global_arrays = model_arrays(model)
        features = classifier_head(model)[1].in_features
        self.prototypes = np.zeros((self.task.num_classes, features), dtype=np.float32)
        self.present = np.zeros(self.task.num_classes, dtype=bool)
        self.local_models: dict[str, dict[str, np.ndarray]] = {}

    def downlink(self, rnd: int, hospital) -> Payload:
        return Payload(arrays={PROTOTYPES: {"mean": self.prototypes, "present": self.present.astype(np.uint8)}},
                       config=self.round_config(rnd))

    def check(self, update: HospitalUpdate) -> None:
        super().check(update)
        group = update.payload.arrays.get(PROTOTYPES, {})
        expected = {"mean": self.prototypes, "count": np.zeros(len(self.present), dtype=np.int64)}
        try:
            check_like(group, expected, "prototypes", exact_dtype=True)
        except ArraysMismatch as error:
            raise RejectedUpdate(str(error)) from None
        if (group["count"] < 0).any():
            raise RejectedUpdate("prototype counts are negative")

    def screened_arrays(self, update: HospitalUpdate) -> tuple[NamedArrays, NamedArrays]:
        """The model, against the one the server last accepted from this hospital (FedProto never sends a
        model down, so each hospital drifts from the initial one at its own pace), and the class means against
        the global prototypes: a forged mean of 1e30 stands out like a forged weight."""
        arrays = update.payload.arrays["model"]
        reference = self.local_models.get(update.hospital.name, self.global_arrays)
        means = {"prototypes.mean": update.payload.arrays[PROTOTYPES]["mean"]}
        return {**arrays, **means}, {**reference, "prototypes.mean": self.prototypes}

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        means = np.stack([u.payload.arrays[PROTOTYPES]["mean"] for u in updates]).astype(np.float64)
        holders = np.stack([u.payload.arrays[PROTOTYPES]["count"] > 0 for u in updates])  # (H, C)
        reported = holders.sum(axis=0)
        seen = reported > 0
        self.prototypes[seen] = (np.einsum("hc,hcd->cd", holders, means)[seen]
                                 / reported[seen, None]).astype(np.float32)
        self.present |= seen
        for update in updates:  # kept beyond the round (each hospital's own model): copies of their own
            self.local_models[update.hospital.name] = materialized(update.payload.arrays["model"])
        return {"hospitals-per-class": reported.tolist()}

    def evaluation_model(self, hospital: str | None = None) -> torch.nn.Module:
        """A hospital's own network with the global prototypes: FedProto has no global network."""
        if hospital not in self.local_models:
            raise ValueError(f"FedProto has a model per hospital only; choose one of {sorted(self.local_models)}"
                             + (f" ({hospital!r} has none)" if hospital else ""))
        model = self.task.build_model()
        load_model_arrays(model, self.local_models[hospital])
        return NearestPrototypeClassifier(model, self.prototypes, self.present)

    def evaluate(self, test_data) -> dict[str, float]:
        """Mean over hospitals of their own model's test metrics (nearest global prototype)."""
        return weighted_mean_metrics([(1.0, self.task.evaluate(self.evaluation_model(hospital), test_data))
                                      for hospital in self.local_models])

    def state_dict(self) -> dict[str, np.ndarray]:
        state = super().state_dict()
        state["prototypes/mean"] = self.prototypes
        state["prototypes/present"] = self.present
        for hospital, arrays in self.local_models.items():
            state.update({f"local/{hospital}/{name}": value for name, value in arrays.items()})
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        self.prototypes = state["prototypes/mean"].copy()
        self.present = state["prototypes/present"].astype(bool)
        self.local_models = {}
        for key, value in state.items():
            if key.startswith("local/"):
                hospital, name = key.removeprefix("local/").split("/", 1)
                self.local_models.setdefault(hospital, {})[name] = value
