"""What the protocol's messages carry: the stages in order, the keys of their ConfigRecords (Flower's SecAgg+ keys
prefixed ``secagg.``, and ours), and the statements hospitals sign. No Flower at import."""

from __future__ import annotations

import json
from typing import Any, Mapping

#: The stages, in order: Flower's four names, and the consistency check of the malicious-server protocol (Bonawitz
#: et al. 2017, round 3) between collecting the masked vectors and unmasking.
SETUP, SHARE_KEYS, COLLECT, CONSISTENCY, UNMASK = (
    "setup", "share_keys", "collect_masked_vectors", "consistency_check", "unmask")
STAGES = (SETUP, SHARE_KEYS, COLLECT, CONSISTENCY, UNMASK)

#: in a hospital's state folder: the rounds it took part in and the models it revealed (``hospital.py``), one
#: JSON object a line (:func:`memory_line`), appended to, never rewritten
MEMORY_FILE = "secure-aggregation.jsonl"
MEMORY_KINDS = ("rounds", "revealed")
PREFIX = "secagg."
STAGE_KEY = PREFIX + "stage"  #: the stage a TRAIN message (and its reply) belongs to
SESSION_KEY = PREFIX + "session"  #: the server's random name for one protocol run, in every signed statement
NAME_KEY = PREFIX + "name"  #: setup reply: the hospital's name
SIGNATURE_KEY = PREFIX + "signature"  #: a reply's signature of its statement (empty without an identity key)
COMMITMENT_KEY = PREFIX + "commitment"  #: share-keys reply: SHA-256 of the hospital's mask seed
SHARE_HOLDERS_KEY = PREFIX + "share-holders"  #: share-keys reply: who holds each of its shares (itself included)
#: share-keys reply: per holder, SHA-256 of its mask-seed share + SHA-256 of its key share (64 bytes); collect
#: stage: the same for each share forwarded, which the holder checks when it decrypts them
SHARE_DIGESTS_KEY = PREFIX + "share-digests"
SURVIVORS_KEY = PREFIX + "survivors"  #: consistency and unmask: the nodes whose masked vectors are in the sum
# Per-node values travel as lists in the order of a list of nodes (one value each, not one key per node: a message's
# cost, serialised and hashed at both ends, grows with its number of values)
NEIGHBOURS_KEY = PREFIX + "neighbours"  #: share-keys stage: its neighbours' node ids (itself included)
PUBLIC_KEYS_KEY = PREFIX + "public-keys"  #: share-keys stage: each neighbour's two public keys, one after the other
#: share-keys stage: each neighbour's hospital name; unmask stage: each survivor's (in the order of SURVIVORS_KEY)
NAMES_KEY = PREFIX + "names"
#: share-keys stage: each neighbour's signature of its keys; unmask stage: each survivor's of the survivor set
SIGNATURES_KEY = PREFIX + "signatures"
#: unmask stage: the setup of the hospitals' next round (its keys prefixed so), answered with the unmask shares so
#: that the next round opens with the share-keys stage
AHEAD_PREFIX = PREFIX + "ahead."
MASKED_GROUP = "secagg.masked"  #: the reply's array group holding the packed masked vector
MASKED_ARRAY = "vector"

#: collect stage: the round plan, one canonical JSON text the same for every hospital (its SHA-256 is signed with the
#: survivor set and binds the pairwise masks): the layout, the norm bound, the weight cap, each method's own keys
PLAN_KEY = PREFIX + "plan"
# keys of the round plan (the methods' own keys live in their packages)
LAYOUT_KEY = PREFIX + "layout"
NORM_BOUND_KEY = PREFIX + "norm-bound"
WEIGHT_CAP_KEY = PREFIX + "weight-cap"  #: the most samples any hospital's weight counts (the same for all)
#: part of the sum -> the hospitals that add to it, where not every hospital does (FedMEPD's modality encoders and
#: decoder filters): each hospital checks every part holds at least its min-hospitals-per-sum
PARTS_KEY = PREFIX + "parts"
#: the protocol's parameters the setup stage sent (hospitals, shares, threshold, clipping and quantisation ranges,
#: modulus): each hospital requires its setup's values to be these, so no setup told to one hospital alone counts
PROTOCOL_KEY = PREFIX + "protocol"
#: the training message's config, the same for every hospital: a hospital trains from this, never from the
#: message's own config values (what decides its local training: epochs, learning rate, method, data, model)
TRAIN_CONFIG_KEY = PREFIX + "train-config"
#: hospital -> the training config keys its method sets per hospital (``SecureMethod.own_config``: QFedPolyp's
#: bit-width), each hospital's value in the plan every hospital signs
HOSPITAL_CONFIG_KEY = PREFIX + "train-config-by-hospital"
#: the models the hospitals train from: ``{"models": {sha256: {"arrays": [[group, name, dtype, shape], ...],
#: "sha256": ...}}, "hospitals": {name: sha256}}``, the arrays each reads in the server's network's dtypes and the
#: SHA-256 of those arrays so cast (``hospital.canonical_model``); one model for all but FedMEPD's
MODEL_KEY = PREFIX + "model"
OWN_WEIGHT_CAP_KEY = "own.weight-cap"  #: at the hospital only: its policy's max-sample-weight, never from a message
OWN_NAME_KEY = "own.name"  #: at the hospital only: its own name (its row of a plan that names hospitals)


def plan_text(plan: Mapping[str, Any]) -> str:
    """A round plan as the hospitals receive it: canonical JSON, whose SHA-256 they sign."""
    return json.dumps(plan, sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_in_plan(config: Mapping[str, Any]) -> dict[str, Any]:
    """A message's config as a round plan (JSON) holds it: bytes as ``{"hex": ...}``, alone or in lists."""
    def value(v: Any) -> Any:
        return {"hex": v.hex()} if isinstance(v, bytes) else [value(x) for x in v] if isinstance(v, list) else v

    return {k: value(v) for k, v in config.items()}


def config_from_plan(config: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`config_in_plan`."""
    def value(v: Any) -> Any:
        if isinstance(v, dict) and set(v) == {"hex"} and isinstance(v["hex"], str):
            return bytes.fromhex(v["hex"])
        return [value(x) for x in v] if isinstance(v, list) else v

    return {k: value(v) for k, v in config.items()}


def next_stage(stage: str | None) -> str:
    """The stage that follows ``stage`` (None or the last: setup)."""
    if stage not in STAGES or stage == UNMASK:
        return SETUP
    return STAGES[STAGES.index(stage) + 1]


def flower_keys(stage: str) -> tuple[str, ...]:
    """The keys of Flower's ConfigRecord for ``stage`` (share keys: none fixed, its keys are node ids)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    keys = {SETUP: (Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD, Key.CLIPPING_RANGE, Key.TARGET_RANGE,
                    Key.MOD_RANGE, Key.MAX_WEIGHT),
            SHARE_KEYS: (),
            COLLECT: (Key.CIPHERTEXT_LIST, Key.SOURCE_LIST),
            CONSISTENCY: (),
            UNMASK: (Key.ACTIVE_NODE_ID_LIST, Key.DEAD_NODE_ID_LIST)}
    if stage not in keys:
        raise ValueError(f"unknown secure-aggregation stage {stage!r}")
    return keys[stage]


def ours(values: Mapping[str, Any]) -> dict[str, Any]:
    """Flower's SecAgg+ keys as they travel in our ConfigRecord (``secagg.`` + Flower's key)."""
    return {PREFIX + key: value for key, value in values.items()}


def flower_config(stage: str, config: Mapping[str, Any]):
    """The ConfigRecord Flower's stage functions read, from a message's config (KeyError names a missing key); the
    share-keys stage's public keys in node-id order, so the server knows which share index each neighbour holds."""
    from flwr.app import ConfigRecord

    if stage == SHARE_KEYS:
        return ConfigRecord({str(node): list(keys) for node, (keys, _, _) in neighbour_table(config).items()})
    missing = [PREFIX + key for key in flower_keys(stage) if PREFIX + key not in config]
    if missing:
        raise KeyError(f"secure-aggregation stage {stage!r}: the message lacks {', '.join(missing)}")
    return ConfigRecord({key: config[PREFIX + key] for key in flower_keys(stage)})


def neighbour_table(config: Mapping[str, Any]) -> dict[int, tuple[tuple[bytes, bytes], str, bytes]]:
    """The share-keys stage's neighbours in node-id order: node -> ((pk1, pk2), name, signature of its keys);
    ValueError when the lists do not hold one of each per neighbour."""
    nodes = config.get(NEIGHBOURS_KEY)
    if not isinstance(nodes, list) or not all(type(n) is int for n in nodes) or len(set(nodes)) != len(nodes):
        raise ValueError("the share-keys stage does not list its neighbours as distinct node ids")
    keys = _values(config, PUBLIC_KEYS_KEY, bytes, 2 * len(nodes), "two public keys per neighbour")
    names = _values(config, NAMES_KEY, str, len(nodes), "a name per neighbour")
    signatures = _values(config, SIGNATURES_KEY, bytes, len(nodes), "a signature per neighbour")
    return {node: ((keys[2 * i], keys[2 * i + 1]), names[i], signatures[i])
            for i, node in sorted(enumerate(nodes), key=lambda item: item[1])}


def survivor_table(config: Mapping[str, Any]) -> dict[int, tuple[str, bytes]]:
    """The unmask stage's survivors: node -> (name, its signature of the survivor set, empty if it sent none);
    ValueError when the lists do not hold one of each per survivor."""
    survivors = config.get(SURVIVORS_KEY)
    if not isinstance(survivors, list) or not all(type(n) is int for n in survivors):
        raise ValueError("the survivor set is not a list of node ids")
    names = _values(config, NAMES_KEY, str, len(survivors), "a name per survivor")
    signatures = _values(config, SIGNATURES_KEY, bytes, len(survivors), "a signature per survivor")
    return {node: (names[i], signatures[i]) for i, node in enumerate(survivors)}


def _values(config: Mapping[str, Any], key: str, kind: type, count: int, what: str) -> list:
    values = config.get(key, [])
    if not isinstance(values, list) or len(values) != count or not all(isinstance(v, kind) for v in values):
        raise ValueError(f"the message's {key} is not {what} ({count} {kind.__name__} values)")
    return values


def statement(kind: str, run: str, rnd: int, session: str, *parts: Any) -> bytes:
    """What a hospital signs: one canonical JSON list naming the statement, the run, round and protocol session (so
    no signature serves another run, round or session), and its parts (bytes as hex)."""
    items = [f"fedmed-secagg-{kind}", str(run), int(rnd), str(session)]
    items += [part.hex() if isinstance(part, bytes) else part for part in parts]
    return json.dumps(items, separators=(",", ":")).encode()


def keys_statement(run: str, rnd: int, session: str, node: int, name: str, pk1: bytes, pk2: bytes) -> bytes:
    return statement("keys", run, rnd, session, int(node), str(name), pk1, pk2)


def commitment_statement(run: str, rnd: int, session: str, node: int, commitment: bytes, holders: list[int],
                         digests: list[bytes]) -> bytes:
    return statement("commitments", run, rnd, session, int(node), commitment,
                     [[int(h), d.hex()] for h, d in zip(holders, digests)])


def survivors_statement(run: str, rnd: int, session: str, survivors: list[int], plan: str = "") -> bytes:
    """A survivor set and the SHA-256 of the round plan (``plan``) the signer trained and masked under."""
    return statement("survivors", run, rnd, session, sorted(int(n) for n in survivors), str(plan))


def memory_line(kind: str, entry: Mapping[str, Any]) -> bytes:
    """One entry of a hospital's replay memory as its file holds it: a JSON object, its kind under ``memory``."""
    return (json.dumps({"memory": kind, **entry}, separators=(",", ":")) + "\n").encode()


def parse_memory(data: bytes) -> dict[str, list[dict[str, Any]]]:
    """A replay memory file's entries by kind (ValueError: a line that is no entry, or a last line cut short)."""
    memory: dict[str, list[dict[str, Any]]] = {kind: [] for kind in MEMORY_KINDS}
    if data and not data.endswith(b"\n"):
        raise ValueError("its last line is cut short (a write was interrupted)")
    for number, text in enumerate(data.splitlines(), start=1):
        try:
            entry = json.loads(text)
        except ValueError:
            raise ValueError(f"line {number} is not JSON") from None
        if not isinstance(entry, dict) or entry.get("memory") not in memory:
            raise ValueError(f"line {number} is not an entry of the memory (no 'memory' of {', '.join(MEMORY_KINDS)})")
        memory[entry.pop("memory")].append(entry)
    return memory
