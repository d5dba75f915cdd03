"""What FedMEPD and its baselines share, so that they differ only where the methods do.

* The server holds full-modality cases and trains the global model on them for an epoch every
  round after aggregation (FedMEPD's step 4; the baselines do the same, so the comparison is fair),
  and is scored on the full-modality test cases.
* A hospital trains and is scored with the modalities it has (its data has the others zeroed). Its
  reply carries ``val-*``: the scores of the model it holds at the start of the round, as it would
  use it (for FedMEPD the received shared parts with its personal filters and LACCA). The round
  record carries their unweighted mean over hospitals (``hospital-average``, the paper's "client
  average").
* Everything a hospital keeps starts from the server's initial model (same seed), so all methods
  start from the same weights.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from common.arrays import NamedArrays, load_model_arrays, model_arrays
from common.data.brats import MODALITIES, parse_modalities
from common.data.containers import DataError
from common.devices import server_device
from common.methods.base import HospitalInfo, HospitalMethod, HospitalUpdate, RejectedUpdate, ServerMethod


def hospital_modalities(hospital: HospitalInfo) -> tuple[str, ...]:
    """The modalities a hospital declared (``DataError`` naming it when missing or wrong)."""
    return parse_modalities(str(hospital.properties.get("modalities", "")), f"hospital {hospital.name}: modalities")


def encoder_prefixes(modalities: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"encoders.{m}." for m in modalities)


def hospital_average(updates: list[HospitalUpdate]) -> dict[str, float]:
    """Unweighted mean over hospitals of each ``val-*`` score they reported (finite values only)."""
    keys = sorted({k for u in updates for k in u.payload.metrics if k.startswith("val-")})
    average = {}
    for key in keys:
        values = [float(u.payload.metrics[key]) for u in updates
                  if key in u.payload.metrics and math.isfinite(float(u.payload.metrics[key]))]
        if values:
            average[key.removeprefix("val-")] = float(np.mean(values))
    return average


class ServerTraining(ServerMethod):
    """A server that trains the global model on its own full-modality cases every round."""

    def __init__(self, cfg, task=None):
        super().__init__(cfg, task)
        self.device = server_device(cfg.device)
        self._server_cases = None

    def server_cases(self):
        if self._server_cases is None:
            self._server_cases = self.task.load_server_train()
            self.task.check_data(self._server_cases, "the server's training data")
        return self._server_cases

    def round_seed(self, rnd: int) -> int:
        return int(np.random.SeedSequence([self.cfg.seed, rnd]).generate_state(1)[0])

    def train_on_server(self, rnd: int) -> tuple[torch.nn.Module, dict[str, float]]:
        """One epoch (``local-epochs``) on the server's cases from the current global model."""
        model = self.evaluation_model()
        self.task.round = rnd
        stats = self.task.fit(model, self.server_cases(), self.device, self.round_seed(rnd))
        return model, stats

    def server_step(self, rnd: int) -> dict[str, Any]:
        model, stats = self.train_on_server(rnd)
        self.global_arrays = model_arrays(model)
        return {"server-train-loss": stats["train-loss"]}

    def evaluate(self, test_data) -> dict[str, float]:
        return self.task.evaluate(self.evaluation_model(), test_data, self.device)

    def check_hospital(self, hospital: HospitalInfo) -> None:
        """Its declared modalities must be MRI modalities we know (DataError is a ValueError)."""
        hospital_modalities(hospital)

    def check(self, update: HospitalUpdate) -> None:
        try:
            hospital_modalities(update.hospital)
        except DataError as error:
            raise RejectedUpdate(str(error)) from None
        super().check(update)


class BrainHospital(HospitalMethod):
    """A hospital of the brain tumour methods: its modalities, its starting weights, validation."""

    @property
    def modalities(self) -> tuple[str, ...]:
        return parse_modalities(str(self.site.properties.get("modalities", "")),
                                f"hospital {self.site.name}: modalities")

    def initial_arrays(self, model: torch.nn.Module) -> NamedArrays:
        """``model``'s arrays with every part the server has taken from the server's initial model
        (same seed); the rest (LACCA) keeps the hospital's own seeded initialisation."""
        torch.manual_seed(self.cfg.seed)
        server_start = model_arrays(self.task.build_model(MODALITIES))
        arrays = model_arrays(model)
        arrays.update({k: v for k, v in server_start.items() if k in arrays})
        return arrays

    def own_model(self, rnd: int, lacca: bool = False) -> tuple[torch.nn.Module, NamedArrays | None]:
        """A model for this hospital holding what it kept after its last round (or its start), and what it kept."""
        torch.manual_seed(self.site.round_seed(0))
        model = self.task.build_model(self.modalities, lacca=lacca)
        kept = self.site.state.load(before_round=rnd)
        load_model_arrays(model, kept if kept is not None else self.initial_arrays(model))
        return model, kept

    def validation(self, model: torch.nn.Module) -> dict[str, float]:
        scores = self.task.validate(model, self.site.val, self.site.device)
        return {f"val-{k}": v for k, v in scores.items() if k != "num-examples"}

    def local_training(self, rnd: int, model: torch.nn.Module) -> dict[str, float]:
        self.task.check_data(self.site.train, f"hospital {self.site.name}")
        self.task.round = rnd
        return self.task.fit(model, self.site.train, self.site.device, self.site.round_seed(rnd))
