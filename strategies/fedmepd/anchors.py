"""FedMEPD's multimodal anchors: per class and decoder scale, N_k representative features of the
server's full-modality data, which hospitals attend to with LACCA.

Every server crop gives, for each class present in it, one vector per scale: the fusion decoder's
feature (before LACCA) averaged over the class's voxels. The class mask is average-pooled to the
feature's resolution, which is exactly the masked mean of the feature upsampled by nearest
neighbour (the public code's way) at a fraction of the cost.

The first round a class has at least N_k vectors, K-means (scikit-learn) on its bottleneck
vectors makes N_k clusters and each scale's anchors are its clusters' mean vectors. Afterwards a
vector joins the cluster of its nearest bottleneck anchor, and each cluster that received vectors
moves by an EMA, ``A <- m A + (1 - m) mean``. (The public code fixes each training *case*'s cluster
by name instead; nearest-anchor assignment needs no bookkeeping per case and also works when the
server has fewer cases than anchors.)
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.cluster import KMeans

ClassVectors = list[tuple[int, list[np.ndarray]]]  # (class, one vector per scale), finest scale first


def class_vectors(features: list[torch.Tensor], labels: torch.Tensor, num_classes: int) -> ClassVectors:
    """Masked average pooling of each scale's features (B, C_s, ...) over each class present in each crop."""
    one_hot = F.one_hot(labels.long(), num_classes).permute(0, 4, 1, 2, 3).float()
    pooled = [F.adaptive_avg_pool3d(one_hot, f.shape[2:]) for f in features]  # class share of each feature voxel
    vectors: ClassVectors = []
    for b in range(labels.shape[0]):
        for c in range(num_classes):
            if not one_hot[b, c].any():
                continue
            per_scale = []
            for f, share in zip(features, pooled):
                weight = share[b, c]
                per_scale.append(((f[b].float() * weight).sum(dim=(1, 2, 3)) / weight.sum()).cpu().numpy())
            vectors.append((c, per_scale))
    return vectors


@torch.no_grad()
def collect_class_vectors(model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                          num_classes: int) -> ClassVectors:
    """Class vectors of every crop in ``batches`` from the model's decoder features."""
    model.eval()
    vectors: ClassVectors = []
    for x, y in batches:
        vectors += class_vectors(model.decoder_features(x), y, num_classes)
    return vectors


class MultiAnchors:
    """N_k anchors per class and scale: a K-means start, then EMA updates of the cluster means."""

    def __init__(self, widths: tuple[int, ...], num_classes: int, num_anchors: int, momentum: float, seed: int = 0):
        self.num_classes = num_classes
        self.num_anchors = num_anchors
        self.momentum = momentum
        self.seed = seed
        self.anchors = [np.zeros((num_classes * num_anchors, w), np.float32) for w in widths]
        self.ready = np.zeros(num_classes, bool)

    def rows(self, c: int) -> slice:
        return slice(c * self.num_anchors, (c + 1) * self.num_anchors)

    def update(self, vectors: ClassVectors) -> dict[str, float]:
        """Fold one round's vectors in; returns how many vectors each class had."""
        counts = {}
        for c in range(self.num_classes):
            mine = [v for cls, v in vectors if cls == c]
            counts[f"anchor-vectors/{c}"] = float(len(mine))
            if not mine:
                continue
            scales = [np.stack([v[s] for v in mine]) for s in range(len(self.anchors))]
            if self.ready[c]:
                distances = ((scales[-1][:, None] - self.anchors[-1][self.rows(c)][None]) ** 2).sum(-1)
                clusters = distances.argmin(axis=1)
                for j in np.unique(clusters):
                    row = c * self.num_anchors + j
                    for s, values in enumerate(scales):
                        mean = values[clusters == j].mean(axis=0)
                        self.anchors[s][row] = self.momentum * self.anchors[s][row] + (1 - self.momentum) * mean
            elif len(mine) >= self.num_anchors:
                clusters = KMeans(self.num_anchors, n_init=10, random_state=self.seed).fit_predict(scales[-1])
                for j in range(self.num_anchors):
                    members = clusters == j
                    for s, values in enumerate(scales):  # an empty cluster (duplicate vectors) takes the class mean
                        self.anchors[s][c * self.num_anchors + j] = (values[members].mean(0) if members.any()
                                                                     else values.mean(0))
                self.ready[c] = True
        return counts

    def for_hospitals(self) -> dict[str, np.ndarray]:
        """The anchors of the classes that have them, per scale (``scale0`` finest); empty before any."""
        if not self.ready.any():
            return {}
        keep = np.concatenate([np.arange(self.rows(c).start, self.rows(c).stop) for c in np.flatnonzero(self.ready)])
        return {f"scale{s}": a[keep] for s, a in enumerate(self.anchors)}

    def state_dict(self, prefix: str) -> dict[str, np.ndarray]:
        state = {f"{prefix}scale{s}": a.copy() for s, a in enumerate(self.anchors)}
        state[f"{prefix}ready"] = self.ready.astype(np.uint8)
        return state

    def load_state_dict(self, state: dict[str, np.ndarray], prefix: str) -> None:
        self.anchors = [state[f"{prefix}scale{s}"].astype(np.float32) for s in range(len(self.anchors))]
        self.ready = state[f"{prefix}ready"].astype(bool)
