"""FedProIn: learnable multi-prototype classification with influence-weighted prototype aggregation.

Hospital: trains encoder + prototypes on its class-balanced, augmented data with the task loss
(MCEL or MCL on prototype distances), plus the feature divergence loss (FDL: MSE to a frozen copy
of the received encoder) and the prototype contrastive loss (PCL: closer to the received global
prototypes than to its own prototypes of the last round it trained in, kept in its state store).
It replies with the model and its influence matrix: how many of its class-c training samples have
each class-c prototype as their nearest.

Server: encoder (and BatchNorm buffers) by FedAvg over sample counts; prototypes by Normalised
Influence Aggregation; a prototype nobody used keeps its previous global value (or, with
``reseed-after``, is re-seeded once it stayed unused that many rounds).
Options measured against the paper's choices (docs/fedproin.md): prototypes initialised from the
round-1 hospitals' features, Adam moments kept across a hospital's rounds, the public code's epoch length.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from common.config import JobConfig
from common.methods.base import Payload
from common.methods.local_training import LocalTraining
from common.methods.site import Site
from common.models.prototype_net import squared_distances
from common.models.representations import FeatureTap, frozen_copy
from common.tasks import Task
from common.tasks.base import ExtraLoss
from common.trust.patient_dp import split_term

from .messages import INFLUENCE, RESEED
from .optimizer_state import optimizer_arrays, restore_optimizer
from .settings import FedProInSettings
from .task import PrototypeClassificationTask

log = logging.getLogger("fedmed")


# --- the method's pieces, as plain functions -------------------------------------------------------
def prototype_contrastive_loss(local: torch.Tensor, global_: torch.Tensor, previous: torch.Tensor,
                               margin: float) -> torch.Tensor:
    """PCL, per prototype: relu((d_glob - d_prev) / (d_glob + d_prev + 1e-8) + margin), averaged.

    d_glob = ||P_global - P_local||, d_prev = ||P_previous - P_local||: zero once each local
    prototype is nearer the global one than its own previous value, by a ratio set by the margin.
    """
    d_glob = torch.linalg.vector_norm(global_ - local, dim=-1)
    d_prev = torch.linalg.vector_norm(previous - local, dim=-1)
    return F.relu((d_glob - d_prev) / (d_glob + d_prev + 1e-8) + margin).mean()


@torch.no_grad()
def influence_counts(model: torch.nn.Module, task: Task, data, device: torch.device) -> np.ndarray:
    """(C, M) int64: I[c, k] = number of class-c samples of ``data`` whose nearest class-c prototype is k.

    Counted once per sample (eval mode, no augmentation), so each row sums to the hospital's number of samples
    of that class. The paper counts with the trained local model; under a policy's local DP the hospital counts
    with the model it received, which its data did not shape, so one sample replaced by another moves at most two
    counts by one (L2 sqrt(2), the sensitivity the policy's accounting assumes; with the trained model one
    replaced image moved them by L2 2).
    """
    classes, per_class = model.prototypes.shape[:2]
    counts = np.zeros((classes, per_class), dtype=np.int64)
    model.to(device).eval()
    for x, y in task.batches(data, 256, device, None, train=False):
        own_class = model.distances(x)[torch.arange(len(y), device=device), y]  # (B, M)
        np.add.at(counts, (y.cpu().numpy(), own_class.argmin(dim=1).cpu().numpy()), 1)
    return counts


@torch.no_grad()
def encoder_features(model: torch.nn.Module, task: Task, data, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """(N, d) features of every sample of ``data`` under the model's encoder (eval mode), and their labels."""
    model.to(device).eval()
    features, labels = [], []
    for x, y in task.batches(data, 256, device, None, train=False):
        features.append(model.encoder(x))
        labels.append(y.cpu().numpy())
    return torch.cat(features), np.concatenate(labels)


def class_means(features: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """(M, d) K-means centres of one class's features, the largest cluster first (fewer samples than M:
    the mean, split by a small step along the features' spread so the M prototypes differ)."""
    from sklearn.cluster import KMeans

    if len(features) >= per_class:
        fitted = KMeans(n_clusters=per_class, n_init=3, random_state=seed).fit(features)
        order = np.argsort(-np.bincount(fitted.labels_, minlength=per_class), kind="stable")
        return fitted.cluster_centers_[order]
    spread = features.std(axis=0) if len(features) > 1 else np.ones(features.shape[1])
    steps = np.random.default_rng(seed).standard_normal((per_class, features.shape[1]))
    return features.mean(axis=0) + 0.1 * spread * steps


@torch.no_grad()
def initialise_prototypes(model: torch.nn.Module, task: Task, data, rule: str, device: torch.device,
                          seed: int) -> list[int]:
    """Move the received N(0, 1) prototypes where this hospital's features are (round 1 only).

    'class-means': the K-means centres of each class present here; 'feature-moments': mu + sigma * P
    with the per-dimension mean and std of all its features, so every hospital scales the same N(0, 1)
    draws. Returns the classes whose prototypes were set."""
    features, labels = encoder_features(model, task, data, device)
    prototypes = model.prototypes.data
    if rule == "feature-moments":
        mean, std = features.mean(0), features.std(0) if len(features) > 1 else torch.ones_like(features[0])
        prototypes.copy_(mean + std * prototypes)
        return list(range(prototypes.shape[0]))
    present = sorted(set(labels.tolist()))
    for c in present:
        centres = class_means(features[torch.from_numpy(labels == c).to(device)].cpu().numpy().astype(np.float64),
                              prototypes.shape[1], seed + c)
        prototypes[c] = torch.from_numpy(centres).to(prototypes)
    return present


@torch.no_grad()
def reseed_prototypes(model: torch.nn.Module, task: Task, data, flat_indices: list[int],
                      device: torch.device) -> list[int]:
    """Put each listed prototype (class c, index k) at this hospital's class-c sample farthest from its nearest
    class-c prototype: a prototype nobody chose takes the worst-served sample, the start of a new cluster.
    Classes this hospital does not hold are left as received. Returns the indices it re-seeded."""
    features, labels = encoder_features(model, task, data, device)
    per_class = model.prototypes.shape[1]
    done = []
    for index in flat_indices:
        c, k = divmod(int(index), per_class)
        mine = torch.from_numpy(labels == c).to(device)
        if not bool(mine.any()):
            continue
        own = features[mine]
        nearest = squared_distances(own, model.prototypes[c:c + 1]).min(dim=2).values.squeeze(1)
        model.prototypes.data[c, k] = own[int(nearest.argmax())]
        done.append(int(index))
    return done


def fedproin_regulariser(model: torch.nn.Module, settings: FedProInSettings, previous_prototypes: np.ndarray | None,
                         device: torch.device) -> tuple[ExtraLoss | None, FeatureTap | None]:
    """lambda_FDL * FDL + lambda_PCL * PCL for the model as received (PCL only with previous prototypes).

    Returns the term and the feature tap it reads (remove it after training), or (None, None)."""
    use_fdl = settings.fdl_weight > 0
    use_pcl = settings.pcl_weight > 0 and previous_prototypes is not None
    if not (use_fdl or use_pcl):
        return None, None
    reference = frozen_copy(model.encoder).to(device) if use_fdl else None  # before the tap: copies carry hooks
    tap = FeatureTap(model.encoder) if use_fdl else None
    global_prototypes = model.prototypes.detach().clone().to(device)
    previous = torch.from_numpy(previous_prototypes).to(device) if use_pcl else None

    def fdl(_net: torch.nn.Module, x: torch.Tensor, _y: torch.Tensor, _output: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            reference_features = reference(x)
        return settings.fdl_weight * F.mse_loss(tap.value, reference_features)  # a batch mean of each image's own

    def pcl(net: torch.nn.Module, *_unused) -> torch.Tensor:  # of the prototypes alone
        return settings.pcl_weight * prototype_contrastive_loss(net.prototypes, global_prototypes, previous,
                                                                settings.pcl_margin)

    return split_term(fdl if use_fdl else None, pcl if use_pcl else None), tap


def withheld_influence(model: torch.nn.Module, samples: int) -> np.ndarray:
    """The influence counts a hospital training under patient-level DP-SGD sends: its samples spread evenly over the
    prototypes, so that nothing but the DP-trained model and its sample count tells of its data (the counts, one per
    sample, would need noise and a budget of their own); the server's influence weighting then weighs each
    hospital's prototypes by its size, as FedAvg does."""
    classes, per_class = model.prototypes.shape[:2]
    return np.full((classes, per_class), samples // (classes * per_class), dtype=np.int64)


class FedProInHospital(LocalTraining):
    def __init__(self, cfg: JobConfig, site: Site, task: Task | None = None):
        super().__init__(cfg, site, PrototypeClassificationTask(cfg, task.spec if task else None))

    def train(self, rnd: int, payload: Payload) -> Payload:
        settings, device = self.cfg.fedproin, self.site.device
        model = self.task.model_from_payload(payload)
        patient_dp = self.dp_sgd is not None  # nothing but DP-SGD may read its data: no prototype placed on features
        if rnd == 1 and settings.prototype_init != "normal" and not patient_dp:
            initialise_prototypes(model, self.task, self.site.train, settings.prototype_init, device,
                                  self.site.round_seed(rnd))
        if payload.config.get(RESEED) and not patient_dp:
            reseed_prototypes(model, self.task, self.site.train, list(payload.config[RESEED]), device)
        term, tap = fedproin_regulariser(model, settings, self.previous_prototypes(rnd, model), device)
        optimizer = self.task.make_optimizer(model)
        if settings.keep_optimizer_state:
            restore_optimizer(optimizer, self.site.state.load(before_round=rnd) or {}, f"hospital {self.site.name}")
        reply = self.train_model(rnd, model, term, optimizer)
        if tap is not None:
            tap.remove()
        if patient_dp:
            counts = withheld_influence(model, len(self.site.train))
        else:
            counted = self.task.model_from_payload(payload) if self.privacy_bounded else model
            counts = influence_counts(counted, self.task, self.site.train, device)
        reply.metrics[INFLUENCE] = counts.ravel().tolist()
        kept = optimizer_arrays(optimizer) if settings.keep_optimizer_state else {}
        self.site.state.save(rnd, {"prototypes": reply.arrays["model"]["prototypes"], **kept})
        return reply

    def previous_prototypes(self, rnd: int, model: torch.nn.Module) -> np.ndarray | None:
        """This hospital's prototypes at the end of the last round it trained in (None the first time)."""
        memory = self.site.state.load(before_round=rnd) or {}
        previous = memory.get("prototypes")
        if previous is not None and previous.shape != tuple(model.prototypes.shape):
            log.warning("hospital %s: saved prototypes have shape %s, the model's %s; PCL starts afresh",
                        self.site.name, previous.shape, tuple(model.prototypes.shape))
            return None
        return previous
