"""The server's side of the protocol, with no transport: a :class:`ServerRound` per round, what each stage sends each
hospital (``*_config``), what it takes from their replies (``receive_*``), and :func:`unmask_sum`.

Ported from Flower's ``SecAggPlusWorkflow`` (``flwr/server/workflow/secure_aggregation/secaggplus_workflow.py``)
with its checks, plus the malicious-server protocol's consistency stage (each hospital signs the survivor set; the
server forwards the signatures with the unmask request), and a reconstruction that survives a hostile share: each
owner commits to the SHA-256 of every share it makes (each holder checks its own on receipt), so a share returned
changed is set aside and its holder recorded (:attr:`ServerRound.hostile`), and every rebuilt secret is checked (a
mask seed against the SHA-256 its owner committed to, a key against its advertised public key).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from .keys import KEY_BYTES, MASK_PURPOSE, public_key_of, shared_keys
from .masks import expand_mask
from .messages import (
    COMMITMENT_KEY,
    NAME_KEY,
    NAMES_KEY,
    NEIGHBOURS_KEY,
    PLAN_KEY,
    PREFIX,
    PROTOCOL_KEY,
    PUBLIC_KEYS_KEY,
    SESSION_KEY,
    SHARE_DIGESTS_KEY,
    SHARE_HOLDERS_KEY,
    SIGNATURE_KEY,
    SIGNATURES_KEY,
    SURVIVORS_KEY,
    commitment_statement,
    keys_statement,
    ours,
    survivors_statement,
)
from .messages import (
    plan_text as plan_json,
)
from .settings import SecureAggregationSettings, share_plan
from .sharing import combine_shares

#: (hospital name, statement, signature) -> why the signature is not that hospital's (None: it is)
Verifier = Callable[[str, bytes, Any], "str | None"]


@dataclass
class ServerRound:
    """The server's state of one round's protocol run (Flower's ``WorkflowState``), by node id."""

    nodes: list[int]
    num_shares: int
    threshold: int
    clipping_range: float
    quantization_range: int
    modulus: int
    size: int  #: values in the summed vector
    session: str = ""  #: the protocol run's random name, in every statement a hospital signs
    run: str = ""
    rnd: int = 0
    neighbours: dict[int, set[int]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  #: node -> hospital name (who the server says it is)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    key_signatures: dict[int, bytes] = field(default_factory=dict)
    commitments: dict[int, bytes] = field(default_factory=dict)  #: node -> SHA-256 of its mask seed
    share_digests: dict[int, dict[int, bytes]] = field(default_factory=dict)  #: owner -> holder -> share digests
    setup_done: set[int] = field(default_factory=set)  #: sent their public keys
    keyed: set[int] = field(default_factory=set)  #: shared their keys: their neighbours mask with them
    masked: set[int] = field(default_factory=set)  #: their masked vector is in ``total``
    forward: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)  #: node -> (sources, shares)
    survivors: list[int] = field(default_factory=list)  #: the survivor set of the consistency stage
    survivor_signatures: dict[int, bytes] = field(default_factory=dict)
    asked: dict[int, set[int]] = field(default_factory=dict)  #: unmask stage: whose shares each node was asked for
    total: np.ndarray | None = None
    lost: dict[int, str] = field(default_factory=dict)  #: node -> the stage it was lost in, and why
    hostile: dict[int, str] = field(default_factory=dict)  #: node -> the share it sent that did not fit, and why
    plan_text: str = "{}"  #: the round plan every hospital gets alike in the collect stage (MethodPlan.text())

    @property
    def plan_digest(self) -> str:
        """SHA-256 of the round plan: what the hospitals bind their pairwise masks to and sign."""
        return hashlib.sha256(self.plan_text.encode()).hexdigest()

    @property
    def dropped(self) -> set[int]:
        """Shared keys but their vector is not in the sum: the server removes their pairwise masks."""
        return self.keyed - self.masked

    def name(self, node: int) -> str:
        return self.names.get(node, f"node {node}")

    def protocol_plan(self) -> dict[str, Any]:
        """What the setup stage sends, as the round plan holds it: each hospital requires its setup's values to be
        these (``hospital.protocol_problem``), so a setup told to one hospital alone changes nothing it adds."""
        return {"hospitals": len(self.nodes), "shares": int(self.num_shares), "threshold": int(self.threshold),
                "clipping-range": float(self.clipping_range), "quantization-range": int(self.quantization_range),
                "modulus": int(self.modulus)}


def plan_round(nodes: list[int], settings: SecureAggregationSettings, seed: Any, size: int,
               modulus: int | None = None, quantization_range: int | None = None,
               names: Mapping[int, str] | None = None, run: str = "", rnd: int = 0) -> ServerRound:
    """A round over ``nodes`` summing vectors of ``size`` values: shares, threshold (more than half the shares, or
    hospitals refuse it) and each node's neighbours (Flower's ring over a shuffled order, seeded by ``seed``);
    ValueError when it cannot run."""
    nodes = sorted(int(n) for n in nodes)
    if len(nodes) < 2:
        raise ValueError(f"secure aggregation needs at least 2 hospitals in a round, not {len(nodes)}")
    shares, threshold = share_plan(len(nodes), settings.num_shares, settings.reconstruction_threshold)
    if not 2 <= threshold <= shares:
        raise ValueError(f"reconstruction threshold {threshold} with {shares} shares over {len(nodes)} hospitals "
                         "cannot run (2 <= threshold <= shares)")
    if 2 * threshold <= shares:
        raise ValueError(f"reconstruction threshold {threshold} is half of the {shares} shares or less, which "
                         "hospitals refuse (a server telling two halves different stories could rebuild both "
                         "secrets of one hospital)")
    order = [nodes[i] for i in np.random.default_rng(seed).permutation(len(nodes))]
    half = shares >> 1
    neighbours = {node: {order[(i + offset) % len(order)] for offset in range(-half, half + 1)}
                  for i, node in enumerate(order)}
    planned = ServerRound(nodes, shares, threshold, settings.clipping_range,
                          quantization_range or settings.quantization_range, modulus or settings.modulus_range, size,
                          secrets.token_hex(16), run, rnd, neighbours,
                          {n: (names or {}).get(n, f"node-{n}") for n in nodes})
    planned.plan_text = plan_json({PROTOCOL_KEY: planned.protocol_plan()})  # a method's plan adds its own keys
    return planned


def setup_config(plan: ServerRound) -> dict[str, Any]:
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    return {**ours({Key.SAMPLE_NUMBER: len(plan.nodes), Key.SHARE_NUMBER: plan.num_shares,
                    Key.THRESHOLD: plan.threshold, Key.CLIPPING_RANGE: float(plan.clipping_range),
                    Key.TARGET_RANGE: int(plan.quantization_range), Key.MOD_RANGE: int(plan.modulus),
                    Key.MAX_WEIGHT: 1.0}), SESSION_KEY: plan.session}


def threshold_problem(plan: ServerRound, alive: set[int], owners: set[int]) -> str | None:
    """Why the round cannot go on (None: it can): an owner of secrets whose live neighbours are fewer than the
    threshold (Flower's ``_check_threshold``, over the nodes whose secrets the server will need)."""
    short = {node: len(plan.neighbours[node] & alive) for node in sorted(owners)
             if len(plan.neighbours[node] & alive) < plan.threshold}
    if short:
        return (f"{len(short)} hospital(s) have fewer live neighbours than the reconstruction threshold "
                f"{plan.threshold} ({', '.join(f'node {n}: {k}' for n, k in list(short.items())[:5])})")
    return None


def receive_public_keys(plan: ServerRound, replies: Mapping[int, Mapping[str, Any]],
                        verify: Verifier | None = None) -> None:
    """Setup replies: each node's two public keys (bytes, unique across the round) under the name the server knows
    it by, and its signature of them (checked with ``verify`` when the server holds the hospitals' keys)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    seen: set[bytes] = set()
    for node in sorted(replies):
        config = replies[node]
        pk1, pk2 = config.get(PREFIX + Key.PUBLIC_KEY_1), config.get(PREFIX + Key.PUBLIC_KEY_2)
        signature = config.get(SIGNATURE_KEY, b"")
        if node not in plan.nodes or not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in (pk1, pk2)) \
                or not isinstance(signature, bytes):
            plan.lost.setdefault(node, "setup: no two X25519 public keys (32 bytes each) in its reply")
            continue
        if config.get(NAME_KEY) != plan.name(node):
            plan.lost.setdefault(node, f"setup: it calls itself {str(config.get(NAME_KEY))[:80]!r}, not "
                                       f"{plan.name(node)!r}")
            continue
        if pk1 in seen or pk2 in seen or pk1 == pk2:
            plan.lost.setdefault(node, "setup: a public key another hospital also sent")
            continue
        problem = verify and verify(plan.name(node), keys_statement(plan.run, plan.rnd, plan.session, node,
                                                                    plan.name(node), pk1, pk2), signature)
        if problem:
            plan.lost.setdefault(node, f"setup: its public keys are not signed by its registered key: {problem}")
            continue
        seen |= {pk1, pk2}
        plan.public_keys[node] = (pk1, pk2)
        plan.key_signatures[node] = signature
        plan.setup_done.add(node)


def share_keys_config(plan: ServerRound, node: int) -> dict[str, Any]:
    """What ``node`` gets in the share-keys stage: its neighbours that finished setup, each with its public keys,
    its name and its signature of both (the hospital checks them against the consortium's keys)."""
    others = sorted(plan.neighbours[node] & plan.setup_done)
    return {SESSION_KEY: plan.session, NEIGHBOURS_KEY: others,
            PUBLIC_KEYS_KEY: [key for other in others for key in plan.public_keys[other]],
            NAMES_KEY: [plan.name(other) for other in others],
            SIGNATURES_KEY: [plan.key_signatures[other] for other in others]}


def receive_key_shares(plan: ServerRound, replies: Mapping[int, Mapping[str, Any]],
                       verify: Verifier | None = None) -> None:
    """Share-keys replies: each node's encrypted shares, one per neighbour, forwarded to nodes that also answered,
    and the SHA-256 of its mask seed that rebuilt seeds are checked against."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    sources: dict[int, list[int]] = {}
    for node in sorted(replies):
        config = replies[node]
        destinations, ciphertexts = config.get(PREFIX + Key.DESTINATION_LIST), config.get(PREFIX + Key.CIPHERTEXT_LIST)
        commitment = config.get(COMMITMENT_KEY)
        holders, digests = config.get(SHARE_HOLDERS_KEY), config.get(SHARE_DIGESTS_KEY)
        allowed = (plan.neighbours[node] & plan.setup_done) - {node}
        if not isinstance(destinations, list) or not isinstance(ciphertexts, list) \
                or len(destinations) != len(ciphertexts) or set(destinations) != allowed \
                or len(set(destinations)) != len(destinations) \
                or not all(isinstance(c, bytes) and len(c) <= 8192 for c in ciphertexts):
            plan.lost.setdefault(node, "share keys: its key shares are not one per neighbour")
            continue
        if not isinstance(commitment, bytes) or len(commitment) != 32 or not isinstance(holders, list) \
                or not isinstance(digests, list) or len(holders) != len(digests) \
                or sorted(holders) != sorted(allowed | {node}) \
                or not all(isinstance(d, bytes) and len(d) == 64 for d in digests):
            plan.lost.setdefault(node, "share keys: no SHA-256 of its mask seed and of each share in its reply")
            continue
        problem = verify and verify(plan.name(node), commitment_statement(
            plan.run, plan.rnd, plan.session, node, commitment, holders, digests), config.get(SIGNATURE_KEY))
        if problem:
            plan.lost.setdefault(node, f"share keys: its seed commitment is not signed by its registered key: "
                                       f"{problem}")
            continue
        sources[node] = list(zip(destinations, ciphertexts))
        plan.commitments[node] = commitment
        plan.share_digests[node] = dict(zip(holders, digests))
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
    return {**ours({Key.CIPHERTEXT_LIST: list(ciphertexts), Key.SOURCE_LIST: list(sources)}),
            SHARE_DIGESTS_KEY: [plan.share_digests[source][node] for source in sources], SESSION_KEY: plan.session,
            PLAN_KEY: plan.plan_text}


def add_masked_vector(plan: ServerRound, node: int, vector: np.ndarray) -> None:
    """A node's masked vector into the running sum (ValueError: wrong size or a value at or above the modulus)."""
    vector = np.asarray(vector, dtype=np.int64)
    if node not in plan.keyed or node in plan.masked:
        raise ValueError(f"node {node} did not share keys this round, or sent its vector twice")
    if vector.shape != (plan.size,) or (vector.size and (vector.min() < 0 or vector.max() >= plan.modulus)):
        raise ValueError(f"its masked vector is not {plan.size} values below {plan.modulus}")
    plan.total = vector.copy() if plan.total is None else np.mod(plan.total + vector, plan.modulus)
    plan.masked.add(node)


def settle_survivors(plan: ServerRound) -> list[int]:
    """The survivor set (the nodes whose masked vectors are in the sum), fixed once the masked vectors are in."""
    plan.survivors = sorted(plan.masked)
    return plan.survivors


def consistency_config(plan: ServerRound, node: int) -> dict[str, Any]:
    """The consistency stage: the survivor set, the same to all."""
    return {SURVIVORS_KEY: list(settle_survivors(plan)), SESSION_KEY: plan.session}


def receive_survivor_signatures(plan: ServerRound, replies: Mapping[int, Mapping[str, Any]],
                                verify: Verifier | None = None) -> None:
    """Consistency replies: each survivor's signature of the survivor set and the round plan (a survivor that does
    not answer stays in the sum; its signature is missing, and hospitals holding the consortium's keys then refuse
    to unmask)."""
    statement = survivors_statement(plan.run, plan.rnd, plan.session, plan.survivors, plan.plan_digest)
    for node in sorted(replies):
        signature = replies[node].get(SIGNATURE_KEY, b"")
        if node not in plan.survivors or not isinstance(signature, bytes):
            continue
        problem = verify and verify(plan.name(node), statement, signature)
        if problem:
            plan.lost.setdefault(node, f"consistency check: its signature of the survivor set does not verify: "
                                       f"{problem}")
            continue
        plan.survivor_signatures[node] = signature


def unmask_config(plan: ServerRound, node: int) -> dict[str, Any]:
    """What ``node`` is asked in the unmask stage: the mask-seed shares of its neighbours in the sum and the key
    shares of those that shared keys but whose vector is not in it, with the survivor set, every survivor's name
    and its signature of the set and the round plan."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    active = sorted(plan.neighbours[node] & plan.masked)
    dead = sorted(plan.neighbours[node] & plan.dropped)
    plan.asked[node] = set(active) | set(dead)
    return {**ours({Key.ACTIVE_NODE_ID_LIST: active, Key.DEAD_NODE_ID_LIST: dead}),
            SURVIVORS_KEY: list(plan.survivors), SESSION_KEY: plan.session,
            NAMES_KEY: [plan.name(other) for other in plan.survivors],
            SIGNATURES_KEY: [plan.survivor_signatures.get(other, b"") for other in plan.survivors]}


def unmask_sum(plan: ServerRound, replies: Mapping[int, Mapping[str, Any]]) -> np.ndarray:
    """The sum of the masked nodes' vectors modulo the modulus: every private mask and every pairwise mask with a
    node that dropped out removed, each secret rebuilt from shares that check (Flower's ``unmask_stage``, with
    :func:`rebuild`). ValueError when some secret cannot be rebuilt; hospitals whose shares did not fit are in
    ``plan.hostile`` either way."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    if plan.total is None:
        raise ValueError("no masked vector was received")
    collected: dict[int, dict[int, Any]] = {node: {} for node in plan.masked | plan.dropped}
    for node in sorted(replies):
        config = replies[node]
        owners, shares = config.get(PREFIX + Key.NODE_ID_LIST), config.get(PREFIX + Key.SHARE_LIST)
        if not isinstance(owners, list) or not isinstance(shares, list) or len(owners) != len(shares) \
                or len(set(owners)) != len(owners) or set(owners) != plan.asked.get(node, set()):
            plan.lost.setdefault(node, "unmask: its shares are not the ones asked for")
            continue
        for owner, share in zip(owners, shares):
            collected[owner][node] = share
    total = plan.total.copy()
    for owner, shares in sorted(collected.items()):
        secret = rebuild(plan, owner, shares)
        if owner in plan.masked:  # its private mask seed
            total = total - expand_mask(secret, plan.modulus, plan.size)
            continue
        others = sorted(plan.neighbours[owner] & plan.masked)  # a node that dropped out: its pairwise masks
        for other, agreed in zip(others, shared_keys(secret, [plan.public_keys[o][0] for o in others], MASK_PURPOSE)):
            pairwise = expand_mask(agreed, plan.modulus, plan.size, plan.plan_digest.encode())
            total = total + pairwise if owner > other else total - pairwise
    return np.mod(total, plan.modulus)


def rebuild(plan: ServerRound, owner: int, shares: Mapping[int, Any]) -> bytes:
    """``owner``'s mask seed (it is in the sum) or key (it dropped out) from the shares its neighbours returned:
    each share is checked against the digest ``owner`` committed to in the share-keys stage (which its holder
    confirmed on receipt), a share that differs is set aside and its holder recorded in ``plan.hostile``, and the
    secret rebuilt from threshold of the others is checked against the owner's seed commitment or public key.
    ValueError when too few shares are left, or the owner's own shares do not rebuild what it committed to."""
    what, part = ("mask seed", slice(0, 32)) if owner in plan.masked else ("key", slice(32, 64))
    committed = plan.share_digests.get(owner, {})
    good: dict[int, bytes] = {}
    for holder, share in sorted(shares.items()):
        if holder not in committed or not isinstance(share, bytes) \
                or hashlib.sha256(share).digest() != committed[holder][part]:
            plan.hostile[holder] = (f"its share of {plan.name(owner)}'s {what} is not the one {plan.name(owner)} "
                                    "committed to (and it confirmed on receipt)")
        else:
            good[holder] = share
    if len(good) < plan.threshold:
        raise ValueError(f"only {len(good)} usable share(s) of {plan.name(owner)}'s {what} came back, fewer than the "
                         f"reconstruction threshold {plan.threshold}")
    try:
        secret = combine_shares(list(good.values())[:plan.threshold])
    except ValueError:
        secret = b""
    checks = seed_check(plan.commitments[owner]) if owner in plan.masked else key_check(plan.public_keys[owner][0])
    if not checks(secret):
        plan.hostile[owner] = f"the shares it made of its {what} do not rebuild the {what} it committed to"
        raise ValueError(f"the shares {plan.name(owner)} made of its {what} do not rebuild it (checked against its "
                         f"{'commitment' if owner in plan.masked else 'public key'})")
    return secret


def seed_check(commitment: bytes) -> Callable[[bytes], bool]:
    return lambda secret: hashlib.sha256(secret).digest() == commitment


def key_check(public_key: bytes) -> Callable[[bytes], bool]:
    def checks(secret: bytes) -> bool:
        try:
            return public_key_of(secret) == public_key
        except ValueError:  # not a key
            return False

    return checks
