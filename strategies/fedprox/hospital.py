"""FedProx (Li et al. 2020): FedAvg plus (mu/2)||w - w_global||^2 in each hospital's loss."""

from __future__ import annotations

import torch

from common.methods.local_training import LocalTraining
from common.tasks.base import ExtraLoss
from common.trust.patient_dp import DATA_FREE, loss_term


def proximal_term(mu: float, global_arrays: dict) -> ExtraLoss:
    anchors: dict[str, torch.Tensor] = {}

    def term(model: torch.nn.Module, *_: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=next(model.parameters()).device)
        for name, parameter in model.named_parameters():
            if name not in anchors:
                anchors[name] = torch.from_numpy(global_arrays[name]).to(parameter.device)
            total = total + (parameter - anchors[name]).pow(2).sum()
        return 0.5 * mu * total

    return loss_term(term, DATA_FREE)  # under patient-dp its gradient is added after the noise (it reads no data)


class FedProxHospital(LocalTraining):
    def extra_loss(self, received: dict) -> ExtraLoss | None:
        return proximal_term(self.cfg.fedprox.mu, received)
