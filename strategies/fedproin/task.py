"""Classification by the nearest learnable prototype (FedProIn's task).

The model is :class:`~common.models.prototype_net.PrototypeNet`, whose output is a class score
(minus the squared distance to the class's nearest prototype); everything that only needs
``argmax`` of the output (prediction, metrics) is the plain classification task's. What differs:
the task loss works on distances (MCEL or MCL, as in Convolutional Prototype Learning), and
training batches are class-balanced with per-class augmentation (``class_balance.py``).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from common.data.containers import LabelledImages
from common.data.torch_data import TorchData
from common.models.prototype_net import PrototypeNet
from common.tasks.base import images_to_tensor, index_batches, random_flips
from common.tasks.classification import ClassificationTask

from .class_balance import augment_by_class, augmentation_probabilities, balanced_draws


def true_and_rival_distances(scores: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From (B, C) scores = -min distance per class: d_y (true class) and d_c (nearest other class)."""
    true = -scores.gather(1, target[:, None]).squeeze(1)
    others = scores.masked_fill(F.one_hot(target, scores.shape[1]).bool(), float("-inf"))
    return true, -others.max(dim=1).values


def minimum_classification_error(scores: torch.Tensor, target: torch.Tensor, xi: float) -> torch.Tensor:
    """MCEL: mean of sigmoid(xi * (d_y - d_c)); near 0 when the true class's prototype is much nearer."""
    true, rival = true_and_rival_distances(scores, target)
    return torch.sigmoid(xi * (true - rival)).mean()


def margin_classification(scores: torch.Tensor, target: torch.Tensor, margin: float) -> torch.Tensor:
    """MCL: mean of relu(d_y - d_c + margin)."""
    true, rival = true_and_rival_distances(scores, target)
    return F.relu(true - rival + margin).mean()


def distance_cross_entropy(scores: torch.Tensor, target: torch.Tensor, gamma: float) -> torch.Tensor:
    """DCE of Convolutional Prototype Learning: cross-entropy on logits -gamma * d_c, d_c the distance to
    class c's nearest prototype. Every class pulls or pushes, as a linear head's cross-entropy does; MCEL
    and MCL look at the nearest rival only."""
    return F.cross_entropy(gamma * scores, target)


class PrototypeClassificationTask(ClassificationTask):
    """Encoder + (C, M, d) prototypes; settings from the job's ``fedproin`` section."""

    name = "classification"

    def build_model(self) -> torch.nn.Module:
        """The network's encoder (its feature vector: ``ClassificationTask.build_encoder``) with (C, M, d)
        prototypes on top."""
        encoder, feature_dim = self.build_encoder()
        return PrototypeNet(encoder, self.num_classes, self.cfg.fedproin.num_prototypes, feature_dim)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        settings = self.cfg.fedproin
        if settings.task_loss == "mcl":
            return margin_classification(output, target, settings.mcl_margin)
        if settings.task_loss == "dce":
            return distance_cross_entropy(output, target, settings.dce_gamma)
        return minimum_classification_error(output, target, settings.mcel_xi)

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """Adam; prototypes may take their own step size and never take weight decay."""
        encoder = [p for name, p in model.named_parameters() if name != "prototypes"]
        step = self.cfg.fedproin.prototype_learning_rate or self.cfg.learning_rate
        return torch.optim.Adam([{"params": encoder, "weight_decay": self.cfg.weight_decay},
                                 {"params": [model.prototypes], "lr": step, "weight_decay": 0.0}],
                                lr=self.cfg.learning_rate)

    def batches(self, data: LabelledImages, batch_size: int, device: torch.device, rng: np.random.Generator | None,
                train: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Evaluation batches as usual; training batches class-balanced and augmented per class.

        An epoch draws as many samples as the hospital holds, so it costs what a FedAvg epoch costs
        (``epoch-draws='max-class'``: n_max x classes present, as the public code).
        """
        settings = self.cfg.fedproin
        if not train or rng is None or not (settings.class_balanced or settings.class_augmentation):
            yield from super().batches(data, batch_size, device, rng, train)
            return
        counts = data.class_counts()
        if settings.class_balanced:
            draws = len(data) if settings.epoch_draws == "samples" else int(counts.max()) * np.count_nonzero(counts)
            order = balanced_draws(data.labels, draws, rng)
        else:
            order = rng.permutation(len(data))
        probabilities = augmentation_probabilities(counts) if settings.class_augmentation else None
        batches = [order[positions] for positions in index_batches(len(order), batch_size, None, drop_last=True)]
        if isinstance(data, TorchData):  # a data set of the consortium's own: its transforms flip and crop
            pairs = data.batches(batches, device)
        else:
            pairs = ((random_flips(rng, images_to_tensor(data.images[index], device))[0],
                      torch.from_numpy(data.labels[index]).to(device)) for index in batches)
        for x, y in pairs:
            if probabilities is not None:
                x = augment_by_class(x, y.cpu().numpy(), probabilities, rng)
            yield x, y
