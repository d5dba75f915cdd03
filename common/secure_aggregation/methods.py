"""What a method sums under secure aggregation: the :class:`SecureMethod` each method's package declares
(``strategies/<method>/secure.py``, named by its ``MethodSpec.secure``), the :class:`MethodPlan` its server half
makes each round, and the parts the FedAvg family shares (sample weights capped by the server, updates clipped to
the round's norm bound, the mean update from two sums, the bounds the server can still check). NumPy only."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from common.payload import NamedArrays, Payload

from .messages import LAYOUT_KEY, NORM_BOUND_KEY, WEIGHT_COUNT_KEY, WEIGHT_SHARE_KEY
from .settings import SecureAggregationSettings
from .vector import Entry, Layout

if TYPE_CHECKING:
    from common.config import JobConfig
    from common.methods.base import HospitalInfo, ServerMethod


@dataclass
class MethodPlan:
    """What one round sums, set by the server: the layout, the modulus and quantisation range, the collect-stage
    config each hospital gets, and what the server needs to turn the sums into its state."""

    layout: Layout
    modulus: int
    quantization_range: int
    hospital_config: dict[str, dict[str, Any]]  #: hospital name -> its collect-stage keys
    context: dict[str, Any] = field(default_factory=dict)


Contribution = tuple[dict[str, np.ndarray], dict[str, float]]  #: the parts to sum, and metrics sent in the clear


@dataclass(frozen=True)
class SecureMethod:
    """A method under secure aggregation: ``plan`` (server: what the round sums), ``contribution`` (hospital: its
    parts, from the message it received and its method's reply), ``apply`` (server: the sums into its state, given
    the hospitals in the sum as updates holding only what they said in the clear), ``hidden_metrics`` (reply metrics
    that never leave the hospital in the clear), ``refuse`` (why a job's settings cannot run it securely),
    ``sum_problem`` (why the survivors' sums must not be unmasked: a part only one of them contributed to)."""

    plan: Callable[..., MethodPlan]
    contribution: Callable[[Payload, Payload, Mapping[str, Any], Layout], Contribution]
    apply: Callable[..., dict[str, Any]]
    hidden_metrics: frozenset[str] = frozenset()
    refuse: Callable[["JobConfig"], str | None] = lambda job: None
    sum_problem: Callable[[MethodPlan, list["HospitalInfo"]], str | None] = lambda plan, hospitals: None


def float_names(arrays: Mapping[str, np.ndarray]) -> list[str]:
    return [name for name, value in arrays.items() if np.asarray(value).dtype.kind == "f"]


def clip_update(update: dict[str, np.ndarray], bound: float) -> tuple[dict[str, np.ndarray], bool]:
    """The update scaled to L2 norm ``bound`` if it is longer (0: as it is), and whether it was."""
    norm = math.sqrt(sum(float(np.einsum("i,i->", v.ravel(), v.ravel())) for v in update.values()))  # no BLAS
    if bound > 0 and norm > bound:
        return {k: v * (bound / norm) for k, v in update.items()}, True
    return update, False


def model_change(received: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray],
                 names: list[str]) -> dict[str, np.ndarray]:
    """trained - received in float64 for ``names`` (ValueError where a reply lacks one or changed its shape)."""
    change = {}
    for name in names:
        if name not in received or name not in trained or np.shape(received[name]) != np.shape(trained[name]):
            raise ValueError(f"the model part {name} is missing or has another shape than the one received")
        change[name] = np.asarray(trained[name], dtype=np.float64) - np.asarray(received[name], dtype=np.float64)
    return change


def sample_weight(reply: Payload, params: Mapping[str, Any]) -> float:
    """The hospital's share of the mean, as the server set it from the counts declared when the hospitals joined,
    scaled down if it trained on fewer samples than it declared (never up)."""
    count = reply.metrics.get("num-examples")
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not count > 0:
        raise ValueError(f"the reply's num-examples {count!r} is not a positive count")
    declared = float(params[WEIGHT_COUNT_KEY])
    return float(params[WEIGHT_SHARE_KEY]) * min(float(count), declared) / declared


def sample_shares(job: "JobConfig", hospitals: list["HospitalInfo"]) -> list[float]:
    """Each hospital's share of the round's mean (summing to 1), from the counts they declared when they joined,
    under the screening rules the server applies to reported counts (``screening.sample-ratio-limit``,
    ``screening.max-hospital-weight``): the shares a plain round of honest hospitals gives them."""
    from common.screening import capped_shares, ratio_capped_weights

    weights, _ = ratio_capped_weights([float(h.num_examples) for h in hospitals], job.screening.sample_ratio_limit)
    return [float(share) for share in capped_shares(weights, job.screening.max_hospital_weight)]


def float_entries(arrays: Mapping[str, np.ndarray], prefix: str = "model/", skip: tuple[str, ...] = ()) -> list[Entry]:
    return [Entry(prefix + name, tuple(np.shape(arrays[name]))) for name in float_names(arrays) if name not in skip]


def weighted_plan(method: "ServerMethod", hospitals: list["HospitalInfo"], settings: SecureAggregationSettings,
                  norm_bound: float, arrays: Mapping[str, np.ndarray], extra: tuple[Entry, ...] = (),
                  skip: tuple[str, ...] = (), extra_config: Mapping[str, Any] | None = None) -> MethodPlan:
    """FedAvg family: each hospital sums w_i x its update and w_i, w_i its share of the mean."""
    shares = sample_shares(method.cfg, hospitals)
    layout = Layout((Entry("weight", ()), *float_entries(arrays, skip=skip), *extra))
    config = {h.name: {WEIGHT_SHARE_KEY: share, WEIGHT_COUNT_KEY: float(h.num_examples),
                       NORM_BOUND_KEY: float(norm_bound), LAYOUT_KEY: layout.to_json(), **dict(extra_config or {})}
              for h, share in zip(hospitals, shares)}
    return MethodPlan(layout, settings.modulus_range, settings.quantization_range, config,
                      {"shares": {h.name: share for h, share in zip(hospitals, shares)},
                       "norm-bound": float(norm_bound), "step": 2 * settings.clipping_range /
                       settings.quantization_range})


def check_bounds(sums: Mapping[str, np.ndarray], plan: MethodPlan, updates: list) -> None:
    """What the server can still verify of a FedAvg-family sum (ValueError: some hospital sent a vector outside
    its bounds, which masking hides but cannot undo): the weights add up to no more than the survivors' shares,
    and the mean update, a convex combination of updates each clipped to the norm bound, is no longer than that
    bound (plus the quantisation error)."""
    context, count = plan.context, len(updates)
    total = float(sums["weight"])
    allowed = sum(context["shares"][u.hospital.name] for u in updates)
    slack = count * context["step"]
    if not 0 < total <= allowed + slack:
        raise ValueError(f"the hospitals' weights sum to {total:.6g}, outside (0, {allowed:.6g}] that their shares "
                         "allow: a hospital sent a vector outside its bounds")
    bound = context["norm-bound"]
    if bound > 0:
        parts = [v for k, v in sums.items() if k.startswith("model/")]
        values = sum(v.size for v in parts)
        norm = math.sqrt(sum(float(np.einsum("i,i->", v.ravel(), v.ravel())) for v in parts)) / total
        if norm > bound * (1 + 1e-6) + math.sqrt(values) * slack / total:
            raise ValueError(f"the mean update's norm {norm:.6g} exceeds the norm bound {bound:.6g} every hospital "
                             "clips to: a hospital sent a vector outside its bounds")


def weighted_update_contribution(received: Payload, reply: Payload, params: Mapping[str, Any],
                                 layout: Layout) -> Contribution:
    """(n_i/W) x the hospital's model update, clipped to the norm bound, and n_i/W."""
    names = [name.removeprefix("model/") for name in layout.names if name.startswith("model/")]
    change = model_change(received.arrays.get("model", {}), reply.arrays.get("model", {}), names)
    change, clipped = clip_update(change, float(params[NORM_BOUND_KEY]))
    weight = sample_weight(reply, params)
    return ({"weight": np.asarray(weight), **{f"model/{k}": weight * v for k, v in change.items()}},
            {"secagg-clipped": int(clipped)})


def mean_update(sums: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray],
                skip: tuple[str, ...] = ()) -> NamedArrays:
    """``arrays`` moved by the weighted mean update (the sum of (n_i/W) x updates over the sum of n_i/W); a
    BatchNorm variance that would not stay positive keeps its value."""
    total = float(sums["weight"])
    if not total > 1e-9:
        raise ValueError(f"the hospitals' weights sum to {total:.3g}: nothing to average")
    result = dict(arrays)
    for name in float_names(arrays):
        if name in skip:
            continue
        old = np.asarray(arrays[name], dtype=np.float64)
        new = old + sums[f"model/{name}"] / total
        if name.endswith("running_var"):
            new = np.where(new > 0, new, old)
        result[name] = new.astype(arrays[name].dtype)
    return result


def stand_in(updates: list, arrays: NamedArrays, metrics: dict[str, Any] | None = None):
    """The round's secure sum as the one update a method's own ``aggregate`` is given (its weighted mean of one
    update is that update): so the method's bookkeeping runs on what the server may know."""
    from common.methods.base import HospitalInfo, HospitalUpdate

    total = sum(u.hospital.num_examples for u in updates)
    return HospitalUpdate(HospitalInfo("secure-sum", total), Payload(arrays={"model": arrays},
                                                                       metrics={"num-examples": total,
                                                                                **(metrics or {})}), share=1.0)



def secure_method(name: str, job: "JobConfig | None" = None) -> SecureMethod:
    """The method's secure-aggregation functions (its package's ``MethodSpec.secure``); ValueError says why it has
    none (its ``MethodSpec.not_secure``), or why ``job``'s settings cannot use them."""
    from strategies.registry import load, methods

    spec = methods().get(name)
    if spec is None or not spec.secure:
        reason = (spec.not_secure if spec is not None else "") or "it is not built for it"
        raise ValueError(f"secure aggregation is not available for strategy {name!r}: {reason}")
    method = load(spec.secure)
    problem = method.refuse(job) if job is not None else None
    if problem:
        raise ValueError(f"secure aggregation with strategy {name!r}: {problem}")
    return method


def secure_method_names() -> list[str]:
    """The methods that run under secure aggregation."""
    from strategies.registry import methods

    return sorted(name for name, spec in methods().items() if spec.secure)
