"""FedProIn's settings: the ``[fedproin]`` run-config table and ``FedProInStrategy``'s own arguments, one source."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.settings import Section


class FedProInSettings(Section):
    """FedProIn (docs/fedproin.md).

    Ablations: fdl-weight=0 (no FDL), pcl-weight=0 (no PCL), aggregation='fedavg' (no NIA)."""

    num_prototypes: int = Field(2, ge=1, le=4, description="M, learnable prototypes per class (paper: 2 on HAM10000).")
    task_loss: Literal["dce", "mcel", "mcl"] = Field("dce", description=(
        "Distance-based cross-entropy over all classes (default, docs/fedproin.md has the measurements), or the "
        "paper's minimum classification error, or the margin loss."))
    mcel_xi: float = Field(0.05, gt=0.0, description="xi in sigmoid(xi * (d_true - d_rival)), squared distances.")
    mcl_margin: float = Field(0.5, ge=0.0, description="Margin of the MCL loss relu(d_true - d_rival + margin).")
    dce_gamma: float = Field(0.05, gt=0.0, description="gamma in cross-entropy(-gamma * d_class), squared distances.")
    fdl_weight: float = Field(1.0, ge=0.0, description="lambda_FDL: feature divergence loss (0: off).")
    pcl_weight: float = Field(1.0, ge=0.0, description="lambda_PCL: prototype contrastive loss (0: off).")
    pcl_margin: float = Field(0.5, ge=0.0, description="m in relu((d_glob - d_prev) / (d_glob + d_prev) + m).")
    aggregation: Literal["nia", "fedavg"] = Field("nia", description="Prototypes by normalised influence or FedAvg.")
    class_balanced: bool = Field(False, description=(
        "Draw training samples class-balanced, with replacement (the paper's; off by default, docs/fedproin.md)."))
    class_augmentation: bool = Field(False, description="Augment class c with probability 1 - n_c / n_max (paper's).")
    prototype_learning_rate: float = Field(0.0, ge=0.0, description="Adam step for prototypes; 0: learning-rate.")
    prototype_init: Literal["normal", "class-means", "feature-moments"] = Field("normal", description=(
        "Prototypes at the start: N(0, 1) from the server (paper); or, at each hospital of round 1, K-means "
        "centres of its class-c features under the received encoder ('class-means'), or N(0, 1) scaled and "
        "shifted to its features' per-dimension std and mean ('feature-moments')."))
    keep_optimizer_state: bool = Field(False, description=(
        "Keep a hospital's Adam moments from one of its rounds to the next (public code), in its state store."))
    epoch_draws: Literal["samples", "max-class"] = Field("samples", description=(
        "Class-balanced draws per epoch: as many as the hospital's samples (a FedAvg epoch's cost), or "
        "n_max x classes present (public code)."))
    reseed_after: int = Field(0, ge=0, description=(
        "Re-seed a prototype that no hospital's samples chose for this many rounds in a row (0: never)."))
    reseed_rule: Literal["split", "far-sample"] = Field("split", description=(
        "How: the server copies the class's most-used prototype (plus 1 % noise), or ('far-sample') each receiving "
        "hospital puts it at its class sample farthest from the class's prototypes."))
