"""FedMEPD under secure aggregation (and its federated-decoder and shared-encoder FedAvg baselines): each modality's
encoder summed over the hospitals that have it (a modality only one hospital of the round has is not summed), the
decoder per filter weighted by the server's per-filter weights (docs/secure-aggregation.md, "What each method
sums"). The per-filter personalisation stays as it was: its rule needs each hospital's decoder change."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from common.payload import Payload
from common.secure_aggregation.messages import LAYOUT_KEY, NORM_BOUND_KEY, PREFIX
from common.secure_aggregation.methods import (
    Contribution,
    MethodPlan,
    SecureMethod,
    clip_update,
    float_names,
    model_change,
    sample_shares,
    weighted_update_contribution,
)
from common.secure_aggregation.vector import Entry, Layout
from strategies.fedavg.secure import fedavg_apply, fedavg_plan, fedavg_refuse

if TYPE_CHECKING:
    from common.methods.base import HospitalInfo

FILTER_WEIGHTS_KEY = PREFIX + "filter-weights"  #: the server's weight of each decoder filter for this hospital
ENCODERS = "encoders."


def modality_of(name: str) -> str:
    return name[len(ENCODERS):].split(".", 1)[0]


def fedmepd_plan(method, hospitals, settings, norm_bound) -> MethodPlan:
    """Each modality's encoder as the sum of the updates of the hospitals that have it (a modality only one chosen
    hospital has stays out: its sum would be that hospital's update; the server knows who has which), the decoder
    per filter as the sum of w_k[f] x the update of filter f (w_k: the server's per-filter weights, 0 where
    personal) with sum w_k[f] known to the server."""
    from strategies.fedmepd.decoder import DECODER
    from strategies.fedmepd.filter_personalisation import filter_layers
    from strategies.fedmepd.harness import hospital_modalities

    arrays = method.global_arrays
    having = {h.name: set(hospital_modalities(h)) for h in hospitals}
    shared = sorted(m for m in {m for ms in having.values() for m in ms}
                    if sum(m in ms for ms in having.values()) >= 2)
    encoders = [n for n in float_names(arrays) if n.startswith(ENCODERS) and modality_of(n) in shared]
    decoder = [n for n in float_names(arrays) if n.startswith(DECODER)]
    layers = filter_layers({n: arrays[n] for n in decoder})
    layout = Layout(tuple(Entry(f"model/{n}", tuple(np.shape(arrays[n]))) for n in encoders + decoder))
    shares = sample_shares(method.cfg, hospitals)
    by_share = not method.personalise or method.cfg.fedmepd.initial_weight == "share"
    weights, config = {}, {}
    for hospital, share in zip(hospitals, shares):
        known = method.personalisation.weights.get(hospital.name)
        start = share if by_share else 1.0
        weights[hospital.name] = {layer: np.asarray(known[layer] if known is not None
                                                    else np.full(np.shape(arrays[names[0]])[0], start))
                                  for layer, names in layers.items()}
        config[hospital.name] = {NORM_BOUND_KEY: float(norm_bound), LAYOUT_KEY: layout.to_json(),
                                 FILTER_WEIGHTS_KEY: np.concatenate(list(weights[hospital.name].values())).tolist()}
    return MethodPlan(layout, settings.modulus_range, settings.quantization_range, config,
                      {"modalities": having, "shared": shared, "weights": weights, "layers": layers,
                       "shares": {h.name: share for h, share in zip(hospitals, shares)}})


def fedmepd_contribution(received: Payload, reply: Payload, params: Mapping[str, Any],
                         layout: Layout) -> Contribution:
    from strategies.fedmepd.decoder import DECODER
    from strategies.fedmepd.filter_personalisation import filter_layers

    model_in, model_out = received.arrays.get("model", {}), reply.arrays.get("model", {})
    names = [n.removeprefix("model/") for n in layout.names]
    own = [n for n in names if n in model_in]  # the encoders of modalities it lacks: zeros
    change, clipped = clip_update(model_change(model_in, model_out, own), float(params[NORM_BOUND_KEY]))
    shapes = {e.name.removeprefix("model/"): e.shape for e in layout.entries}
    layers = filter_layers({n: np.zeros(shapes[n]) for n in names if n.startswith(DECODER)})
    weights = np.asarray(params[FILTER_WEIGHTS_KEY], dtype=np.float64)
    if weights.size != sum(shapes[ns[0]][0] for ns in layers.values()):
        raise ValueError("the per-filter weights do not fit the decoder's filters")
    values, offset = {}, 0
    for layer, layer_names in layers.items():
        count = shapes[layer_names[0]][0]
        for name in layer_names:
            scale = weights[offset:offset + count].reshape((-1,) + (1,) * (len(shapes[name]) - 1))
            values[f"model/{name}"] = scale * change[name]
        offset += count
    for name in names:
        if not name.startswith(DECODER):
            values[f"model/{name}"] = change.get(name, np.zeros(shapes[name]))
    return values, {"secagg-clipped": int(clipped)}


def fedmepd_sum_problem(plan: MethodPlan, hospitals: list["HospitalInfo"]) -> str | None:
    alone = [m for m in plan.context["shared"] if sum(m in plan.context["modalities"][h.name] for h in hospitals) < 2]
    if alone:
        return (f"the encoder of {', '.join(alone)} would be the update of the one hospital in the sum that has it; "
                "the round is not unmasked")
    return None


def fedmepd_apply(method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
    """Encoders: the mean update over the hospitals that have the modality; decoder: per filter the weighted mean
    of the hospitals' filters, EMA'd into the server's where any hospital contributed (FedMEPD's
    ``aggregate_filters``). The per-filter personalisation stays as it is: its rule compares each hospital's
    decoder change with the server's, which the server no longer sees (docs/secure-aggregation.md)."""
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
        total = sum(context["weights"][h.name][layer] for h in hospitals)
        used = total > 0
        aggregated, filters = aggregated + int(used.sum()), filters + used.size
        for name in names:
            shape = (-1,) + (1,) * (arrays[name].ndim - 1)
            sent = arrays[name].astype(np.float64)
            mean = sent + sums[f"model/{name}"] / np.where(used, total, 1.0).reshape(shape)
            blended = momentum * sent + (1.0 - momentum) * mean
            arrays[name] = np.where(used.reshape(shape), blended, sent).astype(arrays[name].dtype)
    method.global_arrays = arrays
    for hospital in hospitals:
        by_share = not method.personalise or method.cfg.fedmepd.initial_weight == "share"
        method.personalisation.ensure(hospital.name, context["shares"][hospital.name] if by_share else 1.0)
    method._round = {}  # no per-hospital upload: the personalisation rule does not run
    return {"hospital-average": hospital_average(updates), "encoder-contributors": contributors,
            "decoder-filters-aggregated": aggregated / max(filters, 1)}




def shared_encoder_fedavg_apply(method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
    """The FedAvg baseline's round, with the hospitals' own scores, which they state in the clear."""
    from strategies.fedmepd.harness import hospital_average

    record = fedavg_apply(method, rnd, sums, plan, updates)
    record["hospital-average"] = hospital_average(updates)
    return record


SECURE = SecureMethod(fedmepd_plan, fedmepd_contribution, fedmepd_apply, sum_problem=fedmepd_sum_problem)
SHARED_ENCODER_FEDAVG = SecureMethod(fedavg_plan, weighted_update_contribution, shared_encoder_fedavg_apply,
                                     refuse=fedavg_refuse)
