"""Distributed differential privacy under secure aggregation: every hospital adds a share of the noise to its own
integer contribution before masking, so the unmasked sum carries the noise central DP would add, and no party ever
sees a less noisy value (the Skellam mechanism of Agarwal, Kairouz and Liu, NeurIPS 2021; the rotation and the
conditional rounding of Kairouz, Liu and Steinke's distributed discrete Gaussian, ICML 2021).

A hospital's model contribution x (its weighted update, L2 norm at most the plan's bound C):

1. is clipped to C again, padded to a power of two d' and rotated by a randomised Hadamard transform whose signs
   come from the round plan (the same for all; the server inverts it): every coordinate then carries about
   ||x|| / sqrt(d'), so a small integer range holds it;
2. is scaled by s (integers per unit) and rounded at random to integers, coordinate by coordinate, again until the
   rounded vector's norm is at most the plan's rounded bound B (conditional randomised rounding, so the
   sensitivity is B, not ||x|| s plus the rounding's worst case);
3. gets Skellam noise, Poisson(mu/2) - Poisson(mu/2) per coordinate, mu = (z C s)^2 / n: integers, and a sum of
   Skellams is a Skellam, so the n hospitals' shares add up to variance (z C s)^2 exactly;
4. is taken modulo the round's modulus, whose headroom (:func:`plan`) keeps the sum from wrapping.

The server centres the unmasked integers, divides by s and undoes the rotation: the sum of the clipped
contributions plus noise of standard deviation z C on every coordinate (:func:`decode`).

What a hospital counts (:func:`rdp`, :func:`epsilon`): a sum it took part in is a Skellam mechanism whose noise
comes from at least the honest hospitals its policy assumes (``min-hospitals-per-sum`` less
``max-dropped-or-colluding``): variance (honest) x mu, L2 sensitivity 2B (one record replaced moves its rounded
contribution anywhere in the ball of radius B), L1 sensitivity min(sqrt(d') 2B, (2B)^2); Rényi DP of integer order
alpha (Agarwal et al., Corollary 3.6)::

    eps(alpha) <= alpha D2^2 / (2 mu_sum) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 mu_sum^2), 3 D1 / (2 mu_sum))

composed over the sums (RDP adds up) and turned into (epsilon, delta) as Google's and Opacus' accountants do.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

from .messages import PREFIX

PLAN_KEY = PREFIX + "distributed-dp"  #: in the round plan: the parameters below, the same for every hospital
MECHANISM = "skellam"
#: standard deviations of headroom below half the modulus: a coordinate of the sum wraps with probability < 1e-9
HEADROOM = 6.0
#: the most variance one hospital's noise gets per coordinate: NumPy's Poisson sampler is exact only while its mean
#: stays well inside float64's integers (2^53); the scale (the sum's resolution, 1/s) gives way to it
MAX_LOCAL_VARIANCE = 2.0**40
ORDERS = tuple(range(2, 257)) + (320, 384, 512, 768, 1024)  #: integer Rényi orders (the Skellam bound's)
POISSON_GAUSSIAN = "poisson-gaussian"  #: a ledger entry of DP-SGD: steps of a Poisson-subsampled Gaussian
NOISED = "noised"  #: the layout entry of the rotated, rounded, noised model contribution


@dataclass(frozen=True)
class Parameters:
    """The round plan's distributed-DP values."""

    noise_multiplier: float  #: z: the sum carries noise of std z x norm_bound on every coordinate
    hospitals: int  #: n: each hospital adds 1/n of the noise's variance
    norm_bound: float  #: C: each contribution's L2 norm
    scale: float  #: s: integers per unit
    dimension: int  #: d: the model values summed
    padded: int  #: d': the next power of two (the Hadamard transform's size)
    rotation_seed: str  #: hex: the transform's signs, public
    rounded_bound: float  #: B: the L2 norm a rounded, scaled contribution stays within
    modulus: int
    round_hospitals: int  #: the most vectors in the sum: the headroom below half the modulus is for them

    @property
    def local_variance(self) -> float:
        """mu: the variance of the Skellam noise each hospital adds per coordinate."""
        return (self.noise_multiplier * self.norm_bound * self.scale) ** 2 / self.hospitals

    def to_plan(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_plan(cls, plan: Mapping[str, Any]) -> "Parameters | None":
        """The plan's parameters (None: the plan adds no noise); ValueError for values that cannot be right."""
        raw = plan.get(PLAN_KEY)
        if raw is None:
            return None
        try:
            if not isinstance(raw, dict) or set(raw) != set(asdict(_EXAMPLE)) or any(
                    isinstance(v, bool) or not isinstance(v, (str, int, float)) for v in raw.values()):
                raise ValueError("not one value of each parameter")
            params = cls(**{k: type(f)(raw[k]) if not isinstance(f, str) else str(raw[k])
                            for k, f in asdict(_EXAMPLE).items()})
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise ValueError(f"the round plan's distributed-DP parameters cannot be read ({error})") from None
        if not (math.isfinite(params.noise_multiplier) and params.noise_multiplier > 0 and params.hospitals >= 1
                and math.isfinite(params.norm_bound) and params.norm_bound > 0 and params.dimension >= 1
                and params.round_hospitals >= 1 and params.modulus >= 4
                and not params.modulus & (params.modulus - 1)):
            raise ValueError(f"the round plan's distributed-DP parameters do not fit together: {raw}")
        problem = params.plan_problem(plan)
        if problem:
            raise ValueError(f"the round plan's distributed DP: {problem}")
        return params

    def plan_problem(self, plan: Mapping[str, Any]) -> str | None:
        """Why these parameters are not what a hospital computes itself from the rest of the round plan (None: they
        are): the scale, the padded size and the rounding bound are derived, never taken from the server; the
        modulus, the norm bound, the hospitals and the dimension are the plan's own."""
        from .messages import NORM_BOUND_KEY, PROTOCOL_KEY

        protocol = plan.get(PROTOCOL_KEY)
        if isinstance(protocol, dict) and (protocol.get("modulus"), protocol.get("hospitals")) != (
                self.modulus, self.round_hospitals):
            return (f"modulus {self.modulus} and hospitals {self.round_hospitals} are not the protocol's "
                    f"{protocol.get('modulus')} and {protocol.get('hospitals')}")
        if NORM_BOUND_KEY in plan and plan[NORM_BOUND_KEY] != self.norm_bound:
            return f"norm bound {self.norm_bound} is not the plan's {plan[NORM_BOUND_KEY]}"
        try:
            size = sum(math.prod(shape) for _, shape in model_parts(plan)) if MODEL_PARTS_KEY in plan else None
        except (TypeError, ValueError):
            return "its model parts are not [name, shape] pairs"
        if size is not None and size != self.dimension:
            return f"dimension {self.dimension} is not the size of the model parts it noises ({size})"
        derived = derive(self.noise_multiplier, self.hospitals, self.norm_bound, self.dimension, self.modulus,
                         self.round_hospitals)
        if (self.scale, self.padded, self.rounded_bound) != derived:
            return (f"scale {self.scale}, padded size {self.padded} and rounding bound {self.rounded_bound} are not "
                    f"what the hospital derives from the plan ({derived[0]}, {derived[1]}, {derived[2]})")
        if not self.local_variance <= MAX_LOCAL_VARIANCE * (1 + 1e-9):  # the derived scale's rounding
            return (f"each hospital's Poisson mean {self.local_variance / 2:.3g} is past "
                    f"{MAX_LOCAL_VARIANCE / 2:.3g}, where NumPy's sampler stops being exact")
        return None


_EXAMPLE = Parameters(1.0, 1, 1.0, 1.0, 1, 1, "", 1.0, 4, 1)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def rounded_bound(norm: float, padded: int, beta: float = math.exp(-0.5)) -> float:
    """The L2 bound conditional randomised rounding keeps a scaled vector of norm ``norm`` in, with each try
    succeeding with probability at least 1 - beta (Kairouz et al. 2021, Theorem 8)."""
    return math.sqrt(norm ** 2 + padded / 4 + math.sqrt(2 * math.log(1 / beta)) * (norm + math.sqrt(padded) / 2))


def plan(noise_multiplier: float, hospitals: int, norm_bound: float, dimension: int, modulus: int,
         round_hospitals: int) -> Parameters:
    """The parameters of a round of ``round_hospitals`` (at most that many vectors in the sum): the largest scale
    whose sum of contributions plus noise stays HEADROOM standard deviations inside half the modulus (and whose
    noise shares NumPy's Poisson sampler draws exactly)."""
    scale, padded, bound = derive(noise_multiplier, hospitals, norm_bound, dimension, modulus, round_hospitals)
    if scale <= 0:
        raise ValueError(f"modulus {modulus} leaves no room for {round_hospitals} hospitals' noised sums")
    seed = hashlib.sha256(f"{noise_multiplier}:{dimension}:{modulus}:{np.random.SeedSequence().entropy}"
                          .encode()).hexdigest()
    return Parameters(float(noise_multiplier), int(hospitals), float(norm_bound), scale, int(dimension), padded, seed,
                      bound, int(modulus), int(round_hospitals))


def derive(noise_multiplier: float, hospitals: int, norm_bound: float, dimension: int, modulus: int,
           round_hospitals: int) -> tuple[float, int, float]:
    """(scale, padded size, rounding bound) of a plan, which the server and every hospital compute alike: the
    largest scale whose sum of contributions plus noise stays HEADROOM standard deviations inside half the modulus
    and whose noise shares NumPy's Poisson sampler draws exactly (mean at most MAX_LOCAL_VARIANCE / 2)."""
    padded = next_power_of_two(dimension)
    per_coordinate = norm_bound / math.sqrt(padded)  # after rotation, about
    spread = HEADROOM * (round_hospitals * per_coordinate + noise_multiplier * norm_bound)
    scale = float(min((modulus / 2 - 2 * round_hospitals - 1) / spread,
                      math.sqrt(hospitals * MAX_LOCAL_VARIANCE) / (noise_multiplier * norm_bound)))
    return scale, int(padded), float(rounded_bound(norm_bound * scale, padded)) if scale > 0 else 0.0


# --- the rotation -----------------------------------------------------------------------------------------------------
def signs(params: Parameters) -> np.ndarray:
    """The randomised Hadamard transform's +-1 signs, from the plan's public seed."""
    rng = np.random.default_rng(int(params.rotation_seed[:32], 16))
    return rng.integers(0, 2, params.padded).astype(np.float64) * 2 - 1


def hadamard(vector: np.ndarray) -> np.ndarray:
    """The normalised fast Walsh-Hadamard transform of a vector whose size is a power of two (its own inverse)."""
    out = np.array(vector, dtype=np.float64)
    size, step = out.size, 1
    while step < size:
        blocks = out.reshape(-1, 2, step)
        top, bottom = blocks[:, 0, :].copy(), blocks[:, 1, :]
        blocks[:, 0, :] += bottom
        blocks[:, 1, :] = top - bottom
        step *= 2
    return out / math.sqrt(size)


def rotate(vector: np.ndarray, params: Parameters) -> np.ndarray:
    padded = np.zeros(params.padded)
    padded[:vector.size] = vector
    return hadamard(padded * signs(params))


def unrotate(vector: np.ndarray, params: Parameters) -> np.ndarray:
    return (hadamard(vector) * signs(params))[:params.dimension]


# --- a hospital's contribution ----------------------------------------------------------------------------------------
def privatize(vector: np.ndarray, params: Parameters, rng: np.random.Generator, tries: int = 1000) -> np.ndarray:
    """A hospital's model contribution (``dimension`` values) as integers below the modulus: clipped, rotated,
    scaled, rounded at random within the rounded bound, with its share of Skellam noise."""
    vector = np.asarray(vector, dtype=np.float64).ravel()
    if vector.size != params.dimension:
        raise ValueError(f"the contribution has {vector.size} values, the plan {params.dimension}")
    norm = float(np.sqrt(np.einsum("i,i->", vector, vector)))
    if norm > params.norm_bound:
        vector = vector * (params.norm_bound / norm)
    scaled = rotate(vector, params) * params.scale
    low = np.floor(scaled)
    for _ in range(tries):  # conditional randomised rounding: unbiased, and within the bound the sensitivity needs
        rounded = low + (rng.random(scaled.size) < scaled - low)
        if float(np.sqrt(np.einsum("i,i->", rounded, rounded))) <= params.rounded_bound:
            break
    else:
        raise ValueError("randomised rounding did not stay within the plan's bound")
    mu = params.local_variance
    if not mu <= MAX_LOCAL_VARIANCE * (1 + 1e-9):  # past it, the sampler returns multiples of a power of 2
        raise ValueError(f"a Poisson mean of {mu / 2:.3g} is past what NumPy samples exactly")
    noise = rng.poisson(mu / 2, params.padded) - rng.poisson(mu / 2, params.padded)
    return np.mod(rounded.astype(np.int64) + noise, params.modulus)


def decode(total: np.ndarray, params: Parameters) -> np.ndarray:
    """The sum of the hospitals' contributions plus the noise, in model units, from the unmasked integers."""
    total = np.asarray(total, dtype=np.int64)
    centred = np.where(total >= params.modulus // 2, total - params.modulus, total).astype(np.float64)
    return unrotate(centred / params.scale, params)


# --- what a sum costs -------------------------------------------------------------------------------------------------
def sensitivities(params: Parameters) -> tuple[float, float]:
    """(L1, L2) sensitivity of the sum, in integers, to one record of one hospital (replace one)."""
    l2 = 2 * params.rounded_bound
    return min(math.sqrt(params.padded) * l2, l2 * l2), l2


def skellam_rdp(order: int, variance: float, l1: float, l2: float) -> float:
    """Rényi DP at integer ``order`` of a Skellam mechanism with per-coordinate ``variance`` and integer
    sensitivities ``l1``, ``l2`` (Agarwal, Kairouz, Liu 2021, Corollary 3.6)."""
    return (order * l2 ** 2 / (2 * variance)
            + min(((2 * order - 1) * l2 ** 2 + 6 * l1) / (4 * variance ** 2), 3 * l1 / (2 * variance)))


def release(params: Parameters, honest: int) -> dict[str, float]:
    """One sum as the hospital's ledger keeps it: the noise's variance it counts on (the honest hospitals' shares)
    and the sensitivities."""
    l1, l2 = sensitivities(params)
    return {"mechanism": MECHANISM, "variance": honest * params.local_variance, "l1": l1, "l2": l2}


def effective_noise_multiplier(params: Parameters, honest: int) -> float:
    """The noise multiplier the sum has when only ``honest`` hospitals' shares count: z sqrt(honest / n)."""
    return params.noise_multiplier * math.sqrt(honest / params.hospitals)


def rdp(releases: list[dict[str, Any]], orders: tuple[int, ...] = ORDERS) -> np.ndarray:
    """The Rényi DP, at every order, of a sequence of releases: Skellam sums (:func:`release`) and Gaussian ones
    (``{"mechanism": "gaussian", "noise-multiplier": z}``, z relative to the sensitivity); RDP composes by
    adding up. An entry without noise makes it infinite."""
    total = np.zeros(len(orders))
    for entry in releases:
        if entry.get("mechanism") == MECHANISM:
            total += [skellam_rdp(a, float(entry["variance"]), float(entry["l1"]), float(entry["l2"]))
                      for a in orders]
        elif entry.get("mechanism") == POISSON_GAUSSIAN:  # patient-level DP-SGD (common/trust/patient_dp.py)
            from opacus.accountants.analysis.rdp import compute_rdp  # Opacus's RDP of the subsampled Gaussian

            total += compute_rdp(q=float(entry["sample-rate"]), noise_multiplier=float(entry["noise-multiplier"]),
                                 steps=int(entry["steps"]), orders=list(orders))
        elif entry.get("mechanism") == "gaussian" and entry.get("noise-multiplier"):
            total += np.asarray(orders, dtype=np.float64) / (2 * float(entry["noise-multiplier"]) ** 2)
        else:
            return np.full(len(orders), math.inf)
    return total


def epsilon(releases: list[dict[str, Any]], delta: float, orders: tuple[int, ...] = ORDERS) -> float:
    """(epsilon, ``delta``)-DP of the releases: RDP turned into epsilon as Google's dp-accounting and Opacus do
    (Balle et al. 2020, Proposition 12), at the best order."""
    if not releases:
        return 0.0
    values = rdp(releases, orders)
    if not np.isfinite(values).all():
        return math.inf
    orders_ = np.asarray(orders, dtype=np.float64)
    eps = values + np.log1p(-1 / orders_) - (math.log(delta) + np.log(orders_)) / (orders_ - 1)
    return float(max(0.0, np.min(eps)))


# --- the method's model contribution in and out of the noised entry ------------------------------------------------
MODEL_PARTS_KEY = PREFIX + "model-parts"  #: in the round plan: [name, shape] of each model tensor, in order


def model_parts(plan: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    return [(str(name), tuple(int(d) for d in shape)) for name, shape in plan.get(MODEL_PARTS_KEY) or []]


def method_layout(plan: Mapping[str, Any]):
    """The layout a method's ``contribution`` fills (its weight and its model tensors) before they are noised."""
    from .vector import Entry, Layout

    return Layout((Entry("weight", ()), *(Entry(f"model/{name}", shape) for name, shape in model_parts(plan))))


def contribute(values: Mapping[str, np.ndarray], params: Parameters, plan: Mapping[str, Any],
               rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A method's contribution (weight and model tensors) as the round sums it: the weight as it is, the model
    tensors as one privatised entry."""
    parts = model_parts(plan)
    flat = np.concatenate([np.asarray(values[f"model/{name}"], dtype=np.float64).ravel() for name, _ in parts])
    return {"weight": np.asarray(values["weight"]), NOISED: privatize(flat, params, rng)}


def expand(sums: Mapping[str, np.ndarray], plan: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The decoded sums of a round with distributed DP as the method's ``apply`` takes them: the noised entry back
    as the model tensors' noisy sums."""
    params = Parameters.from_plan(plan)
    if params is None or NOISED not in sums:
        return dict(sums)
    flat, result, offset = decode(sums[NOISED], params), {k: v for k, v in sums.items() if k != NOISED}, 0
    for name, shape in model_parts(plan):
        size = int(np.prod(shape))
        result[f"model/{name}"] = flat[offset:offset + size].reshape(shape)
        offset += size
    return result
