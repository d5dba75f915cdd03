"""Secure aggregation (SecAgg+) for fedmed's Message-API strategies, on Flower 1.42's own primitives.

Flower 1.42 has SecAgg+ only for its legacy API (``SecAggPlusWorkflow`` and ``secaggplus_mod``). This module holds
the protocol's pieces as plain functions, with no transport: the server's side
(:func:`plan_round` ... :func:`unmask_sum`, ported from ``flwr/server/workflow/secure_aggregation/
secaggplus_workflow.py`` with its checks) and the hospital's (:func:`hospital_stage`, which calls Flower's own
``_setup``, ``_share_keys`` and ``_unmask`` of ``flwr/client/mod/secure_aggregation/secaggplus_mod.py`` on its
``SecAggPlusState``, and masks an integer vector as its ``_collect_masked_vectors`` does). Every cryptographic step
is Flower's: key pairs and ECDH shared keys (``flwr.supercore.primitives.asymmetric``,
``crypto.symmetric_encryption``), Fernet encryption of the key shares, Shamir secret sharing (``crypto.shamir``),
the masks' generator (``secaggplus_utils.pseudo_rand_gen``) and the stochastic quantisation (``quantization``).
``strategies/secure_aggregation.py`` moves these stages as Flower messages over any ``Grid``;
``client_app/secure_aggregation.py`` answers them at the hospital.

What is summed is a vector of integers described by a :class:`Layout`: float entries are clipped to
``[-clipping-range, clipping-range]`` and stochastically quantised to ``[0, quantization-range]`` (Flower's
``quantize``), integer entries (FedProIn's influence counts, QFedPolyp's codes) are summed exactly. The sum of the
hospitals' vectors modulo ``modulus`` is all the server learns; :data:`SECURE_METHODS` says, per method, what each
hospital contributes and how the server turns the sums into its next state (docs/secure-aggregation.md).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
from pydantic import Field, field_validator, model_validator

from common.payload import NamedArrays, Payload
from common.settings import Section

if TYPE_CHECKING:  # the hospital side imports neither torch nor the methods; Flower when first used (below)
    from flwr.app import ConfigRecord
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState

    from common.config import JobConfig
    from common.methods.base import HospitalInfo, ServerMethod

log = logging.getLogger("fedmed")

# --- settings -----------------------------------------------------------------------------------------------------


class SecureAggregationSettings(Section):
    """``[secure-aggregation]``: SecAgg+ over each round's hospitals (docs/secure-aggregation.md). The server learns
    the sum of the hospitals' contributions only; each hospital bounds its own update before masking it."""

    enabled: bool = Field(False, description=(
        "Run every training round as SecAgg+ (setup, share keys, collect masked vectors, unmask): the server sees "
        "sums, never one hospital's update. Methods: fedavg, fedprox, moon, fedbn, fedproin, qfedpolyp."))
    num_shares: float = Field(1.0, gt=0.0, description=(
        "How many hospitals (itself included) each hospital shares its secrets with: a fraction (<= 1) of the "
        "round's hospitals, or a count (> 1, whole). 1.0: every hospital of the round (SecAgg); fewer: SecAgg+."))
    reconstruction_threshold: float = Field(0.5, gt=0.0, description=(
        "Shares needed to rebuild a secret: a fraction (<= 1) of num-shares (at least 2), or a count (> 1, whole). "
        "A round survives hospitals dropping out after sharing keys while each hospital keeps this many live "
        "neighbours; the server with fewer than this many colluding hospitals learns no single update."))
    clipping_range: float = Field(8.0, gt=0.0, description=(
        "Float contributions are clipped to [-clipping-range, clipping-range] before quantisation (Flower's "
        "default 8). The quantisation step is 2 x clipping-range / quantization-range."))
    quantization_range: int = Field(2**22, ge=2, description=(
        "Float contributions are quantised to integers in [0, quantization-range] (Flower's default 2^22)."))
    modulus_range: int = Field(2**32, ge=4, description=(
        "The sums are taken modulo this power of 2 (Flower's default 2^32); round hospitals x quantization-range "
        "must stay below it. QFedPolyp sums its codes modulo 2^(b + ceil(log2 H) + 1) instead."))
    update_norm_bound: float = Field(0.0, ge=0.0, description=(
        "L2 bound every hospital clips its model update to before masking it (what replaces the server's "
        "update-norm rule, which cannot see single updates). 0: update-norm-factor decides."))
    update_norm_factor: float = Field(10.0, ge=0.0, description=(
        "Without update-norm-bound: hospitals clip their update to this many times the L2 norm of the previous "
        "round's aggregated update (none in the first round; 0: no clipping)."))
    stage_timeout: float = Field(0.0, ge=0.0, description=(
        "Seconds the server waits for the replies of each key stage (setup, share keys, unmask); 0: round-timeout."))
    code_range_margin: float = Field(0.5, ge=0.0, description=(
        "QFedPolyp: the shared code range of each tensor is the global tensor's [min, max] widened by this fraction "
        "of its span (BatchNorm statistics: four times as much); values outside are clipped."))

    @field_validator("num_shares", "reconstruction_threshold")
    @classmethod
    def _fraction_or_count(cls, value: float) -> float:
        if value > 1 and value != int(value):
            raise ValueError(f"{value!r}: a fraction is at most 1, a count is a whole number")
        return value

    @field_validator("modulus_range")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1) or value > 2**32:
            raise ValueError(f"{value} is not a power of 2 up to 2^32 (Flower's masks are drawn below it)")
        return value

    @model_validator(mode="after")
    def _ranges(self) -> "SecureAggregationSettings":
        if self.modulus_range <= self.quantization_range:
            raise ValueError(f"modulus-range={self.modulus_range} must exceed quantization-range="
                             f"{self.quantization_range}")
        if 1 < self.num_shares < 3:
            raise ValueError("num-shares as a count must be at least 3 (Flower's SecAgg+ rule)")
        if self.num_shares > 1 and self.reconstruction_threshold > 1 \
                and self.reconstruction_threshold >= self.num_shares:
            raise ValueError(f"reconstruction-threshold={self.reconstruction_threshold:g} must be below num-shares="
                             f"{self.num_shares:g}")
        return self


# --- the summed vector ---------------------------------------------------------------------------------------------

FLOAT, INTEGER = "f", "i"


@dataclass(frozen=True)
class Entry:
    """One named part of the summed vector: ``kind`` FLOAT (clipped and quantised) or INTEGER (summed exactly, each
    hospital adding at most ``bound``)."""

    name: str
    shape: tuple[int, ...]
    kind: str = FLOAT
    bound: int = 0

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


@dataclass(frozen=True)
class Layout:
    """The parts of the vector every hospital of a round contributes, in order (the server sends it)."""

    entries: tuple[Entry, ...]

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def largest(self, quantization_range: int) -> int:
        """The largest value one hospital adds to any element of the sum."""
        return max([quantization_range if e.kind == FLOAT else e.bound for e in self.entries] or [0])

    def to_json(self) -> str:
        return json.dumps([[e.name, list(e.shape), e.kind, e.bound] for e in self.entries], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: Any) -> "Layout":
        try:
            items = json.loads(text)
            entries = tuple(Entry(str(n), tuple(int(d) for d in s), str(k), int(b)) for n, s, k, b in items)
        except Exception as error:
            raise ValueError(f"secure-aggregation layout cannot be read: {type(error).__name__}: {error}") from None
        if len({e.name for e in entries}) != len(entries) or any(
                e.kind not in (FLOAT, INTEGER) or e.bound < 0 or min(e.shape, default=0) < 0 for e in entries):
            raise ValueError("secure-aggregation layout repeats a name or has an unknown kind or a negative size")
        return cls(entries)


def encode(layout: Layout, values: Mapping[str, np.ndarray], clipping_range: float,
           quantization_range: int) -> np.ndarray:
    """One hospital's contribution as the layout's integer vector: float entries through Flower's ``quantize``
    (clipped, stochastic rounding to [0, quantization-range]), integer entries rounded and held to [0, bound]."""
    from flwr.common.secure_aggregation.quantization import quantize

    missing = [name for name in layout.names if name not in values]
    if missing or len(values) != len(layout.entries):
        raise ValueError(f"the contribution's parts {sorted(values)} are not the layout's {layout.names}")
    parts = []
    for entry in layout.entries:
        value = np.asarray(values[entry.name], dtype=np.float64)
        if value.shape != entry.shape:
            raise ValueError(f"contribution part {entry.name} has shape {value.shape}, the layout {entry.shape}")
        if not np.isfinite(value).all():
            raise ValueError(f"contribution part {entry.name} holds NaN or Inf")
        if entry.kind == FLOAT:
            part = quantize([value], clipping_range, quantization_range)[0]
        else:
            part = np.clip(np.rint(value), 0, entry.bound)
        parts.append(np.asarray(part, dtype=np.int64).ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def decode_sum(layout: Layout, total: np.ndarray, count: int, clipping_range: float,
               quantization_range: int) -> dict[str, np.ndarray]:
    """The sums of ``count`` hospitals' contributions from the unmasked vector: float entries in float64 (Flower's
    ``dequantize`` and its offset for ``count`` summands), integer entries as int64."""
    from flwr.common.secure_aggregation.quantization import dequantize

    if total.shape != (layout.size,):
        raise ValueError(f"the unmasked vector has {total.size} values, the layout {layout.size}")
    sums, offset = {}, 0
    for entry in layout.entries:
        part = np.asarray(total[offset:offset + entry.size], dtype=np.int64)
        offset += entry.size
        if entry.kind == FLOAT:
            value = dequantize([part], clipping_range, quantization_range)[0] - (count - 1) * clipping_range
        else:
            value = part
        sums[entry.name] = value.reshape(entry.shape)
    return sums


def modulus_bits(modulus: int) -> int:
    if modulus < 2 or modulus & (modulus - 1):
        raise ValueError(f"modulus {modulus} is not a power of 2")
    return modulus.bit_length() - 1


def packed_size(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack_values(values: np.ndarray, bits: int) -> np.ndarray:
    """Values below 2^bits as a little-endian bit stream, ``bits`` bits each (the masked vector on the wire: a
    masked value is uniform below the modulus, so this is as small as it gets)."""
    values = np.asarray(values).ravel()
    if bits in (8, 16, 32):
        return np.ascontiguousarray(values.astype(f"<u{bits // 8}")).view(np.uint8)
    width = 4 if bits <= 32 else 8
    chunks, step = [], 1 << 16  # 2^16 values of any width end on a byte boundary
    for start in range(0, values.size, step):
        part = np.ascontiguousarray(values[start:start + step].astype(f"<u{width}")).view(np.uint8)
        planes = np.unpackbits(part.reshape(-1, width), axis=1, bitorder="little")[:, :bits]
        chunks.append(np.packbits(planes.ravel(), bitorder="little"))
    return np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)


def unpack_values(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_values`; ValueError unless ``data`` is exactly ``count`` values' bytes."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 1 or data.size != packed_size(count, bits):
        raise ValueError(f"a masked vector of {count} values at {bits} bits is {packed_size(count, bits)} uint8 "
                         f"bytes, not {data.dtype} {data.shape}")
    if bits in (8, 16, 32):
        return data.view(f"<u{bits // 8}").astype(np.int64)
    width = 4 if bits <= 32 else 8
    result = np.zeros(count, dtype=np.int64)
    step = 1 << 16
    for start in range(0, count, step):
        n = min(step, count - start)
        first = start * bits // 8
        planes = np.unpackbits(data[first:first + packed_size(n, bits)], count=n * bits, bitorder="little")
        full = np.zeros((n, 8 * width), dtype=np.uint8)
        full[:, :bits] = planes.reshape(n, bits)
        result[start:start + n] = np.packbits(full, axis=1, bitorder="little").view(f"<u{width}").ravel()
    return result


# --- the protocol: keys of the messages -----------------------------------------------------------------------------

PREFIX = "secagg."
STAGE_KEY = PREFIX + "stage"  #: the stage a TRAIN message (and its reply) belongs to
PUBLIC_KEYS_PREFIX = PREFIX + "pk."  #: share-keys stage: + a node id -> [pk1, pk2] of that neighbour
MASKED_GROUP = "secagg.masked"  #: the reply's array group holding the packed masked vector
MASKED_ARRAY = "vector"
LAYOUT_KEY = PREFIX + "layout"
NORM_BOUND_KEY = PREFIX + "norm-bound"
WEIGHT_CAP_KEY = PREFIX + "weight-cap"
WEIGHT_BOUND_KEY = PREFIX + "weight-bound"
INFLUENCE_BOUND_KEY = PREFIX + "influence-bound"
GRID_BITS_KEY = PREFIX + "grid-bits"
CODE_WEIGHT_KEY = PREFIX + "code-weight"
RANGE_LOW_KEY = PREFIX + "range-low"
RANGE_HIGH_KEY = PREFIX + "range-high"
FILTER_WEIGHTS_KEY = PREFIX + "filter-weights"


def flower_keys(stage: str) -> tuple[str, ...]:
    """The keys of Flower's ConfigRecord for ``stage`` (all but share keys, whose keys are node ids)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

    keys = {Stage.SETUP: (Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD, Key.CLIPPING_RANGE, Key.TARGET_RANGE,
                          Key.MOD_RANGE, Key.MAX_WEIGHT),
            Stage.COLLECT_MASKED_VECTORS: (Key.CIPHERTEXT_LIST, Key.SOURCE_LIST),
            Stage.UNMASK: (Key.ACTIVE_NODE_ID_LIST, Key.DEAD_NODE_ID_LIST)}
    if stage not in keys:
        raise ValueError(f"unknown secure-aggregation stage {stage!r}")
    return keys[stage]


def ours(values: Mapping[str, Any]) -> dict[str, Any]:
    """Flower's SecAgg+ keys as they travel in our ConfigRecord (``secagg.`` + Flower's key)."""
    return {PREFIX + key: value for key, value in values.items()}


def flower_config(stage: str, config: Mapping[str, Any]) -> "ConfigRecord":
    """The ConfigRecord Flower's stage functions read, from a message's config (KeyError names a missing key)."""
    from flwr.app import ConfigRecord
    from flwr.common.secure_aggregation.secaggplus_constants import Stage

    if stage == Stage.SHARE_KEYS:
        return ConfigRecord({key.removeprefix(PUBLIC_KEYS_PREFIX): value for key, value in config.items()
                             if key.startswith(PUBLIC_KEYS_PREFIX)})
    return ConfigRecord({key: config[PREFIX + key] for key in flower_keys(stage)})


# --- the protocol: a hospital's side --------------------------------------------------------------------------------


def hospital_stage(state: "SecAggPlusState", stage: str, config: Mapping[str, Any], node_id: int,
                   vector: np.ndarray | None = None) -> tuple["SecAggPlusState", Any]:
    """One stage at a hospital: its new state and what it replies (setup: its public keys; share keys: its key
    shares encrypted for each neighbour; collect: ``vector`` masked; unmask: the shares the server asks for).

    Flower's stage order and config checks (``check_stage``, ``check_configs``) and its ``_setup``, ``_share_keys``
    and ``_unmask``; besides them a hospital refuses a threshold below 2, a node listed as both alive and dropped
    (the server would learn both its mask seed and its key, hence its update), and after the unmask stage it keeps
    no secret of the round."""
    from flwr.app import ConfigRecord
    from flwr.client.mod.secure_aggregation.secaggplus_mod import (
        SecAggPlusState,
        _setup,
        _share_keys,
        _unmask,
        check_configs,
        check_stage,
    )
    from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

    check_stage(state.current_stage, ConfigRecord({Key.STAGE: stage}))
    flower = flower_config(stage, config)
    check_configs(stage, flower)
    if stage == Stage.SETUP:
        state = SecAggPlusState()
        state.current_stage, state.nid = stage, int(node_id)
        answer = _setup(state, flower)
        problem = setup_problem(state)
        if problem:
            raise ValueError(f"secure aggregation refused: {problem}")
        return state, answer
    state.current_stage = stage
    if stage == Stage.SHARE_KEYS:
        if state.nid not in {int(nid) for nid in flower}:
            raise ValueError("secure aggregation refused: the server's key list leaves out this hospital's keys")
        return state, _share_keys(state, flower)
    if stage == Stage.COLLECT_MASKED_VECTORS:
        if vector is None:
            raise ValueError("the collect stage masks a vector: none was given")
        return state, mask_vector(state, flower, vector)
    active, dead = set(flower[Key.ACTIVE_NODE_ID_LIST]), set(flower[Key.DEAD_NODE_ID_LIST])
    if active & dead or state.nid not in active:
        raise ValueError("secure aggregation refused: the unmask request lists a hospital as both alive and "
                         "dropped, or this hospital as dropped")
    unknown = (active | dead) - set(state.public_keys_dict)
    if unknown:
        raise ValueError(f"secure aggregation refused: the unmask request names nodes {sorted(unknown)} that are "
                         "not this hospital's neighbours")
    answer = _unmask(state, flower)
    done = SecAggPlusState()  # nothing of the round's secrets is kept once the server has its shares
    done.current_stage = Stage.UNMASK
    return done, answer


def setup_problem(state: "SecAggPlusState") -> str | None:
    """Why a hospital will not run a round with these parameters (None: it will)."""
    if not 2 <= state.threshold <= state.share_num <= state.sample_num:
        return (f"threshold {state.threshold}, shares {state.share_num} and hospitals {state.sample_num} must satisfy "
                "2 <= threshold <= shares <= hospitals (a threshold below 2 gives every secret away)")
    if state.mod_range < 4 or state.mod_range & (state.mod_range - 1) or state.mod_range > 2**62:
        return f"modulus {state.mod_range} is not a power of 2 up to 2^62"
    if not 2 <= state.target_range < state.mod_range or not state.clipping_range > 0:
        return (f"quantisation range {state.target_range} and clipping range {state.clipping_range} do not fit the "
                f"modulus {state.mod_range}")
    return None


def mask_vector(state: "SecAggPlusState", flower: "ConfigRecord", vector: np.ndarray) -> np.ndarray:
    """Flower's ``_collect_masked_vectors`` for an integer vector of ours: decrypt and check the neighbours' key
    shares, then add the private mask and the pairwise masks, modulo the round's modulus."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, generate_shared_key
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen, share_keys_plaintext_separate
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    ciphertexts, sources = list(flower[Key.CIPHERTEXT_LIST]), [int(s) for s in flower[Key.SOURCE_LIST]]
    if len(ciphertexts) + 1 < state.threshold:
        raise ValueError("Not enough available neighbour clients.")
    if len(set(sources)) != len(sources) or len(sources) != len(ciphertexts):
        raise ValueError("the server forwarded key shares twice from one hospital, or shares without a source")
    available = []
    for source, ciphertext in zip(sources, ciphertexts, strict=True):
        if source not in state.ss2_dict:
            raise ValueError(f"Node {state.nid}: received key shares from {source}, which is not its neighbour")
        actual, destination, seed_share, key_share = share_keys_plaintext_separate(
            decrypt(state.ss2_dict[source], ciphertext))
        if actual != source:
            raise ValueError(f"Node {state.nid}: received ciphertext from {actual} instead of {source}.")
        if destination != state.nid:
            raise ValueError(f"Node {state.nid}: received an encrypted message for Node {destination} from {source}.")
        state.rd_seed_share_dict[source] = seed_share
        state.sk1_share_dict[source] = key_share
        available.append(source)
    vector = np.asarray(vector, dtype=np.int64).ravel()
    if vector.size and (vector.min() < 0 or vector.max() >= state.mod_range):
        raise ValueError(f"the vector to mask leaves [0, {state.mod_range})")
    shape = [vector.shape]
    masked = vector + pseudo_rand_gen(state.rd_seed, state.mod_range, shape)[0]
    own_key = bytes_to_private_key(state.sk1)
    for node in available:
        shared = generate_shared_key(own_key, bytes_to_public_key(state.public_keys_dict[node][0]))
        pairwise = pseudo_rand_gen(shared, state.mod_range, shape)[0]
        masked = masked + pairwise if state.nid > node else masked - pairwise
    return np.mod(masked, state.mod_range)


# --- the protocol: the server's side --------------------------------------------------------------------------------


@dataclass
class ServerRound:
    """The server's state of one SecAgg+ round (Flower's ``WorkflowState``), by node id."""

    nodes: list[int]
    num_shares: int
    threshold: int
    clipping_range: float
    quantization_range: int
    modulus: int
    size: int  #: values in the summed vector
    neighbours: dict[int, set[int]] = field(default_factory=dict)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    setup_done: set[int] = field(default_factory=set)  #: sent their public keys
    keyed: set[int] = field(default_factory=set)  #: shared their keys: their neighbours mask with them
    masked: set[int] = field(default_factory=set)  #: their masked vector is in ``total``
    forward: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)  #: node -> (sources, shares)
    asked: dict[int, set[int]] = field(default_factory=dict)  #: unmask stage: whose shares each node was asked for
    total: np.ndarray | None = None
    lost: dict[int, str] = field(default_factory=dict)  #: node -> the stage it was lost in, and why

    @property
    def dropped(self) -> set[int]:
        """Shared keys but their vector is not in the sum: the server removes their pairwise masks."""
        return self.keyed - self.masked


def share_plan(count: int, num_shares: float, reconstruction_threshold: float) -> tuple[int, int]:
    """(shares, threshold) for ``count`` hospitals, as Flower's ``SecAggPlusWorkflow`` derives them from fractions
    or counts (an odd share count for SecAgg+, at least 2 for the threshold)."""
    if num_shares <= 1:
        shares = round(num_shares * count)
        if shares < count and shares % 2 == 0:
            shares += 1
        if shares <= 2:
            shares = count
    else:
        shares = int(num_shares)
    shares = min(shares, count)
    threshold = max(round(reconstruction_threshold * shares), 2) if reconstruction_threshold <= 1 \
        else int(reconstruction_threshold)
    return shares, threshold


def plan_round(nodes: list[int], settings: SecureAggregationSettings, seed: Any, size: int,
               modulus: int | None = None, quantization_range: int | None = None) -> ServerRound:
    """A round over ``nodes`` summing vectors of ``size`` values: shares, threshold and each node's neighbours
    (Flower's ring over a shuffled order, here seeded by ``seed``); ValueError when it cannot run."""
    nodes = sorted(int(n) for n in nodes)
    if len(nodes) < 2:
        raise ValueError(f"secure aggregation needs at least 2 hospitals in a round, not {len(nodes)}")
    shares, threshold = share_plan(len(nodes), settings.num_shares, settings.reconstruction_threshold)
    if not 2 <= threshold <= shares:
        raise ValueError(f"reconstruction threshold {threshold} with {shares} shares over {len(nodes)} hospitals "
                         "cannot run (2 <= threshold <= shares)")
    order = [nodes[i] for i in np.random.default_rng(seed).permutation(len(nodes))]
    half = shares >> 1
    neighbours = {node: {order[(i + offset) % len(order)] for offset in range(-half, half + 1)}
                  for i, node in enumerate(order)}
    return ServerRound(nodes, shares, threshold, settings.clipping_range,
                       quantization_range or settings.quantization_range, modulus or settings.modulus_range, size,
                       neighbours)


def setup_config(plan: ServerRound) -> dict[str, Any]:
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    return ours({Key.SAMPLE_NUMBER: len(plan.nodes), Key.SHARE_NUMBER: plan.num_shares, Key.THRESHOLD: plan.threshold,
                 Key.CLIPPING_RANGE: float(plan.clipping_range), Key.TARGET_RANGE: int(plan.quantization_range),
                 Key.MOD_RANGE: int(plan.modulus), Key.MAX_WEIGHT: 1.0})


def threshold_problem(plan: ServerRound, alive: set[int], owners: set[int]) -> str | None:
    """Why the round cannot go on (None: it can): an owner of secrets whose live neighbours are fewer than the
    threshold (Flower's ``_check_threshold``, over the nodes whose secrets the server will need)."""
    short = {node: len(plan.neighbours[node] & alive) for node in sorted(owners)
             if len(plan.neighbours[node] & alive) < plan.threshold}
    if short:
        return (f"{len(short)} hospital(s) have fewer live neighbours than the reconstruction threshold "
                f"{plan.threshold} ({', '.join(f'node {n}: {k}' for n, k in list(short.items())[:5])})")
    return None


def receive_public_keys(plan: ServerRound, replies: Mapping[int, Mapping[str, Any]]) -> None:
    """Setup replies: each node's two public keys (bytes, unique across the round)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    seen: set[bytes] = set()
    for node in sorted(replies):
        config = replies[node]
        pk1, pk2 = config.get(PREFIX + Key.PUBLIC_KEY_1), config.get(PREFIX + Key.PUBLIC_KEY_2)
        if node not in plan.nodes or not all(isinstance(k, bytes) and 0 < len(k) <= 512 for k in (pk1, pk2)):
            plan.lost.setdefault(node, "setup: no public keys in its reply")
            continue
        if pk1 in seen or pk2 in seen or pk1 == pk2:
            plan.lost.setdefault(node, "setup: a public key another hospital also sent")
            continue
        seen |= {pk1, pk2}
        plan.public_keys[node] = (pk1, pk2)
        plan.setup_done.add(node)


def share_keys_config(plan: ServerRound, node: int) -> dict[str, Any]:
    """What ``node`` gets in the share-keys stage: the public keys of its neighbours that finished setup."""
    return {f"{PUBLIC_KEYS_PREFIX}{other}": list(plan.public_keys[other])
            for other in sorted(plan.neighbours[node] & plan.setup_done)}


def receive_key_shares(plan: ServerRound, replies: Mapping[int, Mapping[str, Any]]) -> None:
    """Share-keys replies: each node's encrypted shares, one per neighbour, forwarded to nodes that also answered."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    sources: dict[int, list[int]] = {}
    for node in sorted(replies):
        config = replies[node]
        destinations, ciphertexts = config.get(PREFIX + Key.DESTINATION_LIST), config.get(PREFIX + Key.CIPHERTEXT_LIST)
        allowed = (plan.neighbours[node] & plan.setup_done) - {node}
        if not isinstance(destinations, list) or not isinstance(ciphertexts, list) \
                or len(destinations) != len(ciphertexts) or set(destinations) != allowed \
                or len(set(destinations)) != len(destinations) \
                or not all(isinstance(c, bytes) and len(c) <= 8192 for c in ciphertexts):
            plan.lost.setdefault(node, "share keys: its key shares are not one per neighbour")
            continue
        sources[node] = list(zip(destinations, ciphertexts))
        plan.keyed.add(node)
    plan.forward = {node: ([], []) for node in plan.keyed}
    for source in sorted(plan.keyed):
        for destination, ciphertext in sources[source]:
            if destination in plan.forward:
                plan.forward[destination][0].append(source)
                plan.forward[destination][1].append(ciphertext)


def collect_config(plan: ServerRound, node: int) -> dict[str, Any]:
    """What ``node`` gets with its training message: its neighbours' encrypted key shares."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    sources, ciphertexts = plan.forward[node]
    return ours({Key.CIPHERTEXT_LIST: list(ciphertexts), Key.SOURCE_LIST: list(sources)})


def add_masked_vector(plan: ServerRound, node: int, vector: np.ndarray) -> None:
    """A node's masked vector into the running sum (ValueError: wrong size or a value at or above the modulus)."""
    vector = np.asarray(vector, dtype=np.int64)
    if node not in plan.keyed or node in plan.masked:
        raise ValueError(f"node {node} did not share keys this round, or sent its vector twice")
    if vector.shape != (plan.size,) or (vector.size and (vector.min() < 0 or vector.max() >= plan.modulus)):
        raise ValueError(f"its masked vector is not {plan.size} values below {plan.modulus}")
    plan.total = vector.copy() if plan.total is None else np.mod(plan.total + vector, plan.modulus)
    plan.masked.add(node)


def unmask_config(plan: ServerRound, node: int) -> dict[str, Any]:
    """What ``node`` is asked in the unmask stage: its neighbours whose vector is in the sum (their mask seeds) and
    those that shared keys but whose vector is not (their pairwise-mask keys)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    active = sorted(plan.neighbours[node] & plan.masked)
    dead = sorted(plan.neighbours[node] & plan.dropped)
    plan.asked[node] = set(active) | set(dead)
    return ours({Key.ACTIVE_NODE_ID_LIST: active, Key.DEAD_NODE_ID_LIST: dead})


def unmask_sum(plan: ServerRound, replies: Mapping[int, Mapping[str, Any]]) -> np.ndarray:
    """The sum of the masked nodes' vectors modulo the modulus: every private mask and every pairwise mask with a
    node that dropped out removed, each rebuilt from at least ``threshold`` shares (Flower's ``unmask_stage``).
    ValueError when some secret has too few shares or its shares do not combine."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    if plan.total is None:
        raise ValueError("no masked vector was received")
    collected: dict[int, list[bytes]] = {node: [] for node in plan.masked | plan.dropped}
    for node in sorted(replies):
        config = replies[node]
        owners, shares = config.get(PREFIX + Key.NODE_ID_LIST), config.get(PREFIX + Key.SHARE_LIST)
        if not isinstance(owners, list) or not isinstance(shares, list) or len(owners) != len(shares) \
                or len(set(owners)) != len(owners) or not set(owners) <= plan.asked.get(node, set()) \
                or not all(isinstance(s, bytes) for s in shares):
            plan.lost.setdefault(node, "unmask: its shares are not the ones asked for")
            continue
        for owner, share in zip(owners, shares):
            collected[owner].append(share)
    total, shape = plan.total.copy(), [(plan.size,)]
    for owner, shares in sorted(collected.items()):
        if len(shares) < plan.threshold:
            raise ValueError(f"only {len(shares)} share(s) of node {owner}'s secret came back, fewer than the "
                             f"reconstruction threshold {plan.threshold}")
        try:
            secret = combine_shares(shares[:plan.threshold])
        except Exception as error:
            raise ValueError(f"the shares of node {owner}'s secret do not combine ({error})") from None
        if owner in plan.masked:  # its private mask seed
            total = total - pseudo_rand_gen(secret, plan.modulus, shape)[0]
            continue
        try:  # a node that dropped out: its key rebuilds the pairwise masks its live neighbours added
            private = bytes_to_private_key(secret)
        except Exception as error:
            raise ValueError(f"the key rebuilt for node {owner} is not a key ({error})") from None
        for other in sorted(plan.neighbours[owner] & plan.masked):
            shared = generate_shared_key(private, bytes_to_public_key(plan.public_keys[other][0]))
            pairwise = pseudo_rand_gen(shared, plan.modulus, shape)[0]
            total = total + pairwise if owner > other else total - pairwise
    return np.mod(total, plan.modulus)


# --- what each method sums ------------------------------------------------------------------------------------------


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
    """n_i / W: the hospital's sample count, at most the server's cap for it, over the server's bound W."""
    count = reply.metrics.get("num-examples")
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not count > 0:
        raise ValueError(f"the reply's num-examples {count!r} is not a positive count")
    return min(float(count), float(params[WEIGHT_CAP_KEY])) / float(params[WEIGHT_BOUND_KEY])


def sample_shares(job: "JobConfig", hospitals: list["HospitalInfo"]) -> tuple[list[float], float]:
    """Each hospital's cap on its weight and their bound W, from the counts they declared when they joined, under
    the screening rules the server applies to reported counts (``screening.sample-ratio-limit``,
    ``screening.max-hospital-weight``): so no hospital weighs more than it declared or than those rules allow."""
    from common.screening import capped_shares, ratio_capped_weights

    weights, _ = ratio_capped_weights([float(h.num_examples) for h in hospitals], job.screening.sample_ratio_limit)
    bound = float(sum(weights))
    shares = capped_shares(weights, job.screening.max_hospital_weight)
    return [float(share) * bound for share in shares], bound


def float_entries(arrays: Mapping[str, np.ndarray], prefix: str = "model/", skip: tuple[str, ...] = ()) -> list[Entry]:
    return [Entry(prefix + name, tuple(np.shape(arrays[name]))) for name in float_names(arrays) if name not in skip]


def weighted_plan(method: "ServerMethod", hospitals: list["HospitalInfo"], settings: SecureAggregationSettings,
                  norm_bound: float, arrays: Mapping[str, np.ndarray], extra: tuple[Entry, ...] = (),
                  skip: tuple[str, ...] = (), extra_config: Mapping[str, Any] | None = None) -> MethodPlan:
    """FedAvg family: each hospital sums (n_i/W) x its update and n_i/W."""
    caps, bound = sample_shares(method.cfg, hospitals)
    layout = Layout((Entry("weight", ()), *float_entries(arrays, skip=skip), *extra))
    config = {h.name: {WEIGHT_CAP_KEY: cap, WEIGHT_BOUND_KEY: bound, NORM_BOUND_KEY: float(norm_bound),
                       LAYOUT_KEY: layout.to_json(), **dict(extra_config or {})} for h, cap in zip(hospitals, caps)}
    return MethodPlan(layout, settings.modulus_range, settings.quantization_range, config,
                      {"weight-bound": bound, "caps": {h.name: cap for h, cap in zip(hospitals, caps)},
                       "norm-bound": float(norm_bound), "step": 2 * settings.clipping_range /
                       settings.quantization_range})


def check_bounds(sums: Mapping[str, np.ndarray], plan: MethodPlan, updates: list) -> None:
    """What the server can still verify of a FedAvg-family sum (ValueError: some hospital sent a vector outside
    its bounds, which masking hides but cannot undo): the weights add up to no more than the survivors' caps
    allow, and the mean update, a convex combination of updates each clipped to the norm bound, is no longer than
    that bound (plus the quantisation error)."""
    context, count = plan.context, len(updates)
    total = float(sums["weight"])
    allowed = sum(context["caps"][u.hospital.name] for u in updates) / context["weight-bound"]
    slack = count * context["step"]
    if not 0 < total <= allowed + slack:
        raise ValueError(f"the hospitals' weights sum to {total:.6g}, outside (0, {allowed:.6g}] that their caps "
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


def fedavg_plan(method, hospitals, settings, norm_bound) -> MethodPlan:
    return weighted_plan(method, hospitals, settings, norm_bound, method.global_arrays)


def fedavg_apply(method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
    check_bounds(sums, plan, updates)
    record = method.aggregate(rnd, [stand_in(updates, mean_update(sums, method.global_arrays))])
    if "hospital-average" in record:  # FedMEPD's FedAvg baseline: the hospitals' own scores, said in the clear
        from strategies.fedmepd.harness import hospital_average

        record["hospital-average"] = hospital_average(updates)
    return record


def fedavg_refuse(job: "JobConfig") -> str | None:
    if job.screening.robust_aggregate != "mean":
        return (f"screening.robust-aggregate={job.screening.robust_aggregate!r} needs every hospital's update; "
                "a secure sum gives the mean only")
    return None


def fedbn_plan(method, hospitals, settings, norm_bound) -> MethodPlan:
    return weighted_plan(method, hospitals, settings, norm_bound, method.shared())


def fedbn_apply(method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
    """The shared part moves by the mean update; the normalisation layers never leave the hospitals (so the server
    scores the shared weights with the initial ones: a new site's model)."""
    check_bounds(sums, plan, updates)
    shared = mean_update(sums, method.shared())
    method.global_arrays = {k: shared.get(k, v) for k, v in method.global_arrays.items()}
    return {}


INFLUENCE = "influence"  #: FedProIn's reply metric (strategies/fedproin/messages.py), summed here instead


def fedproin_plan(method, hospitals, settings, norm_bound) -> MethodPlan:
    """FedProIn: the encoder as FedAvg; the influence counts I_i (exactly, as integers) and, for NIA, the
    influence-weighted prototype updates I_i[c, k] x (P_i - P)[c, k] / W_I, W_I the largest declared count."""
    prototypes = method.global_arrays["prototypes"]
    influence_bound = max(int(h.num_examples) for h in hospitals)
    nia = method.cfg.fedproin.aggregation == "nia"
    extra = [Entry(INFLUENCE, tuple(prototypes.shape[:2]), INTEGER, influence_bound)]
    if nia:
        extra.append(Entry("prototype-sum", tuple(prototypes.shape)))
    plan = weighted_plan(method, hospitals, settings, norm_bound, method.global_arrays, tuple(extra),
                         skip=("prototypes",) if nia else (), extra_config={INFLUENCE_BOUND_KEY: influence_bound})
    plan.context["influence-bound"] = influence_bound
    return plan


def fedproin_contribution(received: Payload, reply: Payload, params: Mapping[str, Any],
                          layout: Layout) -> Contribution:
    model_in, model_out = received.arrays.get("model", {}), reply.arrays.get("model", {})
    names = float_names(model_in)
    change = model_change(model_in, model_out, names)
    change, clipped = clip_update(change, float(params[NORM_BOUND_KEY]))
    weight = sample_weight(reply, params)
    entries = {e.name: e for e in layout.entries}
    raw = reply.metrics.get(INFLUENCE)
    if not isinstance(raw, (list, tuple, np.ndarray)) or np.size(raw) != entries[INFLUENCE].size:
        raise ValueError(f"the reply carries no influence matrix of {entries[INFLUENCE].size} counts")
    bound = float(params[INFLUENCE_BOUND_KEY])
    counts = np.clip(np.rint(np.asarray(raw, dtype=np.float64)), 0, bound).reshape(entries[INFLUENCE].shape)
    values = {"weight": np.asarray(weight), INFLUENCE: counts}
    values.update({name: weight * change[name.removeprefix("model/")] for name in entries if name.startswith("model/")})
    if "prototype-sum" in entries:
        values["prototype-sum"] = counts[..., None] * change["prototypes"] / bound
    return values, {"secagg-clipped": int(clipped)}


def fedproin_apply(method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
    """Encoder by the mean update; prototypes by NIA from the two sums: P + (sum I D / W_I) W_I / sum I where
    sum I > 0, the previous prototype where it is 0 (FedProIn's own ``aggregate`` then keeps its bookkeeping:
    unused prototypes, re-seeding)."""
    nia = "prototype-sum" in sums
    arrays = mean_update(sums, method.global_arrays, skip=("prototypes",) if nia else ())
    counts = np.asarray(sums[INFLUENCE], dtype=np.int64)
    if nia:
        previous = method.global_arrays["prototypes"]
        moved = previous.astype(np.float64).copy()
        used = counts > 0
        moved[used] += sums["prototype-sum"][used] * plan.context["influence-bound"] / counts[used][:, None]
        arrays["prototypes"] = moved.astype(previous.dtype)
    record = method.aggregate(rnd, [stand_in(updates, arrays, {INFLUENCE: counts.ravel().tolist()})])
    record.pop(INFLUENCE, None)  # the one stand-in's: the same as prototype-usage
    return record


# QFedPolyp: codes on a grid the server sets, summed as integers ------------------------------------------------------
FLOAT_GRID_BITS = 24  #: the shared grid of a hospital that sends plain floats (bit-width 32)


def grid_bits(bits: int) -> int:
    return FLOAT_GRID_BITS if bits >= 32 else int(bits)


def is_statistic(name: str) -> bool:
    return name.endswith(("running_mean", "running_var"))


def code_ranges(arrays: Mapping[str, np.ndarray], margin: float) -> tuple[list[float], list[float]]:
    """The shared range of each float tensor: its global [min, max] widened by ``margin`` x its span (at least
    ``margin`` x its largest magnitude, or 0.1); BatchNorm statistics four times as much (at least 4 x ``margin``:
    the first round's are the initial 0 and 1), variances above 0."""
    lows, highs = [], []
    for name in float_names(arrays):
        value = np.asarray(arrays[name], dtype=np.float64)
        low, high = float(value.min()), float(value.max())
        floor, factor = (1.0, 4) if is_statistic(name) else (0.1, 1)  # BatchNorm: init 0 and 1, data decides
        wide = margin * max(high - low, float(np.abs(value).max()), floor) * factor
        low, high = low - wide, high + wide
        if name.endswith("running_var"):
            low = max(low, float(value.min()) / 4)
        lows.append(low)
        highs.append(high)
    return lows, highs


def qfedpolyp_refuse(job: "JobConfig") -> str | None:
    settings = job.qfedpolyp
    if settings.quantise != "weights" or settings.downlink != "model" or settings.downlink_bit_width != 32:
        return ("QFedPolyp sums codes of the hospitals' weights on a shared grid: it needs qfedpolyp.quantise="
                "'weights', downlink='model' and downlink-bit-width=32 (updates, deltas and quantised downlinks are "
                "left for later)")
    return None


def qfedpolyp_plan(method, hospitals, settings, norm_bound) -> MethodPlan:
    """Each hospital's weights as codes at its own bit-width b_i on a shared dyadic grid per tensor, lifted to the
    round's finest grid B (code << (B - b_i)) and weighted by w_i = share_i / max share (stochastic rounding), so the
    sum stays below 2^(B + ceil(log2 H)) and is taken modulo 2^(B + ceil(log2 H) + 1)."""
    caps, _ = sample_shares(method.cfg, hospitals)
    bits = {h.name: int(method.assigned[h.name]) for h in hospitals}
    finest = max(grid_bits(b) for b in bits.values())
    count = len(hospitals)
    modulus = 2 ** (finest + math.ceil(math.log2(count)) + 1)
    arrays = method.global_arrays
    lows, highs = code_ranges(arrays, settings.code_range_margin)
    layout = Layout(tuple(Entry(f"code/{name}", tuple(np.shape(arrays[name])), INTEGER, 2 ** finest - 1)
                          for name in float_names(arrays)))
    largest = max(caps)
    weights = {h.name: cap / largest for h, cap in zip(hospitals, caps)}
    config = {h.name: {GRID_BITS_KEY: finest, CODE_WEIGHT_KEY: weights[h.name], RANGE_LOW_KEY: lows,
                       RANGE_HIGH_KEY: highs, NORM_BOUND_KEY: float(norm_bound), LAYOUT_KEY: layout.to_json()}
              for h in hospitals}
    return MethodPlan(layout, modulus, 2 ** finest, config,
                      {"weights": weights, "lows": lows, "highs": highs, "grid-bits": finest, "bits": bits})


def qfedpolyp_contribution(received: Payload, reply: Payload, params: Mapping[str, Any],
                           layout: Layout) -> Contribution:
    from common.quantization.codec import check_bit_width, decode_model  # torch: QFedPolyp's hospitals have it
    from strategies.qfedpolyp.messages import BIT_WIDTH_KEY, PACKED

    model_in = decode_model(received.arrays[PACKED], expected_content="weights")
    model_out = decode_model(reply.arrays[PACKED], reference=model_in, expected_content="weights")
    names = [name.removeprefix("code/") for name in layout.names]
    change, clipped = clip_update(model_change(model_in, model_out, names), float(params[NORM_BOUND_KEY]))
    finest = int(params[GRID_BITS_KEY])
    bits = min(grid_bits(check_bit_width(received.config.get(BIT_WIDTH_KEY), BIT_WIDTH_KEY)), finest)
    weight = float(params[CODE_WEIGHT_KEY])
    lows, highs = list(params[RANGE_LOW_KEY]), list(params[RANGE_HIGH_KEY])
    if len(lows) != len(names) or len(highs) != len(names) or not 0 < weight <= 1:
        raise ValueError("the code ranges or the code weight do not fit the layout")
    rng = np.random.default_rng()
    values, outside, total = {}, 0, 0
    for name, low, high in zip(names, lows, highs):
        weights_sent = np.asarray(model_in[name], dtype=np.float64) + change[name]
        scaled = (weights_sent - low) / (high - low) * 2 ** bits
        outside += int(((scaled < 0) | (scaled > 2 ** bits)).sum())
        total += scaled.size
        codes = np.clip(np.rint(scaled), 0, 2 ** bits - 1) * 2 ** (finest - bits) * weight  # code at b_i, lifted
        values[f"code/{name}"] = np.clip(np.floor(codes + rng.random(codes.shape)), 0, 2 ** finest - 1)
    return values, {"secagg-clipped": int(clipped), "secagg-out-of-range": round(outside / max(total, 1), 6)}


def qfedpolyp_apply(method, rnd: int, sums, plan: MethodPlan, updates) -> dict[str, Any]:
    """The weighted mean of the hospitals' weights: low + (sum of codes / sum of weights) x the finest grid's step."""
    context, hospitals = plan.context, [u.hospital for u in updates]
    weight = sum(context["weights"][h.name] for h in hospitals)
    step = 2.0 ** -context["grid-bits"]
    arrays = dict(method.global_arrays)
    for name, low, high in zip(float_names(arrays), context["lows"], context["highs"]):
        mean_code = np.asarray(sums[f"code/{name}"], dtype=np.float64) / weight
        arrays[name] = (low + mean_code * step * (high - low)).astype(arrays[name].dtype)
    method.global_arrays = arrays
    method._decoded.clear()
    return {"bit-widths": {h.name: context["bits"][h.name] for h in hospitals}, "grid-bits": context["grid-bits"]}


# FedMEPD: encoders per modality, the decoder per filter ---------------------------------------------------------------
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
    caps, _ = sample_shares(method.cfg, hospitals)
    total = sum(caps)
    by_share = not method.personalise or method.cfg.fedmepd.initial_weight == "share"
    weights, config = {}, {}
    for hospital, cap in zip(hospitals, caps):
        known = method.personalisation.weights.get(hospital.name)
        start = cap / total if by_share else 1.0
        weights[hospital.name] = {layer: np.asarray(known[layer] if known is not None
                                                    else np.full(np.shape(arrays[names[0]])[0], start))
                                  for layer, names in layers.items()}
        config[hospital.name] = {NORM_BOUND_KEY: float(norm_bound), LAYOUT_KEY: layout.to_json(),
                                 FILTER_WEIGHTS_KEY: np.concatenate(list(weights[hospital.name].values())).tolist()}
    return MethodPlan(layout, settings.modulus_range, settings.quantization_range, config,
                      {"modalities": having, "shared": shared, "weights": weights, "layers": layers,
                       "shares": {h.name: cap / total for h, cap in zip(hospitals, caps)}})


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


_FEDAVG = SecureMethod(fedavg_plan, weighted_update_contribution, fedavg_apply, refuse=fedavg_refuse)
#: method name -> how it runs under secure aggregation
SECURE_METHODS: dict[str, SecureMethod] = {
    "fedavg": _FEDAVG, "fedprox": _FEDAVG, "moon": _FEDAVG,
    "fedbn": SecureMethod(fedbn_plan, weighted_update_contribution, fedbn_apply, refuse=fedavg_refuse),
    "fedproin": SecureMethod(fedproin_plan, fedproin_contribution, fedproin_apply, frozenset({INFLUENCE})),
    "qfedpolyp": SecureMethod(qfedpolyp_plan, qfedpolyp_contribution, qfedpolyp_apply, refuse=qfedpolyp_refuse),
    "fedmepd": SecureMethod(fedmepd_plan, fedmepd_contribution, fedmepd_apply, sum_problem=fedmepd_sum_problem),
    "fedmepd-federated-decoder": SecureMethod(fedmepd_plan, fedmepd_contribution, fedmepd_apply,
                                              sum_problem=fedmepd_sum_problem),
    "fedmepd-fedavg": _FEDAVG,
}
#: why the other methods do not run under secure aggregation (docs/secure-aggregation.md)
NOT_SECURE = {
    "fedproto": "FedProto's replies are each hospital's class means and the server keeps per-hospital state; the "
                "count-weighted means could be summed as FedProIn's prototypes are, which is not built yet",
    "fedmepd-local": "its hospitals send nothing to aggregate",
}


def secure_method(name: str, job: "JobConfig | None" = None) -> SecureMethod:
    """The method's secure-aggregation functions; ValueError says why it has none (or why ``job`` cannot use them)."""
    spec = SECURE_METHODS.get(name)
    if spec is None:
        reason = NOT_SECURE.get(name) or NOT_SECURE.get(name.split("-")[0]) or "it is not built for it"
        raise ValueError(f"secure aggregation is not available for strategy {name!r}: {reason}")
    problem = spec.refuse(job) if job is not None else None
    if problem:
        raise ValueError(f"secure aggregation with strategy {name!r}: {problem}")
    return spec
