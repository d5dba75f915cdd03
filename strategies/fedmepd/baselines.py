"""The baselines FedMEPD is compared with, in the same harness (the server trains on its cases every
round; hospitals are scored with their own modalities; everyone starts from the same weights):

* ``fedmepd-fedavg``: FedAvg of the whole model, with one encoder shared by all modalities (the
  paper's FedAvg row, ablation (a)); hospitals train the whole model as received (:class:`SharedEncoderFedAvgHospital`).
* ``fedmepd-federated-decoder``: modality-specific encoders and a fully federated fusion decoder:
  FedMEPD without personalisation, anchors or LACCA (ablation (d)).
* ``fedmepd-local``: every hospital trains alone and keeps its model; the server trains alone on
  its cases (the paper's Local row).
"""

from __future__ import annotations

from typing import Any

from common.arrays import model_arrays, weighted_average
from common.methods.base import HospitalInfo, HospitalUpdate, Payload, RejectedUpdate, SecureMean
from common.methods.local_training import LocalTraining

from .harness import BrainHospital, ServerTraining, hospital_average, hospital_modalities
from .hospital import FedMEPDHospital
from .server import FedMEPDServer


class SharedEncoderFedAvgServer(ServerTraining):
    name = "fedmepd-fedavg"

    def __init__(self, cfg, task=None):
        super().__init__(cfg, task)
        self.task.spec["shared-encoder"] = True  # in every round config, so hospitals build the same model

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        self.global_arrays = weighted_average([u.payload.arrays["model"] for u in updates],
                                              [u.weight for u in updates])
        return {"hospital-average": hospital_average(updates)}

    def aggregate_secure_mean(self, rnd: int, mean: SecureMean) -> dict[str, Any]:
        """The secure mean update is the global model; the hospitals' own scores they state in the clear."""
        self.global_arrays = dict(mean.arrays)
        return {"hospital-average": hospital_average(mean.hospitals)}


class SharedEncoderFedAvgHospital(LocalTraining):
    """FedAvg's local step on the whole shared-encoder model."""


class FederatedDecoderServer(FedMEPDServer):
    name = "fedmepd-federated-decoder"
    personalise = False
    share_anchors = False


class FederatedDecoderHospital(FedMEPDHospital):
    lacca = False


class LocalServer(ServerTraining):
    name = "fedmepd-local"

    def downlink(self, rnd: int, hospital: HospitalInfo) -> Payload:
        return Payload(config=self.round_config(rnd))  # the round number and model spec only

    def check(self, update: HospitalUpdate) -> None:
        try:
            hospital_modalities(update.hospital)
        except ValueError as error:
            raise RejectedUpdate(str(error)) from None

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        return {"hospital-average": hospital_average(updates)}


class LocalHospital(BrainHospital):
    def train(self, rnd: int, payload: Payload) -> Payload:
        self.task.adopt_spec(payload.config)
        model, _ = self.own_model(rnd)
        metrics: dict[str, float] = {"num-examples": float(len(self.site.train)), **self.validation(model)}
        metrics.update(self.local_training(rnd, model))
        self.site.state.save(rnd, model_arrays(model))
        return Payload(metrics=metrics)

    def evaluate(self, rnd: int, payload: Payload) -> dict[str, float]:
        self.task.adopt_spec(payload.config)
        model, _ = self.own_model(rnd)
        return self.task.evaluate(model, self.site.val, self.site.device)

    def cross_site(self, rnd: int, payload: Payload) -> dict[str, dict[str, float]]:
        return {"own": self.evaluate(rnd, payload)}  # local training only: there is no global model
