"""FedMEPD (CVPR 2026): federated modality-specific encoders, a partially personalised fusion decoder
and multi-anchor cross-attention (see docs/fedmepd.md and ALGORITHMS.md section 2).

Round r:
1. A hospital builds its model from the server's encoders (its modalities only) and fusion decoder,
   keeping its personal decoder filters, its LACCA layers and its auxiliary decoder from its last
   round (state folder); it scores that model (``val-*``), trains it with LACCA on the server's
   anchors, and uploads its encoders and decoder (personal filters replaced by the values it got).
2. The server averages each modality's encoder over the hospitals that have it (none: keeps its own).
3. It aggregates the decoder per filter with the hospitals' weights and its EMA step.
4. It trains an epoch on its own full-modality cases.
5. After the warm-up it compares, per hospital and filter, the hospital's decoder change with its
   own (cosine): patience counters, irreversible personal masks and weights move.
6. It recomputes the anchors from its cases (K-means once, EMA after).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.arrays import NamedArrays, model_arrays, weighted_average
from common.data.brats import MODALITIES
from common.engine.reply_store import selected
from common.methods.base import HospitalInfo, HospitalUpdate, Payload

from .anchors import MultiAnchors, collect_class_vectors
from .decoder import DECODER, MASK_KEY, STATE_PREFIX, decoder_part, server_decoder_change
from .filter_personalisation import (
    FilterPersonalisation,
    aggregate_filters,
    filter_cosines,
    filter_layers,
    filter_norms,
    kernels_only,
    layer_sizes,
    pack_mask,
    subtract,
)
from .harness import ServerTraining, encoder_prefixes, hospital_average, hospital_modalities


class FedMEPDServer(ServerTraining):
    name = "fedmepd"
    personalise = True   # per-filter personalisation of the decoder
    share_anchors = True  # multi-anchor representations for the hospitals' LACCA

    def __init__(self, cfg, task=None):
        super().__init__(cfg, task)
        self.personalisation: FilterPersonalisation | None = None
        self.anchors = MultiAnchors(cfg.brain.width_tuple, int(self.task.spec.get("num-classes", 4)),
                                    cfg.fedmepd.num_anchors, cfg.fedmepd.anchor_momentum, cfg.seed)
        self._round: dict[str, Any] = {}  # what aggregate leaves for this round's server step

    def initialize(self) -> None:
        super().initialize()
        self.personalisation = FilterPersonalisation(layer_sizes(decoder_part(self.global_arrays)),
                                                     self.cfg.fedmepd.patience, self.cfg.fedmepd.weight_momentum)

    # --- downlink and checks ----------------------------------------------------------------------
    def hospital_arrays(self, modalities: tuple[str, ...]) -> NamedArrays:
        """The global arrays a hospital with ``modalities`` exchanges: its encoders and the decoder."""
        keep = encoder_prefixes(modalities) + (DECODER,)
        return {k: v for k, v in self.global_arrays.items() if k.startswith(keep)}

    def downlink(self, rnd: int, hospital: HospitalInfo) -> Payload:
        arrays = {"model": self.hospital_arrays(hospital_modalities(hospital))}
        if self.share_anchors and self.cfg.fedmepd.lacca and self.anchors.for_hospitals():
            arrays["anchors"] = self.anchors.for_hospitals()
        mask = pack_mask(self.personalisation.mask(hospital.name), self.personalisation.sizes)
        return Payload(arrays=arrays, config={**self.round_config(rnd), MASK_KEY: mask})

    def expected_model(self, update: HospitalUpdate) -> NamedArrays:
        """Only the encoders of the hospital's own modalities (an unknown modality raises ValueError)."""
        return self.hospital_arrays(hospital_modalities(update.hospital))

    # --- aggregation ------------------------------------------------------------------------------
    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        sent = decoder_part(self.global_arrays)
        total = sum(u.weight for u in updates)
        shares = {u.hospital.name: u.weight / total for u in updates}
        contributors = {}
        for modality in MODALITIES:
            having = [u.payload.arrays["model"] for u in updates if modality in hospital_modalities(u.hospital)]
            contributors[modality] = len(having)
            if having:
                prefix = f"encoders.{modality}."
                encoder = [selected(arrays, prefix) for arrays in having]
                self.global_arrays.update(weighted_average(encoder, [1.0] * len(encoder)))
        for name, share in shares.items():  # weights start at 1 (the public code's) or at the sample share;
            # the federated-decoder baseline keeps FedAvg's sample shares
            by_share = not self.personalise or self.cfg.fedmepd.initial_weight == "share"
            self.personalisation.ensure(name, share if by_share else 1.0)
        uploads = [decoder_part(u.payload.arrays["model"]) for u in updates]
        weights = [self.personalisation.weights[u.hospital.name] for u in updates]  # 0 where personal
        decoder, contributed = aggregate_filters(sent, uploads, weights, filter_layers(sent),
                                                 self.cfg.fedmepd.server_momentum)
        self.global_arrays.update(decoder)
        self._round = {"sent": sent, "uploads": dict(zip(shares, uploads)), "shares": shares}
        filters = sum(c.size for c in contributed.values())
        return {"hospital-average": hospital_average(updates), "encoder-contributors": contributors,
                "decoder-filters-aggregated": float(sum(c.sum() for c in contributed.values()) / filters)}

    # --- the server's own step --------------------------------------------------------------------
    def server_step(self, rnd: int) -> dict[str, Any]:
        aggregated = decoder_part(self.global_arrays)
        model, stats = self.train_on_server(rnd)
        self.global_arrays = model_arrays(model)
        metrics: dict[str, Any] = {"server-train-loss": stats["train-loss"]}
        if self.personalise and rnd > self.cfg.fedmepd.warmup_rounds and self._round:
            self.update_personalisation(server_decoder_change(decoder_part(self.global_arrays), self._round["sent"],
                                                              aggregated, self.cfg.fedmepd.server_change_from))
        metrics["personalised"] = {h: self.personalisation.fraction_personal(h) for h in self.personalisation.hospitals}
        metrics["masks"] = {h: list(pack_mask(self.personalisation.mask(h), self.personalisation.sizes))
                            for h in self.personalisation.hospitals}  # the bytes each hospital receives next
        if self.share_anchors and self.cfg.fedmepd.lacca:
            batches = self.task.batches(self.server_cases(), max(2, self.cfg.batch_size), self.device,
                                        np.random.default_rng(self.round_seed(rnd)), train=True)
            metrics.update(self.anchors.update(collect_class_vectors(model, batches, len(self.anchors.ready))))
        self._round = {}
        return metrics

    def update_personalisation(self, server_change: NamedArrays) -> None:
        """Step 5: cosine of each hospital's decoder change with the server's, per filter (on its kernel, or on
        kernel and bias: ``fedmepd.filter-vector``)."""
        layers = filter_layers(server_change)
        if self.cfg.fedmepd.filter_vector == "kernel":
            layers = kernels_only(layers)
        server_norms = filter_norms(server_change, layers)
        for hospital, upload in self._round["uploads"].items():
            change = subtract(upload, self._round["sent"])
            norms = filter_norms(change, layers)
            ratios = {layer: server_norms[layer] / (norms[layer] + 1e-12) for layer in layers}
            self.personalisation.observe(hospital, filter_cosines(server_change, change, layers), ratios,
                                         self._round["shares"][hospital])

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> NamedArrays:
        state = super().state_dict()
        state.update(self.personalisation.state_dict(f"{STATE_PREFIX}personalisation/"))
        state.update(self.anchors.state_dict(f"{STATE_PREFIX}anchors/"))
        return state

    def load_state_dict(self, state: NamedArrays) -> None:
        super().load_state_dict(state)
        self.personalisation.load_state_dict(state, f"{STATE_PREFIX}personalisation/")
        self.anchors.load_state_dict(state, f"{STATE_PREFIX}anchors/")
