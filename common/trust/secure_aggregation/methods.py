"""What a method sums under secure aggregation: the :class:`SecureMethod` each method's package declares
(``strategies/<method>/secure.py``, named by its ``MethodSpec.secure``), the :class:`MethodPlan` its server half
makes each round, and the parts the FedAvg family shares (each hospital's own sample weight, updates clipped to the
round's norm bound, the mean update from two sums, the bounds the server can still check). NumPy only.

Nothing the server sends one hospital alone decides what that hospital adds to a sum: the plan of a round
(:attr:`MethodPlan.common`: the layout, the norm bound, the weight cap, what each method needs) is one JSON text,
the same for every hospital, which each hospital checks against its policy, binds its pairwise masks to and signs
with the survivor set (``common/trust/secure_aggregation/hospital.py``); a hospital weighs its own contribution with its
own sample count (:func:`own_weight`) and adds that weight to the sum, which the server divides by."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping

import numpy as np

from common.payload import NamedArrays, Payload

from .messages import LAYOUT_KEY, NORM_BOUND_KEY, OWN_WEIGHT_CAP_KEY, PARTS_KEY, WEIGHT_CAP_KEY, plan_text
from .settings import SecureAggregationSettings
from .vector import Entry, Layout

if TYPE_CHECKING:
    from common.config import JobConfig
    from common.methods.base import HospitalInfo, HospitalUpdate, ServerMethod


@dataclass
class MethodPlan:
    """What one round sums, set by the server: the layout, the modulus and quantisation range, the plan every
    hospital gets alike (``common``: keys a method's ``contribution`` reads, JSON values), and what the server needs
    to turn the sums into its state (``context``, never sent)."""

    layout: Layout
    modulus: int
    quantization_range: int
    common: dict[str, Any]  #: the round plan, the same for every hospital (its layout under LAYOUT_KEY)
    context: dict[str, Any] = field(default_factory=dict)
    #: part -> the hospitals whose contribution it holds (a part every hospital adds to needs no entry): each
    #: hospital checks every part holds at least its min-hospitals-per-sum, also among the survivors
    parts: dict[str, list[str]] = field(default_factory=dict)

    def text(self, closing: Mapping[str, Any] | None = None) -> str:
        """The plan as the hospitals receive it: canonical JSON, whose SHA-256 they sign; ``closing``: what the
        round adds (the protocol's parameters, the training config, the model)."""
        return plan_text({**self.common, LAYOUT_KEY: self.layout.to_json(), PARTS_KEY: self.parts,
                          **dict(closing or {})})


Contribution = tuple[dict[str, np.ndarray], dict[str, float]]  #: the parts to sum, and metrics sent in the clear


class SecureMethod(ABC):
    """A method under secure aggregation, as its package declares it (``strategies/<method>/secure.py``, named by its
    ``MethodSpec.secure``): one instance, whose methods the server's round (``strategies/secure_aggregation.py``)
    and the hospital's (``common/trust/secure_aggregation/hospital.py``) call with everything they need.

    Server side: :meth:`plan` (what the round sums, from the chosen hospitals), :meth:`sum_problem` (why the
    survivors' sums must not be unmasked), :meth:`apply` (the unmasked sums into the method's state, given the
    hospitals in the sum: their count is ``len(updates)``, each update holding only what it said in the clear),
    :meth:`refuse` (why a job's settings cannot run it, before round 1). Hospital side: :meth:`contribution` (its
    parts, from the message it received and its method's reply), :meth:`check_plan` (why the round plan misstates
    this hospital's own row)."""

    #: reply metrics that never leave the hospital in the clear (they travel in the sum)
    hidden_metrics: ClassVar[frozenset[str]] = frozenset()
    #: its sum is the FedAvg family's (weight and model update), which distributed DP noises
    distributed_dp: ClassVar[bool] = False
    #: training config keys its server sets per hospital (each hospital's value is a row of the plan every hospital
    #: signs); every other key is one value for all
    own_config: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def plan(self, method: "ServerMethod", hospitals: list["HospitalInfo"], settings: SecureAggregationSettings,
             norm_bound: float) -> MethodPlan:
        """Server: what round's ``hospitals`` (the chosen ones, ``len(hospitals)`` of them) sum."""

    @abstractmethod
    def contribution(self, received: Payload, reply: Payload, params: Mapping[str, Any],
                     layout: Layout) -> Contribution:
        """Hospital: its parts to sum and its metrics in the clear, from the message it received, its method's reply
        and the round plan (``params``: the plan every hospital signs, plus this hospital's own row and name)."""

    @abstractmethod
    def apply(self, method: "ServerMethod", rnd: int, sums: Mapping[str, np.ndarray], plan: MethodPlan,
              updates: list["HospitalUpdate"]) -> dict[str, Any]:
        """Server: the unmasked ``sums`` into ``method``'s state; ``updates``: every hospital in the sum (``len``: how
        many), each holding only its metrics and config in the clear, never arrays. Returns the round's metrics;
        ValueError: the sums cannot be used (the global model stays as it was)."""

    def refuse(self, job: "JobConfig") -> str | None:
        """Why ``job``'s settings cannot run this method securely (checked before round 1), or None."""
        return None

    def sum_problem(self, plan: MethodPlan, hospitals: list["HospitalInfo"]) -> str | None:
        """Why the survivors' (``hospitals``) sums must not be unmasked (a part only one of them added to), or None."""
        return None

    def check_plan(self, plan: Mapping[str, Any], name: str, received: Payload, reply: Payload) -> str | None:
        """Hospital side: why the round plan misstates what this hospital (``name``) holds, or None (FedMEPD's
        modalities)."""
        return None

    def personal(self, reply: Payload) -> Mapping[str, Iterable[str]]:
        """Hospital side: the received arrays (group -> names) its hospital half keeps its own values of, as its
        training reply names them (FedBN: its normalisation layers): no training input, so no part of the replay
        memory's key."""
        return {}


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


def own_weight(reply: Payload, params: Mapping[str, Any]) -> float:
    """The hospital's own weight in the sum: the samples it trained on, capped by the round plan's common cap and
    by its policy's (``max-sample-weight``, passed as ``OWN_WEIGHT_CAP_KEY``), over the plan's cap (so in (0, 1]).
    Nothing the server sends this hospital alone enters it."""
    count = reply.metrics.get("num-examples")
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not count > 0:
        raise ValueError(f"the reply's num-examples {count!r} is not a positive count")
    cap = float(params[WEIGHT_CAP_KEY])
    if not math.isfinite(cap) or cap < 1:
        raise ValueError(f"the plan's weight cap {cap!r} is not a count of at least 1")
    own = float(params.get(OWN_WEIGHT_CAP_KEY) or math.inf)
    return min(float(count), cap, own) / cap


def common_weight_cap(job: "JobConfig", hospitals: list["HospitalInfo"]) -> float:
    """The most samples any hospital's weight counts this round, the same for all: the largest cap under which
    the declared counts meet the rules the server applies to a plain round's counts (``screening.sample-ratio-
    limit`` x their median, and no hospital above ``screening.max-hospital-weight`` of the total)."""
    counts = np.asarray([float(h.num_examples) for h in hospitals], dtype=np.float64)
    cap = float(counts.max())
    limit = job.screening.sample_ratio_limit
    if limit > 0 and len(counts) > 1:
        cap = min(cap, limit * float(np.median(counts)))
    share = max(job.screening.max_hospital_weight, 1.0 / len(counts))
    low, high = float(counts.min()), cap
    if high <= low or np.minimum(counts, high).max() / np.minimum(counts, high).sum() <= share + 1e-12:
        return max(1.0, high)
    for _ in range(60):  # the largest cap whose biggest share is within the limit
        middle = (low + high) / 2
        capped = np.minimum(counts, middle)
        low, high = (middle, high) if capped.max() / capped.sum() <= share + 1e-12 else (low, middle)
    return max(1.0, low)


def declared_weights(hospitals: list["HospitalInfo"], cap: float) -> dict[str, float]:
    """The weight each hospital adds if it trains on the samples it declared (the bound the server checks sums
    against)."""
    return {h.name: min(float(h.num_examples), cap) / cap for h in hospitals}


def float_entries(arrays: Mapping[str, np.ndarray], prefix: str = "model/", skip: tuple[str, ...] = ()) -> list[Entry]:
    return [Entry(prefix + name, tuple(np.shape(arrays[name]))) for name in float_names(arrays) if name not in skip]


def weighted_plan(method: "ServerMethod", hospitals: list["HospitalInfo"], settings: SecureAggregationSettings,
                  norm_bound: float, arrays: Mapping[str, np.ndarray], extra: tuple[Entry, ...] = (),
                  skip: tuple[str, ...] = (), extra_common: Mapping[str, Any] | None = None) -> MethodPlan:
    """FedAvg family: each hospital sums w_i x its update and w_i, w_i its own weight (:func:`own_weight`) under
    the plan's common cap; with distributed DP its model part as one rotated, rounded, noised integer entry
    (``common/trust/secure_aggregation/distributed_dp.py``)."""
    cap = common_weight_cap(method.cfg, hospitals)
    entries = float_entries(arrays, skip=skip)
    layout = Layout((Entry("weight", ()), *entries, *extra))
    common = {NORM_BOUND_KEY: float(norm_bound), WEIGHT_CAP_KEY: cap, **dict(extra_common or {})}
    context = {"declared": declared_weights(hospitals, cap), "norm-bound": float(norm_bound),
               "step": 2 * settings.clipping_range / settings.quantization_range}
    if settings.distributed_dp != "off":
        from . import distributed_dp as ddp
        from .vector import MODULAR

        if extra:
            raise ValueError("distributed DP noises the model update only; this method sums more than that")
        dp = ddp.plan(settings.noise_multiplier, settings.noise_hospitals or len(hospitals), norm_bound,
                      sum(e.size for e in entries), settings.modulus_range, len(hospitals))
        layout = Layout((Entry("weight", ()), Entry(ddp.NOISED, (dp.padded,), MODULAR, dp.modulus - 1)))
        common.update({ddp.PLAN_KEY: dp.to_plan(),
                       ddp.MODEL_PARTS_KEY: [[e.name.removeprefix("model/"), list(e.shape)] for e in entries]})
        context["distributed-dp"] = dp
    return MethodPlan(layout, settings.modulus_range, settings.quantization_range, common, context)


def check_bounds(sums: Mapping[str, np.ndarray], plan: MethodPlan, updates: list) -> None:
    """What the server can still verify of a FedAvg-family sum (ValueError: some hospital sent a vector outside
    its bounds, which masking hides but cannot undo): the weights add up to no more than the survivors' declared
    counts allow, and the mean update, a convex combination of updates each clipped to the norm bound, is no longer
    than that bound (plus the quantisation error)."""
    context, count = plan.context, len(updates)
    total = float(sums["weight"])
    allowed = sum(context["declared"][u.hospital.name] for u in updates)
    slack = count * context["step"]
    if not 0 < total <= allowed + slack:
        raise ValueError(f"the hospitals' weights sum to {total:.6g}, outside (0, {allowed:.6g}] that their declared "
                         "counts allow: a hospital sent a vector outside its bounds")
    bound = context["norm-bound"]
    if bound > 0 and "distributed-dp" not in context:  # the noise, not a hospital, takes the sum past the bound
        parts = [v for k, v in sums.items() if k.startswith("model/")]
        values = sum(v.size for v in parts)
        norm = math.sqrt(sum(float(np.einsum("i,i->", v.ravel(), v.ravel())) for v in parts)) / total
        if norm > bound * (1 + 1e-6) + math.sqrt(values) * slack / total:
            raise ValueError(f"the mean update's norm {norm:.6g} exceeds the norm bound {bound:.6g} every hospital "
                             "clips to: a hospital sent a vector outside its bounds")


def weighted_update_contribution(received: Payload, reply: Payload, params: Mapping[str, Any],
                                 layout: Layout) -> Contribution:
    """w_i x the hospital's model update, clipped to the norm bound, and w_i (its own weight)."""
    names = [name.removeprefix("model/") for name in layout.names if name.startswith("model/")]
    change = model_change(received.arrays.get("model", {}), reply.arrays.get("model", {}), names)
    change, clipped = clip_update(change, float(params[NORM_BOUND_KEY]))
    weight = own_weight(reply, params)
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


def secure_method(name: str, job: "JobConfig | None" = None) -> SecureMethod:
    """The method's secure-aggregation functions (its package's ``MethodSpec.secure``); ValueError says why it has
    none (its ``MethodSpec.not_secure``), or why ``job``'s settings cannot use them."""
    from common.methods.registry import load, methods

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
    from common.methods.registry import methods

    return sorted(name for name, spec in methods().items() if spec.secure)


def distributed_dp_method_names() -> list[str]:
    """The methods whose secure sum distributed DP can noise (a weight and a model update)."""
    return [name for name in secure_method_names() if secure_method(name).distributed_dp]


def refuse_robust_aggregate(job: "JobConfig") -> str | None:
    if job.screening.robust_aggregate != "mean":
        return (f"screening.robust-aggregate={job.screening.robust_aggregate!r} needs every hospital's update; "
                "a secure sum gives the mean only")
    return None


def weight_total(sums: Mapping[str, np.ndarray], plan: MethodPlan) -> float:
    """The samples behind a FedAvg-family sum as the protocol knows them: the summed own weights times the plan's
    common cap (each hospital's samples capped by it and by its policy)."""
    return float(sums["weight"]) * float(plan.common[WEIGHT_CAP_KEY])


class MeanUpdate(SecureMethod):
    """FedAvg under secure aggregation (also FedProx's, MOON's and FedMEPD's FedAvg baseline's): each hospital adds
    (n_i/W) x its update, clipped to the round's norm bound, and n_i/W; the server moves the global model by the
    ratio of the two sums, the sample-weighted mean update (docs/secure-aggregation.md, "What each method sums"), and
    hands it to the method's server half as a :class:`common.methods.base.SecureMean` (``aggregate_secure_mean``):
    the model, the number of hospitals in the sum and their samples, never a stand-in hospital."""

    distributed_dp = True

    def plan(self, method, hospitals, settings, norm_bound) -> MethodPlan:
        return weighted_plan(method, hospitals, settings, norm_bound, method.global_arrays)

    def contribution(self, received, reply, params, layout) -> Contribution:
        return weighted_update_contribution(received, reply, params, layout)

    def apply(self, method, rnd, sums, plan, updates) -> dict[str, Any]:
        """The checked mean update, then the method's ``aggregate_secure_mean`` on it."""
        from common.methods.base import SecureMean

        check_bounds(sums, plan, updates)
        return method.aggregate_secure_mean(rnd, SecureMean(mean_update(sums, method.global_arrays), list(updates),
                                                            weight_total(sums, plan)))

    def refuse(self, job: "JobConfig") -> str | None:
        from common.methods.base import ServerMethod
        from common.methods.registry import server_class

        server = server_class(job.strategy)
        if server.aggregate_secure_mean is ServerMethod.aggregate_secure_mean:
            return (f"its server half {server.__name__} does not say what it makes of a secure sum's mean update "
                    "(ServerMethod.aggregate_secure_mean)")
        return refuse_robust_aggregate(job)


#: FedAvg's secure sum, which FedProx, MOON and FedMEPD's FedAvg baseline name too (their servers average as FedAvg's).
MEAN_UPDATE = MeanUpdate()
