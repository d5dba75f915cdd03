"""FedMEPD's settings: the ``[fedmepd]`` run-config table and ``FedMEPDStrategy``'s own arguments."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.settings import Section


class FedMEPDSettings(Section):
    """FedMEPD (docs/fedmepd.md): partial personalisation of the fusion decoder and multi-anchor LACCA."""

    patience: int = Field(10, ge=0, description="P: rounds of negative cosine in a row before a filter turns personal.")
    warmup_rounds: int = Field(30, ge=0, description="Rounds before patience counters and weights start to move.")
    server_momentum: float = Field(0.3, ge=0.0, le=1.0,
                                   description="lambda: server decoder = lambda*server + (1-lambda)*hospitals.")
    weight_momentum: float = Field(0.95, ge=0.0, lt=1.0, description="EMA of the per-filter hospital weights.")
    num_anchors: int = Field(4, ge=1, description="N_k: anchors per class and scale (K-means clusters).")
    anchor_momentum: float = Field(0.999, ge=0.0, le=1.0, description="EMA of the anchors after their K-means start.")
    lacca: bool = Field(True, description="Hospitals calibrate decoder features with the anchors (false: ablation).")
    server_change_from: Literal["sent", "aggregated"] = Field("sent", description=(
        "The server's decoder change delta_s is its trained decoder minus the decoder it held before "
        "aggregating ('sent', the public code's) or minus the aggregate ('aggregated', this project's first rule)."))
    initial_weight: Literal["one", "share"] = Field("one", description=(
        "A hospital's filter weights start at 1, an unweighted mean until the warm-up ends (the public code's), "
        "or at its share of the round's samples."))
    filter_vector: Literal["kernel", "kernel-and-bias"] = Field("kernel", description=(
        "What a filter's cosine and norms are computed on: its kernel (the public code's) or kernel and bias."))
