"""FedProIn's server half: the encoder (and BatchNorm buffers) by FedAvg over sample counts, the prototypes by
Normalised Influence Aggregation; a prototype nobody used keeps its previous global value (or, with
``reseed-after``, is re-seeded once it stayed unused that many rounds)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from common.arrays import is_exchanged, model_arrays, weighted_average
from common.config import JobConfig
from common.methods.base import HospitalUpdate, NamedArrays, RejectedUpdate, ServerMethod
from common.tasks import Task, get_task

from .messages import INFLUENCE, RESEED
from .task import PrototypeClassificationTask

log = logging.getLogger("fedmed")


def split_busiest(prototypes: np.ndarray, usage: np.ndarray, dead: np.ndarray, seed: int) -> np.ndarray:
    """Each dead prototype (c, k) becomes a copy of its class's most-used prototype plus a step of 1 % of that
    prototype's spread: the two then share that prototype's samples. Nothing moves near another class, which
    a re-seed at a sample's feature does (features and learned prototypes need not lie at the same scale)."""
    result = prototypes.copy()
    rng = np.random.default_rng(seed)
    for c, k in zip(*np.nonzero(dead)):
        busiest = result[c, int(np.argmax(usage[c]))]
        result[c, k] = busiest + 0.01 * busiest.std() * rng.standard_normal(busiest.shape).astype(result.dtype)
    return result


def normalised_influence_aggregation(prototypes: Iterable[np.ndarray], influences: list[np.ndarray],
                                     previous: np.ndarray) -> np.ndarray:
    """NIA: P[c, k] = sum_i I_i[c, k] P_i[c, k] / sum_i I_i[c, k]; ``previous[c, k]`` where that sum is 0.

    The sum goes hospital by hospital (``prototypes`` may read each from disk), in float64 from zero, as
    ``np.einsum("hcm,hcmd->cmd")`` over the stacked replies adds them: the same values bit for bit (influences are
    whole counts, so each product is exact), without every hospital's prototypes in memory at once."""
    weights = np.stack(influences).astype(np.float64)  # (H, C, M): counts, small
    total = weights.sum(axis=0)
    weighted = np.zeros(previous.shape, dtype=np.float64)
    for weight, hospital_prototypes in zip(weights, prototypes, strict=True):
        weighted += weight[..., None] * np.asarray(hospital_prototypes, dtype=np.float64)
    result = previous.astype(np.float64)
    used = total > 0
    result[used] = weighted[used] / total[used][:, None]
    return result.astype(previous.dtype)


class FedProInServer(ServerMethod):
    name = "fedproin"
    list_metrics = frozenset({INFLUENCE})

    def __init__(self, cfg: JobConfig, task: Task | None = None):
        spec = (task or get_task(cfg)).spec
        super().__init__(cfg, PrototypeClassificationTask(cfg, spec))

    def initialize(self) -> None:
        """Encoder (optionally a pretrained one, ``encoder-weights``) and N(0, 1) prototypes, seeded by the job."""
        torch.manual_seed(self.cfg.seed)
        self.global_arrays = model_arrays(self.task.initial_model())
        self.unused_rounds = np.zeros(self.global_arrays["prototypes"].shape[:2], dtype=np.int64)

    def model_from_network(self, arrays: NamedArrays) -> NamedArrays | None:
        """The encoder from the network's own state (every entry but its last linear layer's, which the prototypes
        replace), the prototypes as initialised; None unless ``arrays`` are that network's. A ``state_dict()``'s
        local-only counters (BatchNorm's ``num_batches_tracked``) may be there or not: they are never exchanged."""
        encoder = {name.removeprefix("encoder."): name for name in self.global_arrays if name != "prototypes"}
        head = {name for name in arrays if is_exchanged(name)} - set(encoder)
        if not set(encoder) <= set(arrays) or len({name.rpartition(".")[0] for name in head}) != 1:
            return None
        return {**{model: arrays[own] for own, model in encoder.items()},
                "prototypes": self.global_arrays["prototypes"]}

    def due_for_reseeding(self) -> np.ndarray:
        """(C, M) mask of the prototypes no hospital's samples chose for ``reseed-after`` rounds in a row."""
        after = self.cfg.fedproin.reseed_after
        return self.unused_rounds >= after if after else np.zeros_like(self.unused_rounds, dtype=bool)

    def round_config(self, rnd: int) -> dict[str, Any]:
        config = super().round_config(rnd)
        if self.cfg.fedproin.reseed_rule != "far-sample":
            return config
        due = np.flatnonzero(self.due_for_reseeding())
        if due.size:
            config[RESEED] = due.tolist()
        return config

    def influence(self, update: HospitalUpdate) -> np.ndarray:
        """The reply's influence matrix as (classes, prototypes per class)."""
        counts = np.asarray(update.payload.metrics[INFLUENCE])
        return counts.reshape(self.global_arrays["prototypes"].shape[:2])

    def check(self, update: HospitalUpdate) -> None:
        super().check(update)
        raw = update.payload.metrics.get(INFLUENCE)
        if raw is None:
            raise RejectedUpdate(f"reply carries no influence matrix (metric {INFLUENCE!r})")
        if not isinstance(raw, (list, tuple, np.ndarray)):
            raise RejectedUpdate(f"influence matrix is {type(raw).__name__}, expected a list of counts")
        expected = self.global_arrays["prototypes"].shape[:2]
        if np.asarray(raw).size != expected[0] * expected[1]:
            raise RejectedUpdate(f"influence matrix has {np.asarray(raw).size} entries, expected shape {expected} "
                                 "(classes, prototypes per class)")
        influence = self.influence(update)
        if influence.dtype.kind not in "iuf":
            raise RejectedUpdate(f"influence matrix has dtype {influence.dtype}, expected counts")
        counts = influence.astype(np.float64)  # no int64 arithmetic on hostile numbers: 2**62 + 2**62 wraps to < 0
        if not np.isfinite(counts).all():
            raise RejectedUpdate("influence matrix holds NaN or Inf")
        if (counts < 0).any():
            raise RejectedUpdate(f"influence matrix holds negative counts (smallest {counts.min():.6g})")
        if (counts != np.floor(counts)).any():
            raise RejectedUpdate("influence matrix holds fractional counts")
        if counts.max() > update.num_examples or counts.sum() > update.num_examples:
            raise RejectedUpdate(f"influence matrix counts {counts.sum():.6g} samples, more than the "
                                 f"{update.num_examples} the hospital trained on")

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        models = [u.payload.arrays["model"] for u in updates]
        influences = [self.influence(u) for u in updates]
        arrays = weighted_average(models, [u.weight for u in updates])
        if self.cfg.fedproin.aggregation == "nia":
            arrays["prototypes"] = normalised_influence_aggregation(
                (m["prototypes"] for m in models), influences, self.global_arrays["prototypes"])
        record = self.settle(rnd, arrays, np.sum(influences, axis=0))
        return {"influence": {u.hospital.name: i.tolist() for u, i in zip(updates, influences)}, **record}

    def settle(self, rnd: int, arrays: dict[str, np.ndarray], usage: np.ndarray) -> dict[str, Any]:
        """The round's model (``arrays``) and how many samples used each prototype (``usage``, summed over the
        hospitals, the same whether summed securely or not) into the global state: unused prototypes counted,
        re-seeded when due."""
        self.global_arrays = arrays
        unused = self.prototype_names(usage == 0)
        if unused:
            log.info("round %d: prototypes no hospital used (kept or averaged as configured): %s", rnd,
                     ", ".join(unused))
        far_sample = self.cfg.fedproin.reseed_rule == "far-sample"
        reseeded = self.prototype_names(self.due_for_reseeding()) if far_sample else []  # sent this round
        self.unused_rounds = np.where(usage == 0, self.unused_rounds + 1, 0)
        due = self.due_for_reseeding() & (usage.sum(axis=1, keepdims=True) > 0)  # a class someone used
        if not far_sample and due.any():
            self.global_arrays["prototypes"] = split_busiest(self.global_arrays["prototypes"], usage, due,
                                                             self.cfg.seed + rnd)
            reseeded = self.prototype_names(due)
            self.unused_rounds[due] = 0
        return {"prototype-usage": usage.tolist(), "unused-prototypes": unused,
                **({"reseeded-prototypes": reseeded} if reseeded else {})}

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**super().state_dict(), "fedproin/unused-rounds": self.unused_rounds}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        shape = self.global_arrays["prototypes"].shape[:2]
        self.unused_rounds = state.get("fedproin/unused-rounds", np.zeros(shape, dtype=np.int64)).copy()

    def prototype_names(self, mask: np.ndarray) -> list[str]:
        """'<class>#<k>' for the prototypes where ``mask`` (C, M) is set."""
        names = str(self.task.spec.get("class-names", "")).split(",")
        if len(names) != mask.shape[0]:
            names = [str(c) for c in range(mask.shape[0])]
        return [f"{names[c]}#{k}" for c, k in zip(*np.nonzero(mask))]
