"""FedBN's server half: FedAvg of everything but the normalisation layers, which stay with each hospital.

There is no global model to score on its own (its normalisation layers would be the initial ones), so, as for
FedProto, the server scores each hospital's own model (the shared weights with that hospital's normalisation
layers, which its reply carries for this alone) on the test set and reports the mean over hospitals.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from common.arrays import ArraysMismatch, NamedArrays, check_like, load_model_arrays, robust_average, weighted_average
from common.engine.reply_store import materialized
from common.engine.round_engine import weighted_mean_metrics
from common.engine.screening import batchnorm_problem
from common.methods.base import HospitalInfo, HospitalUpdate, Payload, RejectedUpdate, ServerMethod

from .norm_layers import NORM_GROUP, norm_layer_names, norm_names_of, split_norm_layers


class FedBNServer(ServerMethod):
    name = "fedbn"

    def initialize(self) -> None:
        super().initialize()
        self.norm_names = norm_layer_names(self.task.build_model())
        if not self.norm_names:
            raise ValueError("FedBN: the model has no BatchNorm or InstanceNorm layer "
                             "to keep local; use fedavg")
        self.local_norms: dict[str, NamedArrays] = {}

    def adopt_own_network(self, arrays: NamedArrays) -> None:
        """A Flower user's own network: its normalisation layers found by their running statistics' names."""
        norms = norm_names_of(arrays)
        if not norms:
            raise ValueError("FedBN: initial_arrays hold no normalisation layer (no '<layer>.running_mean') to keep "
                             "at each hospital; use FedAvgStrategy")
        super().adopt_own_network(arrays)
        self.norm_names = norms

    def flower_reply_arrays(self, arrays: NamedArrays) -> dict[str, NamedArrays]:
        """A Flower ClientApp's whole state dict: the shared weights, and its normalisation layers beside them."""
        shared, norms = split_norm_layers(super().flower_reply_arrays(arrays)["model"], self.norm_names)
        return {"model": shared, NORM_GROUP: norms}

    def shared(self) -> NamedArrays:
        return split_norm_layers(self.global_arrays, self.norm_names)[0]

    def downlink(self, rnd: int, hospital: HospitalInfo) -> Payload:
        return Payload(arrays={"model": self.shared()}, config=self.round_config(rnd))

    def expected_model(self, update: HospitalUpdate) -> NamedArrays:
        return self.shared()

    def check(self, update: HospitalUpdate) -> None:
        super().check(update)
        norms = update.payload.arrays.get(NORM_GROUP)
        expected = split_norm_layers(self.global_arrays, self.norm_names)[1]
        try:
            check_like(norms or {}, expected, f"normalisation layers of {update.hospital.name}", exact_dtype=True)
        except ArraysMismatch as error:
            raise RejectedUpdate(str(error)) from None
        problem = batchnorm_problem(norms)
        if problem:
            raise RejectedUpdate(problem)

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        models = [u.payload.arrays["model"] for u in updates]
        rule = self.cfg.screening.robust_aggregate
        shared = (weighted_average(models, [u.weight for u in updates]) if rule == "mean"
                  else robust_average(models, rule, self.cfg.screening.trim_fraction))
        self.global_arrays = {k: shared.get(k, v) for k, v in self.global_arrays.items()}
        for update in updates:  # kept beyond the round: copies of their own
            self.local_norms[update.hospital.name] = materialized(update.payload.arrays[NORM_GROUP])
        return {}

    def evaluation_model(self, hospital: str | None = None) -> torch.nn.Module:
        """A hospital's own model: the shared weights with its normalisation layers (``None``: the initial ones)."""
        if hospital is not None and hospital not in self.local_norms:
            raise ValueError(f"FedBN keeps the normalisation layers of {sorted(self.local_norms)} only "
                             f"({hospital!r} has not trained yet)")
        model = self.task.build_model()
        load_model_arrays(model, {**self.global_arrays, **(self.local_norms.get(hospital) or {})})
        return model

    def evaluate(self, test_data) -> dict[str, float]:
        """Mean over hospitals of their own model's test metrics (the global model's before any has trained)."""
        if not self.local_norms:
            return self.task.evaluate(self.evaluation_model(), test_data)
        return weighted_mean_metrics([(1.0, self.task.evaluate(self.evaluation_model(h), test_data))
                                      for h in sorted(self.local_norms)])

    def state_dict(self) -> dict[str, np.ndarray]:
        state = super().state_dict()
        for hospital, arrays in self.local_norms.items():
            state.update({f"norm/{hospital}/{name}": value for name, value in arrays.items()})
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        self.local_norms = {}
        for key, value in state.items():
            if key.startswith("norm/"):
                hospital, name = key.removeprefix("norm/").split("/", 1)
                self.local_norms.setdefault(hospital, {})[name] = value
