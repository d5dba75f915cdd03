"""Plain local training of the received model: FedAvg's hospital step, which FedProx, MOON, FedBN, FedProto, FedProIn
and the FedMEPD FedAvg baseline build on (each adds its own terms or starts from its own model)."""

from __future__ import annotations

from functools import partial

import torch

from common.arrays import model_arrays
from common.methods.base import HospitalMethod, Payload
from common.tasks.base import ExtraLoss


class LocalTraining(HospitalMethod):
    """Local training of the received model; the reply also carries the received model's validation
    metrics (``val-*``), so no separate evaluation round trip is needed."""

    def extra_loss(self, received: dict) -> ExtraLoss | None:
        """A term added to the task loss (FedProx's proximal term); none for plain local training."""
        return None

    def train(self, rnd: int, payload: Payload) -> Payload:
        model = self.task.model_from_payload(payload)
        return self.train_model(rnd, model, self.extra_loss(payload.arrays["model"]))

    def train_model(self, rnd: int, model: torch.nn.Module, extra_loss: ExtraLoss | None = None,
                    optimizer: torch.optim.Optimizer | None = None) -> Payload:
        """Validate ``model`` as received, train it locally, reply with it (methods that start from
        another model or add terms of their own call this from their ``train``)."""
        self.task.check_data(self.site.train, f"hospital {self.site.name}")
        received = self.task.validate(model, self.site.val, self.site.device)
        fit = self.task.fit if self.dp_sgd is None else partial(self.dp_sgd.fit, self.task)  # policy's patient-dp
        stats = fit(model, self.site.train, self.site.device, self.site.round_seed(rnd), extra_loss=extra_loss,
                    optimizer=optimizer)
        metrics = {"num-examples": len(self.site.train), **stats}
        metrics.update({f"val-{k}": v for k, v in received.items() if k != "num-examples"})
        return Payload(arrays={"model": model_arrays(model)}, metrics=metrics)
