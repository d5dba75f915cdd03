"""FedMEPD under secure aggregation (and its federated-decoder baseline; the
shared-encoder FedAvg baseline sums as FedAvg does, ``MEAN_UPDATE``): each modality's
encoder summed over the hospitals that have it, the decoder per filter over the hospitals that share that filter
(the others keep it personal), each weighted by the hospital's own weight (docs/secure-aggregation.md, "What each
method sums"). Who has which modality and who shares which filter is in the round plan, the same for every hospital:
each checks its own modalities there and that every summed part holds at least its min-hospitals-per-sum
hospitals. The per-filter personalisation stays as it was: its rule needs each hospital's decoder change."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from common.payload import Payload
from common.trust.secure_aggregation.messages import NORM_BOUND_KEY, OWN_NAME_KEY, PREFIX, WEIGHT_CAP_KEY
from common.trust.secure_aggregation.methods import (
    Contribution,
    MethodPlan,
    SecureMethod,
    clip_update,
    common_weight_cap,
    declared_weights,
    float_names,
    model_change,
    own_weight,
)
from common.trust.secure_aggregation.vector import Entry, Layout

if TYPE_CHECKING:
    from common.methods.base import HospitalInfo

MODALITIES_KEY = PREFIX + "modalities"  #: hospital name -> the modalities it declared (each checks its own)
FILTER_MASKS_KEY = PREFIX + "shared-filters"  #: hospital name -> per decoder filter, 1 if it shares it, 0 if personal
BY_SAMPLES_KEY = PREFIX + "filters-by-samples"  #: decoder filters weighted by each hospital's own weight (else 1)
ENCODERS = "encoders."
FILTER_WEIGHT = "filter-weight/"  #: + a decoder layer: the sum of the weights behind each of its filters


def modality_of(name: str) -> str:
    return name[len(ENCODERS):].split(".", 1)[0]


class FedMEPDSecure(SecureMethod):
    """FedMEPD's and its federated-decoder baseline's sums: each modality's encoder, the decoder per filter."""

    def plan(self, method, hospitals, settings, norm_bound) -> MethodPlan:
        """Each modality's encoder as the sum of the updates of the hospitals that have it (a modality only one chosen
        hospital has stays out: its sum would be that hospital's update), the decoder per filter as the sum of w_i x
        the update of filter f over the hospitals that share f, and per filter the sum of their w_i."""
        from strategies.fedmepd.decoder import DECODER
        from strategies.fedmepd.filter_personalisation import filter_layers
        from strategies.fedmepd.harness import hospital_modalities

        arrays = method.global_arrays
        having = {h.name: sorted(hospital_modalities(h)) for h in hospitals}
        shared = sorted(m for m in {m for ms in having.values() for m in ms}
                        if sum(m in ms for ms in having.values()) >= 2)
        encoders = [n for n in float_names(arrays) if n.startswith(ENCODERS) and modality_of(n) in shared]
        decoder = [n for n in float_names(arrays) if n.startswith(DECODER)]
        layers = filter_layers({n: arrays[n] for n in decoder})
        sizes = {layer: int(np.shape(arrays[names[0]])[0]) for layer, names in layers.items()}
        layout = Layout((*(Entry(f"model/{n}", tuple(np.shape(arrays[n]))) for n in encoders + decoder),
                         *(Entry(f"{FILTER_WEIGHT}{layer}", (size,)) for layer, size in sizes.items())))
        masks = {}
        for hospital in hospitals:  # a filter the server's per-filter weight leaves at 0 is personal to the hospital
            known = method.personalisation.weights.get(hospital.name)
            masks[hospital.name] = [int(v) for layer, size in sizes.items()
                                    for v in (np.asarray(known[layer]) > 0 if known is not None else np.ones(size))]
        parts = {f"encoder {m}": sorted(h for h, ms in having.items() if m in ms) for m in shared}
        offset = 0
        for layer, size in sizes.items():
            groups: dict[tuple[str, ...], list[int]] = {}
            for f in range(size):
                groups.setdefault(tuple(sorted(h for h in masks if masks[h][offset + f])), []).append(f)
            for index, (sharers, filters) in enumerate(sorted(groups.items())):
                parts[f"{layer} filters group {index} ({len(filters)} filters)"] = list(sharers)
            offset += size
        by_samples = not method.personalise or method.cfg.fedmepd.initial_weight == "share"
        cap = common_weight_cap(method.cfg, hospitals)
        common = {NORM_BOUND_KEY: float(norm_bound), WEIGHT_CAP_KEY: cap, MODALITIES_KEY: having,
                  FILTER_MASKS_KEY: masks, BY_SAMPLES_KEY: by_samples}
        return MethodPlan(layout, settings.modulus_range, settings.quantization_range, common,
                          {"modalities": having, "shared": shared, "layers": layers,
                           "initial": (declared_weights(hospitals, cap) if by_samples
                                       else {h.name: 1.0 for h in hospitals})},
                          parts)

    def check_plan(self, plan: Mapping[str, Any], name: str, received: Payload, reply: Payload) -> str | None:
        """The plan must state this hospital's modalities as it trained them (the encoders its reply holds)."""
        trained = sorted({modality_of(n) for n in reply.arrays.get("model", {}) if n.startswith(ENCODERS)})
        stated = sorted((plan.get(MODALITIES_KEY) or {}).get(name, []))
        if trained and stated != trained:
            return f"it states this hospital's modalities as {stated}, but it trained the encoders of {trained}"
        return None

    def contribution(self, received: Payload, reply: Payload, params: Mapping[str, Any],
                             layout: Layout) -> Contribution:
        from strategies.fedmepd.decoder import DECODER
        from strategies.fedmepd.filter_personalisation import filter_layers

        model_in, model_out = received.arrays.get("model", {}), reply.arrays.get("model", {})
        names = [n.removeprefix("model/") for n in layout.names if n.startswith("model/")]
        own = [n for n in names if n in model_in]  # the encoders of modalities it lacks: zeros
        change, clipped = clip_update(model_change(model_in, model_out, own), float(params[NORM_BOUND_KEY]))
        shapes = {e.name.removeprefix("model/"): e.shape for e in layout.entries}
        layers = filter_layers({n: np.zeros(shapes[n]) for n in names if n.startswith(DECODER)})
        weight = own_weight(reply, params) if params.get(BY_SAMPLES_KEY) else 1.0
        row = np.asarray((params.get(FILTER_MASKS_KEY) or {}).get(params.get(OWN_NAME_KEY), []), dtype=np.float64)
        if row.size != sum(shapes[ns[0]][0] for ns in layers.values()) or not np.isin(row, (0.0, 1.0)).all():
            raise ValueError("the round plan's shared filters of this hospital do not fit the decoder's filters")
        values, offset = {}, 0
        for layer, layer_names in layers.items():
            count = shapes[layer_names[0]][0]
            scale = row[offset:offset + count] * weight
            values[f"{FILTER_WEIGHT}{layer}"] = scale
            for name_ in layer_names:
                values[f"model/{name_}"] = scale.reshape((-1,) + (1,) * (len(shapes[name_]) - 1)) * change[name_]
            offset += count
        for name_ in names:
            if not name_.startswith(DECODER):
                values[f"model/{name_}"] = change.get(name_, np.zeros(shapes[name_]))
        return values, {"secagg-clipped": int(clipped)}

    def sum_problem(self, plan: MethodPlan, hospitals: list["HospitalInfo"]) -> str | None:
        having = plan.context["modalities"]
        alone = [m for m in plan.context["shared"] if sum(m in having[h.name] for h in hospitals) < 2]
        if alone:
            return (f"the encoder of {', '.join(alone)} would be the update of the one hospital in the sum that has "
                    "it; the round is not unmasked")
        return None

    def apply(self, method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
        """Encoders: the mean update over the hospitals that have the modality; decoder: per filter the weighted mean
        of the sharing hospitals' filters (the sum over the sum of their weights), EMA'd into the server's where any
        hospital contributed (FedMEPD's ``aggregate_filters``). The per-filter personalisation stays as it is: its rule
        compares each hospital's decoder change with the server's, which the server no longer sees
        (docs/secure-aggregation.md)."""
        from strategies.fedmepd.harness import hospital_average

        context, hospitals = plan.context, [u.hospital for u in updates]
        arrays = dict(method.global_arrays)
        contributors = {}
        for modality in sorted({m for h in hospitals for m in context["modalities"][h.name]}):
            count = sum(modality in context["modalities"][h.name] for h in hospitals)
            contributors[modality] = count
            if modality not in context["shared"]:
                continue
            for name in float_names(arrays):
                if name.startswith(f"{ENCODERS}{modality}."):
                    arrays[name] = (arrays[name].astype(np.float64) + sums[f"model/{name}"] / count).astype(
                        arrays[name].dtype)
        momentum, aggregated, filters = method.cfg.fedmepd.server_momentum, 0, 0
        for layer, names in context["layers"].items():
            total = np.asarray(sums[f"{FILTER_WEIGHT}{layer}"], dtype=np.float64)
            used = total > 1e-6
            aggregated, filters = aggregated + int(used.sum()), filters + used.size
            for name in names:
                shape = (-1,) + (1,) * (arrays[name].ndim - 1)
                sent = arrays[name].astype(np.float64)
                mean = sent + sums[f"model/{name}"] / np.where(used, total, 1.0).reshape(shape)
                blended = momentum * sent + (1.0 - momentum) * mean
                arrays[name] = np.where(used.reshape(shape), blended, sent).astype(arrays[name].dtype)
        method.global_arrays = arrays
        for hospital in hospitals:
            method.personalisation.ensure(hospital.name, context["initial"][hospital.name])
        method._round = {}  # no per-hospital upload: the personalisation rule does not run
        return {"hospital-average": hospital_average(updates), "encoder-contributors": contributors,
                "decoder-filters-aggregated": aggregated / max(filters, 1)}


SECURE = FedMEPDSecure()
