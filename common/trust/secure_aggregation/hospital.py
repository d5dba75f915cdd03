"""A hospital's side of the protocol: what it answers at each stage, and everything it refuses, whatever the server
asks (docs/secure-aggregation.md, "Threat model").

:func:`hospital_stage` runs one stage on a :class:`HospitalRound` (the hospital's secrets between stages) under its
:class:`HospitalRules` (its name, identity key, the consortium's registered keys, its policy's minimums, its replay
memory). Flower's ``_setup`` and ``_share_keys`` make the key pairs and Shamir shares; masks come from the whole
agreed secret (:mod:`.masks`). Besides Flower's checks a hospital refuses:

- a plan whose threshold is half its shares or fewer (more than ``min-threshold-fraction`` of them, default 0.5), or
  fewer hospitals than its ``min-hospitals-per-sum``; in a deployment whose policy requires secure aggregation, any
  round without the consortium's keys (``peer-keys``);
- a round plan (the collect stage's ``secagg.plan``: layout, norm bound, weight cap, what each part sums) below its
  policy's bounds, or with a part that fewer than ``min-hospitals-per-sum`` hospitals add to; the plan is one text
  for every hospital: its SHA-256 binds the pairwise masks (hospitals shown different plans add masks that do not
  cancel) and is signed with the survivor set;
- a second protocol run for a (run, round) it took part in, and training from, or revealing shares for a sum
  trained from, a model it already revealed shares for, checked at collect and again at unmask
  (:class:`ReplayMemory`, in its state folder and its audit log, kept across restarts);
- with the consortium's keys (``peer-keys``, each pinned by its policy's ``peers``): a neighbour whose public keys
  are not signed by that hospital's registered key, and an unmask request unless every neighbour in the survivor
  set, and enough others for its ``min-hospitals-per-sum`` and every part of the sum, signed that set and the same
  round plan with its registered key (no invented or padded survivors; a plan told to some hospitals only leaves
  masks that do not cancel);
- an unmask request that is not exactly what the survivor set it signed implies: every neighbour's mask-seed share
  if it survived, key share if it did not, never both, and only once (its secrets are erased when it answers).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np

from .keys import MASK_PURPOSE, SHARES_PURPOSE, decrypt, encrypt, new_key_pair, shared_keys
from .masks import expand_mask
from .messages import (
    AHEAD_PREFIX,
    COLLECT,
    COMMITMENT_KEY,
    CONSISTENCY,
    MEMORY_FILE,
    MEMORY_KINDS,
    NAME_KEY,
    PARTS_KEY,
    PLAN_KEY,
    SESSION_KEY,
    SETUP,
    SHARE_DIGESTS_KEY,
    SHARE_HOLDERS_KEY,
    SHARE_KEYS,
    SIGNATURE_KEY,
    STAGES,
    SURVIVORS_KEY,
    UNMASK,
    commitment_statement,
    flower_config,
    keys_statement,
    memory_line,
    neighbour_table,
    next_stage,
    ours,
    parse_memory,
    survivor_table,
    survivors_statement,
)
from .settings import MIN_THRESHOLD_FRACTION

if TYPE_CHECKING:
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState



class SecureAggregationRefusal(ValueError):
    """The hospital will not go on with this protocol run; ``str()`` is the reason the server is given."""

    def __init__(self, reason: str):
        super().__init__(f"secure aggregation refused: {reason}")


# --- what a hospital remembers across rounds and restarts -------------------------------------------------------------


class ReplayMemory:
    """The (run, round)s a hospital took part in and the models it revealed unmask shares for, in
    ``secure-aggregation.jsonl`` of its state folder (``folder=None``: in memory, for tests and in-process runs).

    Why models: the run name is the server's choice, so a server could run a round again under a new name, leave
    one hospital out and subtract the two sums. A hospital that helped unmask a sum trained from a model trains from
    that model no more; one whose round ended before it revealed anything may (so an honest server's skipped round
    does not stop a run): unmasking needs threshold hospitals' shares, so a second sum from the same model lacks at
    least those hospitals, and the difference of two sums is a sum of at least threshold updates, never one."""

    def __init__(self, folder: str | Path | None, audit: Any = None):
        self.path = Path(folder).absolute() / MEMORY_FILE if folder else None
        self.audit = audit  #: the hospital's AuditLog: every entry is first a line of it, as the privacy ledger's
        self._memory: dict[str, list[dict[str, Any]]] = {"rounds": [], "revealed": []}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, list[dict[str, Any]]]]:
        """The memory, read and written back under an exclusive lock (the ClientApp of each message, a worker)."""
        if self.path is None:
            yield self._memory
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(f".{MEMORY_FILE}.lock"), os.O_RDWR | os.O_CREAT, 0o640)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
            memory = self._read()
            before = {kind: len(entries) for kind, entries in memory.items()}  # entries are only ever added
            yield memory
            added = b"".join(memory_line(kind, entry) for kind in MEMORY_KINDS for entry in memory[kind][before[kind]:])
            if added:
                out = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
                try:
                    if os.write(out, added) != len(added):
                        raise OSError(f"{self.path}: an entry was not written whole")
                    if self.audit is None:  # else the log's line is what lasts: a memory lost with it is rebuilt
                        os.fsync(out)
                finally:
                    os.close(out)
                # what it wrote agrees with its log (each entry went to the log first)
                _SEEN[self.path] = (_identity(self.path), memory, {kind: len(v) for kind, v in memory.items()})
        finally:
            os.close(fd)

    def _read(self) -> dict[str, list[dict[str, Any]]]:
        """The memory file (not parsed again while it is the file this process last read or wrote), checked
        against the audit log."""
        identity, agreed = _identity(self.path), {}
        seen = _SEEN.get(self.path)
        if identity is None:
            memory = {"rounds": [], "revealed": []}
        elif seen is not None and seen[0] == identity:
            memory, agreed = {kind: list(entries) for kind, entries in seen[1].items()}, seen[2]
        else:
            try:
                memory = parse_memory(self.path.read_bytes())
            except (OSError, ValueError) as error:  # never forget its rounds by accident
                raise SecureAggregationRefusal(
                    f"its memory of past rounds {self.path} cannot be read ({error}); it takes part in no secure "
                    f"round until an operator rebuilds it: {self.rebuild_command()}") from None
        if self.audit is not None:
            self._check_against_log(memory, agreed)
        _SEEN[self.path] = (identity, {kind: list(v) for kind, v in memory.items()},
                            {kind: len(v) for kind, v in memory.items()})
        return memory

    def rebuild_command(self) -> str:
        log = self.audit.path if self.audit is not None else "AUDIT_LOG"
        return f"fedmed audit rebuild-secagg-memory {log} {self.path.parent}"

    def _check_against_log(self, memory: dict[str, list[dict[str, Any]]], agreed: Mapping[str, int]) -> None:
        """The memory must hold exactly the entries its audit log holds (a deleted, rolled-back or edited memory
        would let a round or a model through again); SecureAggregationRefusal otherwise. ``agreed``: how many
        entries of each kind were found to agree before, in this same memory file (not compared again)."""
        logged = memory_in_log(self.audit.path)
        for kind in ("rounds", "revealed"):
            start = min(agreed.get(kind, 0), len(memory[kind]), len(logged[kind]))
            new = zip(memory[kind][start:], logged[kind][start:])
            if len(memory[kind]) == len(logged[kind]) and all(entry_key(kind, a) == entry_key(kind, b) for a, b in new):
                continue
            mine = [entry_key(kind, entry) for entry in memory[kind]]
            theirs = [entry_key(kind, entry) for entry in logged[kind]]
            if mine != theirs:
                what = ("holds fewer entries than its audit log: it was deleted or rolled back" if len(mine) <
                        len(theirs) and theirs[:len(mine)] == mine else "and its audit log differ: it was edited, or "
                        "the log was replaced")
                raise SecureAggregationRefusal(
                    f"its memory of past rounds {self.path} {what} ({kind}: {len(mine)} here, {len(theirs)} in "
                    f"{self.audit.path}); it takes part in no secure round until an operator rebuilds it from the "
                    f"log: {self.rebuild_command()}")

    def _remember(self, memory: dict[str, list[dict[str, Any]]], kind: str, entry: dict[str, Any]) -> None:
        """One entry, in the audit log first (so that a crash between the two errs towards remembering). The line is
        made durable with the line of the hospital's reply (``client_app/api.py``), before the reply leaves: a
        crash before that loses nothing that was revealed, and a memory file that outlived its line is refused
        until rebuilt."""
        if self.audit is not None:
            fields = {"memory": kind, **{f: entry[f] for f in MEMORY_FIELDS[kind]}}
            line = self.audit.append_many([(MEMORY_EVENT, fields)], sync=False)[0]
            entry = {**entry, "time": line["time"]}
        memory[kind].append(entry)

    def claim_round(self, run: str, rnd: int, session: str) -> None:
        """Take part in (run, round) once: SecureAggregationRefusal if it did before."""
        with self._locked() as memory:
            refusal = _took_part(memory, run, rnd)
            if refusal:
                raise SecureAggregationRefusal(refusal)
            self._remember(memory, "rounds", {"run": run, "round": rnd, "session": session, "time": _now()})

    def took_part(self, run: str, rnd: int) -> str:
        """Why it will not take part in (run, round) (it did already), or "" (it claims nothing)."""
        with self._locked() as memory:
            return _took_part(memory, run, rnd)

    def check_model(self, digest: str) -> None:
        """SecureAggregationRefusal if it revealed unmask shares for a sum trained from this model (asked at collect
        and again at unmask: another run may have been unmasked in between)."""
        with self._locked() as memory:
            refusal = _revealed_before(memory, digest, "training from it again would let the server subtract two sums")
            if refusal:
                raise SecureAggregationRefusal(refusal)

    def revealed(self, digest: str, run: str, rnd: int) -> None:
        """Remember the model whose sum it is about to help unmask, unless it did so already (then refused)."""
        with self._locked() as memory:
            refusal = _revealed_before(memory, digest, "revealing shares for a second sum from it would let the "
                                                       "server subtract the two")
            if refusal:
                raise SecureAggregationRefusal(refusal)
            self._remember(memory, "revealed", {"model": digest, "run": run, "round": rnd, "time": _now()})


def _revealed_before(memory: Mapping[str, list[dict[str, Any]]], digest: str, why: str) -> str:
    """Why a hospital that helped unmask a sum trained from model ``digest`` goes no further (``why``), or ""."""
    for entry in memory["revealed"]:
        if entry.get("model") == digest:
            return (f"it already helped unmask a sum trained from this model (run {entry.get('run')!r} round "
                    f"{entry.get('round')}, model SHA-256 {digest[:16]}...); {why}")
    return ""


def _took_part(memory: Mapping[str, list[dict[str, Any]]], run: str, rnd: int) -> str:
    for entry in memory["rounds"]:
        if entry.get("run") == run and entry.get("round") == rnd:
            return (f"it already took part in secure aggregation for run {run!r} round {rnd} (session "
                    f"{entry.get('session')}, {entry.get('time')}); a repeated round could let the server subtract "
                    "two sums")
    return ""


MEMORY_EVENT = "secure-aggregation-memory"  #: the audit line of one entry of the replay memory
#: what the memory and its audit log must agree on, per kind of entry
MEMORY_FIELDS = {"rounds": ("run", "round", "session"), "revealed": ("model", "run", "round")}


def entry_key(kind: str, entry: Mapping[str, Any]) -> tuple:
    return tuple(entry.get(field) for field in MEMORY_FIELDS[kind])


#: the memory file as this process last read or wrote it: path -> (its identity, the memory, how many entries of
#: each kind agree with the audit log)
_SEEN: dict[Path, tuple[tuple[int, int, int] | None, dict[str, list[dict[str, Any]]], dict[str, int]]] = {}
#: audit log path -> (the list of its memory lines it was built from, how many of them, the memory they hold)
_LOGGED: dict[Path, tuple[list, int, dict[str, list[dict[str, Any]]]]] = {}


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, modification time) of a file, None when there is none: a file replaced or written since has
    another."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


def memory_in_log(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The replay memory's entries as the hospital's audit log holds them (its chain checked, in the lines added
    since this process last read it: SecureAggregationRefusal when it is broken). The process's own copy, built
    from the new lines only: read it, do not change it."""
    from common.trust.audit import verified_events

    result, lines = verified_events(path, MEMORY_EVENT)
    if not result.ok:
        line, what = result.problems[0]
        raise SecureAggregationRefusal(f"its audit log {path} does not verify (line {line} {what}), so its memory of "
                                       "past rounds cannot be checked; it takes part in no secure round until an "
                                       "operator repairs the log")
    key = Path(path).absolute()
    source, used, memory = _LOGGED.get(key, (None, 0, {}))
    if source is not lines:  # the log was read whole again
        used, memory = 0, {"rounds": [], "revealed": []}
    for record in lines[used:]:
        if record.get("memory") in memory:
            kind = record["memory"]
            memory[kind].append({**{f: record.get(f) for f in MEMORY_FIELDS[kind]}, "time": record.get("time")})
    _LOGGED[key] = (lines, len(lines), memory)
    return memory


def rebuild_memory(audit_path: str | Path, folder: str | Path) -> dict[str, int]:
    """An operator's repair: the replay memory in ``folder`` written anew from the audit log's entries (its chain
    must verify; a missing or empty log is refused). The old file is kept beside it. Returns the entries of each
    kind."""
    path = Path(audit_path)
    if not path.is_file() or path.stat().st_size == 0:
        raise SecureAggregationRefusal(f"the audit log {path} is {'empty' if path.is_file() else 'missing'}: there is "
                                       "nothing to rebuild the memory from")
    memory = memory_in_log(path)
    target = Path(folder) / MEMORY_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        os.replace(target, target.with_name(f"{MEMORY_FILE}.{time.strftime('%Y%m%dT%H%M%S')}.replaced"))
    partial = target.with_name(f".{MEMORY_FILE}.{os.getpid()}.tmp")
    partial.write_bytes(b"".join(memory_line(kind, entry) for kind in MEMORY_KINDS for entry in memory[kind]))
    os.replace(partial, target)
    return {kind: len(entries) for kind, entries in memory.items()}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def model_digest(arrays: Mapping[str, Mapping[str, np.ndarray]]) -> str:
    """SHA-256 of arrays by group and name (group, name, dtype, shape, bytes): of a :func:`canonical_model`, the
    model a hospital trains from."""
    digest = hashlib.sha256()
    for group in sorted(arrays):
        for name in sorted(arrays[group]):
            value = np.ascontiguousarray(arrays[group][name])
            digest.update(json.dumps([group, name, value.dtype.str, list(value.shape)]).encode())
            digest.update(value.tobytes())
    return digest.hexdigest()


def model_description(arrays: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, Any]:
    """The round plan's ``MODEL_KEY``: each array the hospitals train from ([group, name, dtype, shape], in the
    dtypes the server's network holds them in) and their SHA-256."""
    described = [[group, name, np.asarray(value).dtype.str, list(np.shape(value))]
                 for group in sorted(arrays) for name, value in sorted(arrays[group].items())]
    return {"arrays": described, "sha256": model_digest(arrays)}


def canonical_model(arrays: Mapping[str, Mapping[str, np.ndarray]], described: Any) -> tuple[
        dict[str, dict[str, np.ndarray]], str]:
    """The model a hospital trains from, as the round plan describes it (:func:`model_description`): exactly those
    arrays of the message, each cast to the plan's dtype (as loading it into the network casts it), and their
    SHA-256, which must be the plan's. An extra record, or a tensor sent in another dtype with the same values, is
    the same model, so the replay memory keys on what training reads (one reveal per training input), and any
    array that differs from the plan's model is refused (SecureAggregationRefusal), so every hospital trains from
    one model."""
    entries = described.get("arrays") if isinstance(described, dict) else None
    if not isinstance(entries, list) or not isinstance(described.get("sha256"), str):
        raise SecureAggregationRefusal("the round plan does not describe the model to train from (secagg.model)")
    model: dict[str, dict[str, np.ndarray]] = {}
    for entry in entries:
        try:
            group, name, dtype, shape = entry
            dtype, shape = np.dtype(str(dtype)), tuple(int(d) for d in shape)
            value = arrays[str(group)][str(name)]
        except (KeyError, TypeError, ValueError):
            raise SecureAggregationRefusal(f"the model the round plan describes names {str(entry)[:120]}, which the "
                                           "message does not carry as described") from None
        if dtype.kind not in "fiub" or np.shape(value) != shape or np.asarray(value).dtype.kind not in "fiub":
            raise SecureAggregationRefusal(f"the model array {group}/{name} is {np.asarray(value).dtype} "
                                           f"{np.shape(value)}, the round plan's {dtype} {shape}")
        model.setdefault(str(group), {})[str(name)] = np.ascontiguousarray(np.asarray(value).astype(dtype))
    digest = model_digest(model)
    if digest != described["sha256"]:
        raise SecureAggregationRefusal(f"the model received (SHA-256 {digest[:16]}... as the round plan reads it) "
                                       f"is not the round plan's ({str(described['sha256'])[:16]}...): every "
                                       "hospital of a sum trains from one model")
    return model, digest


def own_model(plan: Mapping[str, Any], name: str) -> Any:
    """This hospital's row of the round plan's models (``MODEL_KEY``: each distinct model described once, and the
    model of each hospital by its SHA-256; FedMEPD's hospitals get the encoders of their own modalities)."""
    from .messages import MODEL_KEY

    table = plan.get(MODEL_KEY)
    try:
        return table["models"][table["hospitals"][name]]
    except (KeyError, TypeError):
        raise SecureAggregationRefusal(f"the round plan names no model for {name!r} to train from "
                                       "(secagg.model)") from None


def dtype_problem(described: Mapping[str, Any], trained: Mapping[str, Mapping[str, np.ndarray]]) -> str | None:
    """Why the plan's dtypes are not the network's (an array of the trained reply with the same group and name
    in another dtype): a plan that casts the model to a wider dtype would make the same training input look new."""
    for group, name, dtype, _ in described.get("arrays", []):
        value = trained.get(group, {}).get(name)
        if value is not None and np.asarray(value).dtype != np.dtype(dtype):
            return (f"the round plan gives the model array {group}/{name} as {np.dtype(dtype)}, the network holds it "
                    f"as {np.asarray(value).dtype}")
    return None


def protocol_problem(own: "SecAggPlusState", plan: Mapping[str, Any]) -> str | None:
    """Why the round plan's protocol parameters (``PROTOCOL_KEY``) are not the ones this hospital was set up with
    (None: they are): what it quantises, clips and masks with comes from its setup and must be what every hospital
    signs."""
    from .messages import PROTOCOL_KEY

    expected = {"hospitals": own.sample_num, "shares": own.share_num, "threshold": own.threshold,
                "clipping-range": own.clipping_range, "quantization-range": own.target_range,
                "modulus": own.mod_range}
    given = plan.get(PROTOCOL_KEY)
    if not isinstance(given, dict) or set(given) != set(expected) or any(
            isinstance(given[k], bool) or not isinstance(given[k], (int, float)) or given[k] != v
            for k, v in expected.items()):
        return (f"the round plan's protocol parameters {str(given)[:200]} are not the ones its setup stage sent "
                f"{expected}: every hospital quantises and masks under the one plan it signs")
    return None


# --- the rules and the state ------------------------------------------------------------------------------------------


@dataclass
class HospitalRules:
    """What a hospital requires of every protocol run: set by its node config and policy, never by a message."""

    name: str  #: its hospital name, as its identity key and the consortium's key files name it
    identity_key: str = ""  #: its private key: it signs its public keys, its seed commitment, the survivors it saw
    peer_keys: str = ""  #: folder of the consortium's <hospital>.pub: every neighbour's signatures must verify
    min_threshold_fraction: float = MIN_THRESHOLD_FRACTION
    min_hospitals_per_sum: int = 2
    memory: ReplayMemory = field(default_factory=lambda: ReplayMemory(None))
    min_norm_bound: float = 0.0  #: its policy's min-update-norm-bound: a plan's norm bound may not be below it
    #: why it takes part in no secure round at all (a deployment requiring secure aggregation without pinned keys)
    unusable: str = ""
    #: its policy's pinned peers (name -> key fingerprint, its own included): a key in peer-keys that is not pinned
    #: is refused; None: its policy pins none
    pins: dict[str, str] | None = None

    def sign(self, statement: bytes) -> bytes:
        """Its signature of ``statement`` (empty without an identity key)."""
        if not self.identity_key:
            return b""
        from common.trust.identity import sign_statement

        return sign_statement(self.identity_key, statement)

    def signature_problem(self, name: str, statement: bytes, signature: Any) -> str | None:
        """Why ``signature`` is not ``name``'s of ``statement`` (None: it is, or there are no peer keys to check)."""
        if not self.peer_keys:
            return None
        from common.trust.identity import statement_problem

        return statement_problem(self.peer_keys, name, statement, signature, pins=self.pins)


@dataclass
class HospitalRound:
    """A hospital's part in one protocol run: Flower's ``SecAggPlusState`` (its keys, seed and shares; its
    ``current_stage`` is the last stage answered) and what the malicious-server checks need besides."""

    flower: "SecAggPlusState"
    run: str = ""
    rnd: int = -1
    session: str = ""
    names: dict[int, str] = field(default_factory=dict)  #: its neighbours' names (itself included)
    survivors: list[int] = field(default_factory=list)  #: the survivor set it signed
    model: str = ""  #: SHA-256 of the model it trained from
    plan: str = ""  #: SHA-256 of the round plan it masked under (signed with the survivor set)
    parts: dict[str, list[str]] = field(default_factory=dict)  #: the plan's parts and who adds to each
    #: the next round of the run, set up with this round's consistency stage (its keys shared with the unmask stage)
    ahead: "HospitalRound | None" = None

    @classmethod
    def new(cls) -> "HospitalRound":
        from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState

        return cls(SecAggPlusState())

    @property
    def stage(self) -> str:
        return self.flower.current_stage

    def forget(self) -> None:
        """End this protocol run here: every secret and share dropped, the next stage a setup."""
        from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState

        self.flower = SecAggPlusState()
        self.flower.current_stage = UNMASK
        self.names, self.survivors, self.model, self.plan, self.parts = {}, [], "", "", {}
        self.ahead = None

    def to_bytes(self) -> bytes:
        """The whole state as one JSON text (bytes as hex), for the ClientApp's ``context.state`` between stages:
        one value to store and read, where Flower's ``SecAggPlusState.to_dict`` gives a ConfigRecord of dozens."""
        own = self.flower
        data: dict[str, Any] = {name: getattr(own, name) for name in _SCALARS}
        data.update({name: getattr(own, name).hex() for name in _KEYS})
        data.update({name: {str(k): v.hex() for k, v in getattr(own, name, {}).items()} for name in _SHARES})
        data["public_keys_dict"] = {str(k): [a.hex(), b.hex()]
                                    for k, (a, b) in getattr(own, "public_keys_dict", {}).items()}
        data["ours"] = {"run": self.run, "round": self.rnd, "session": self.session,
                        "names": {str(k): v for k, v in self.names.items()}, "survivors": self.survivors,
                        "model": self.model, "plan": self.plan, "parts": self.parts,
                        "ahead": self.ahead.to_bytes().decode() if self.ahead is not None else None}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | None) -> "HospitalRound":
        """The state :meth:`to_bytes` wrote (None: a new one)."""
        from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState

        if data is None:
            return cls.new()
        state = json.loads(data)
        own = SecAggPlusState()
        for name in _SCALARS:
            setattr(own, name, state[name])
        for name in _KEYS:
            setattr(own, name, bytes.fromhex(state[name]))
        for name in _SHARES:
            setattr(own, name, {int(k): bytes.fromhex(v) for k, v in state[name].items()})
        own.public_keys_dict = {int(k): (bytes.fromhex(a), bytes.fromhex(b))
                                for k, (a, b) in state["public_keys_dict"].items()}
        ours_ = state["ours"]
        ahead = ours_.get("ahead")
        return cls(own, ours_["run"], ours_["round"], ours_["session"], {int(k): v for k, v in ours_["names"].items()},
                   ours_["survivors"], ours_["model"], ours_["plan"], ours_["parts"],
                   cls.from_bytes(ahead.encode()) if ahead else None)


#: SecAggPlusState's fields, as HospitalRound.to_bytes writes them
_SCALARS = ("current_stage", "nid", "sample_num", "share_num", "threshold", "clipping_range", "target_range",
            "mod_range", "max_weight")
_KEYS = ("sk1", "pk1", "sk2", "pk2", "rd_seed")
_SHARES = ("rd_seed_share_dict", "sk1_share_dict", "ss2_dict")


# --- the stages -------------------------------------------------------------------------------------------------------


def hospital_stage(state: HospitalRound, stage: str, config: Mapping[str, Any], node_id: int, rules: HospitalRules,
                   vector: np.ndarray | None = None, model: str = "",
                   plan: tuple[str, dict[str, Any]] | None = None) -> tuple[HospitalRound, dict[str, Any]]:
    """One stage at a hospital: its new state and its reply's keys (setup: its signed public keys; share keys: its
    key shares encrypted for each neighbour and its signed seed commitment; collect: ``{"masked": vector masked}``
    (``model``: the digest of the model it trained from); consistency: its signature of the survivor set; unmask:
    the shares the survivor set calls for). SecureAggregationRefusal (a ValueError) says why it will not; a refusal
    or failure past setup ends the hospital's part in the run: ``state`` forgets every secret of it.

    A server that checks no signatures skips the consistency stage (what it asks for is a signature, and only
    hospitals holding the consortium's keys compare them): a hospital without peer keys then checks the survivor
    set of the unmask request as that stage would have (:func:`consistency`); one with peer keys refuses."""
    if stage == UNMASK and state.stage == COLLECT:
        if rules.peer_keys:
            state.forget()
            raise SecureAggregationRefusal(
                "it holds the consortium's keys (peer-keys), so it reveals shares only once every survivor has "
                "signed the survivor set in the consistency stage, which the server skipped (it runs it with run "
                "config hospital-keys)")
        check_turn(state, CONSISTENCY, config)
        try:
            state, _ = consistency(state, rules, config)  # (the request's setup ahead is answered after unmasking)
        except Exception:
            state.forget()
            raise
    run, rnd, session = check_turn(state, stage, config)
    try:
        flower = flower_config(stage, config)
        if stage == SETUP:
            return setup(rules, run, rnd, session, flower, node_id)
        if stage == SHARE_KEYS:
            return share_keys(state, rules, flower, config)
        if stage == COLLECT:
            if vector is None:
                raise ValueError("the collect stage masks a vector: none was given")
            digest, read = plan or round_plan(config, rules)  # (given: as round_plan read this config's plan)
            problem = protocol_problem(state.flower, read)
            if problem:
                raise SecureAggregationRefusal(problem)
            rules.memory.claim_round(state.run, state.rnd, state.session)  # one contribution to a round, ever
            state.flower.current_stage, state.model, state.plan = COLLECT, model, digest
            state.parts = read.get(PARTS_KEY) or {}
            masked = mask_vector(state.flower, flower, vector, config.get(SHARE_DIGESTS_KEY), digest.encode())
            contribution_masked(rules.name, state.rnd, vector)
            return state, {"masked": masked}
        if stage == CONSISTENCY:
            state, answer = consistency(state, rules, config)
            state.ahead, ahead_answer = setup_ahead(config, node_id, rules, run, rnd)
            return state, {**answer, **ahead_answer}
        done, answer = unmask(state, rules, flower, config)
    except Exception:
        if stage != SETUP:
            state.forget()
        raise
    if state.ahead is not None:  # the next round set up with the consistency stage: its keys shared now
        ahead, ahead_answer = share_keys_ahead(state.ahead, config, rules)
    else:
        ahead, ahead_answer = setup_ahead(config, node_id, rules, run, rnd)
    return ahead or done, {**answer, **ahead_answer}


def contribution_masked(hospital: str, rnd: int, vector: np.ndarray) -> None:
    """Called with a hospital's pre-mask contribution to round ``rnd`` (the integer vector its masks hide) once it
    is masked; does
    nothing. The seam through which tests check that a contribution depends only on the hospital's own inputs, the
    model and the plan it signs (``tests/test_secure_aggregation_lying_coordinator.py``)."""


def setup_ahead(config: Mapping[str, Any], node_id: int, rules: HospitalRules, run: str, rnd: int) -> tuple[
        HospitalRound | None, dict[str, Any]]:
    """The setup of a later round of the same run that a consistency request carries (``secagg.ahead.*``; an unmask
    request, where the server runs no consistency stage), answered with this round's answer: its state and answer
    (prefixed), or (None, {}) when there is none, it is for another run or an earlier round, or it is refused (then
    the server sets the round up as usual and hears why). Nothing is claimed: a round is claimed at its collect
    stage, where the hospital first adds to a sum."""
    ahead = {key[len(AHEAD_PREFIX):]: value for key, value in config.items() if key.startswith(AHEAD_PREFIX)}
    try:
        if not ahead or str(ahead.get("run-name")) != run or int(ahead.get("server-round", 0)) <= rnd:
            return None, {}
        next_run, next_rnd, session = check_turn(HospitalRound.new(), SETUP, ahead)
        state, answer = setup(rules, next_run, next_rnd, session, flower_config(SETUP, ahead), node_id, ahead=True)
    except (ValueError, KeyError, TypeError):  # SecureAggregationRefusal is a ValueError
        return None, {}
    return state, {AHEAD_PREFIX + key: value for key, value in answer.items()}


def share_keys_ahead(ahead: HospitalRound, config: Mapping[str, Any], rules: HospitalRules) -> tuple[
        HospitalRound | None, dict[str, Any]]:
    """The share-keys stage of the round set up with the consistency stage (``ahead``), which an unmask request
    carries (``secagg.ahead.*``), answered with the unmask shares so that round opens with its collect stage: its
    state and answer (prefixed); ``ahead`` as it was, unanswered, when the request carries none (the server then
    shares the keys in a stage of their own); (None, {}) when it is refused (the server then sets the round up
    again, and hears why)."""
    asked = {key[len(AHEAD_PREFIX):]: value for key, value in config.items() if key.startswith(AHEAD_PREFIX)}
    if not asked:
        return ahead, {}
    try:
        check_turn(ahead, SHARE_KEYS, asked)
        state, answer = share_keys(ahead, rules, flower_config(SHARE_KEYS, asked), asked)
    except (ValueError, KeyError, TypeError):  # SecureAggregationRefusal is a ValueError
        return None, {}
    return state, {AHEAD_PREFIX + key: value for key, value in answer.items()}


def check_turn(state: HospitalRound, stage: str, config: Mapping[str, Any]) -> tuple[str, int, str]:
    """The message's (run, round, session) when ``stage`` is this hospital's next step in that protocol run (a setup
    always is); SecureAggregationRefusal otherwise."""
    run, rnd, session = str(config.get("run-name", "")), int(config.get("server-round", 0)), config.get(SESSION_KEY)
    if stage not in STAGES:
        raise SecureAggregationRefusal(f"unknown stage {stage!r}")
    if not isinstance(session, str) or not session:
        raise SecureAggregationRefusal("the message names no protocol session")
    if stage != SETUP:
        expected = next_stage(state.stage)
        if stage != expected or (state.run, state.rnd, state.session) != (run, rnd, session):
            raise SecureAggregationRefusal(
                f"stage {stage!r} of run {run!r} round {rnd} session {session}, but this hospital expects stage "
                f"{expected!r} of run {state.run!r} round {state.rnd} session {state.session or '(none)'}")
    return run, rnd, session


def finished() -> HospitalRound:
    """The state after a protocol run ended (answered, or refused): no secret kept, the next stage is a setup."""
    done = HospitalRound.new()
    done.forget()
    return done


def setup(rules: HospitalRules, run: str, rnd: int, session: str, flower, node_id: int,
          ahead: bool = False) -> tuple[HospitalRound, dict]:
    """Flower's ``_setup`` with X25519 key pairs (:mod:`.keys`): the round's parameters checked against the
    hospital's rules, a (run, round) it took part in refused at once (``ahead``: a setup answered with the last
    round's key stages leaves that to the share-keys stage; the round is claimed at its collect stage), and its two
    public keys signed."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import check_configs
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    check_configs(SETUP, flower)
    state = HospitalRound.new()
    state.run, state.rnd, state.session = run, rnd, session
    own = state.flower
    own.current_stage, own.nid = SETUP, int(node_id)
    own.sample_num, own.share_num, own.threshold = (int(flower[Key.SAMPLE_NUMBER]), int(flower[Key.SHARE_NUMBER]),
                                                    int(flower[Key.THRESHOLD]))
    own.clipping_range, own.target_range = float(flower[Key.CLIPPING_RANGE]), int(flower[Key.TARGET_RANGE])
    own.mod_range, own.max_weight = int(flower[Key.MOD_RANGE]), float(flower[Key.MAX_WEIGHT])
    own.rd_seed_share_dict, own.sk1_share_dict, own.ss2_dict = {}, {}, {}
    problem = plan_problem(own, rules)
    if problem:
        raise SecureAggregationRefusal(problem)
    refusal = "" if ahead else rules.memory.took_part(run, rnd)  # claimed where it first adds: collect
    if refusal:
        raise SecureAggregationRefusal(refusal)
    (own.sk1, own.pk1), (own.sk2, own.pk2) = new_key_pair(), new_key_pair()  # masks; encrypting key shares
    signature = rules.sign(keys_statement(run, rnd, session, node_id, rules.name, own.pk1, own.pk2))
    return state, {**ours({Key.PUBLIC_KEY_1: own.pk1, Key.PUBLIC_KEY_2: own.pk2}), NAME_KEY: rules.name,
                   SIGNATURE_KEY: signature}


def plan_problem(flower: "SecAggPlusState", rules: HospitalRules) -> str | None:
    """Why a hospital will not run a round with these parameters (None: it will)."""
    if rules.unusable:
        return rules.unusable
    threshold, shares, hospitals = flower.threshold, flower.share_num, flower.sample_num
    if not 2 <= threshold <= shares <= hospitals:
        return (f"threshold {threshold}, shares {shares} and hospitals {hospitals} must satisfy "
                "2 <= threshold <= shares <= hospitals (a threshold below 2 gives every secret away)")
    if threshold <= rules.min_threshold_fraction * shares:
        return (f"the reconstruction threshold {threshold} is not more than {rules.min_threshold_fraction:g} of its "
                f"{shares} shares (min-threshold-fraction): a server telling two groups different survivor sets "
                "could rebuild both the mask seed and the key of one hospital")
    if hospitals < rules.min_hospitals_per_sum:
        return (f"the round has {hospitals} hospitals, fewer than its policy's min-hospitals-per-sum="
                f"{rules.min_hospitals_per_sum}")
    if flower.mod_range < 4 or flower.mod_range & (flower.mod_range - 1) or flower.mod_range > 2**62:
        return f"modulus {flower.mod_range} is not a power of 2 up to 2^62"
    if not 2 <= flower.target_range < flower.mod_range or not flower.clipping_range > 0:
        return (f"quantisation range {flower.target_range} and clipping range {flower.clipping_range} do not fit the "
                f"modulus {flower.mod_range}")
    return None


def round_plan(config: Mapping[str, Any], rules: HospitalRules) -> tuple[str, dict[str, Any]]:
    """The collect stage's round plan: its SHA-256 and its keys; SecureAggregationRefusal when it is missing,
    below the hospital's bounds (the norm bound), or has a part fewer than min-hospitals-per-sum hospitals add
    to."""
    from .messages import NORM_BOUND_KEY

    text = config.get(PLAN_KEY)
    try:
        plan = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        plan = None
    if not isinstance(plan, dict):
        raise SecureAggregationRefusal("the collect stage carries no round plan (secagg.plan, one JSON text)")
    bound = plan.get(NORM_BOUND_KEY, 0.0)
    if rules.min_norm_bound > 0 and not (isinstance(bound, (int, float)) and bound >= rules.min_norm_bound):
        raise SecureAggregationRefusal(f"the round plan's norm bound {bound!r} is below its policy's "
                                       f"min-update-norm-bound={rules.min_norm_bound:g}")
    parts = plan.get(PARTS_KEY) or {}
    if not isinstance(parts, dict) or not all(isinstance(v, list) for v in parts.values()):
        raise SecureAggregationRefusal("the round plan's parts are not lists of hospitals")
    few = parts_problem(parts, None, rules.min_hospitals_per_sum)
    if few:
        raise SecureAggregationRefusal(f"the round plan: {few}")
    return hashlib.sha256(text.encode()).hexdigest(), plan


def parts_problem(parts: Mapping[str, list[str]], among: set[str] | None, least: int) -> str | None:
    """Why a part of the sum would hold fewer than ``least`` hospitals' contributions (of those ``among``, when
    given: the survivors); None when every part holds enough."""
    for part, hospitals in sorted(parts.items()):
        count = len(set(hospitals) & among) if among is not None else len(set(hospitals))
        if 0 < count < least:  # a part nobody adds to sums nothing
            return (f"part {part!r} of the sum would hold {count} hospital(s)' contributions, fewer than "
                    f"{least} (min-hospitals-per-sum): it would give them away")
    return None


def share_keys(state: HospitalRound, rules: HospitalRules, flower, config: Mapping[str, Any]) -> tuple[
        HospitalRound, dict]:
    """Every neighbour's keys checked (its name, its signature with the consortium's keys), then its secrets shared
    (:func:`split_secrets`); the reply adds the signed SHA-256 of the mask seed (what the server checks rebuilt seeds
    against) and of every share."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import check_configs

    check_configs(SHARE_KEYS, flower)
    table = neighbour_table(config)
    own, keys = state.flower, {nid: pair for nid, (pair, _, _) in table.items()}
    if keys.get(own.nid) != (own.pk1, own.pk2):
        raise SecureAggregationRefusal("the server's key list leaves out this hospital's keys or changes them")
    if len(keys) > own.share_num:
        raise SecureAggregationRefusal(f"the server lists {len(keys)} neighbours for {own.share_num} shares")
    names = {nid: name for nid, (_, name, _) in table.items()}
    if names[own.nid] != rules.name or not all(names.values()) or len(set(names.values())) != len(names):
        raise SecureAggregationRefusal(f"the neighbours' names {sorted(names.values())} are not one distinct name "
                                       f"each, with {rules.name!r} for this hospital")
    for nid, ((pk1, pk2), name, signature) in table.items():
        if nid != own.nid:
            problem = rules.signature_problem(
                name, keys_statement(state.run, state.rnd, state.session, nid, name, pk1, pk2), signature)
            if problem:
                raise SecureAggregationRefusal(f"the public keys of neighbour {names[nid]!r} (node {nid}) are not "
                                               f"signed by its registered key: {problem}")
    refusal = rules.memory.took_part(state.run, state.rnd)  # claimed where it first adds: the collect stage
    if refusal:
        raise SecureAggregationRefusal(refusal)
    own.current_stage = SHARE_KEYS
    answer, holders, digests = split_secrets(own, keys)
    state.names = names
    commitment = hashlib.sha256(own.rd_seed).digest()
    signature = rules.sign(commitment_statement(state.run, state.rnd, state.session, own.nid, commitment, holders,
                                                digests))
    return state, {**ours(answer), COMMITMENT_KEY: commitment, SHARE_HOLDERS_KEY: holders,
                   SHARE_DIGESTS_KEY: digests, SIGNATURE_KEY: signature}


def split_secrets(own: "SecAggPlusState", keys: dict[int, tuple[bytes, bytes]]) -> tuple[dict, list[int],
                                                                                            list[bytes]]:
    """Flower's ``_share_keys`` with :mod:`.sharing` and :mod:`.keys`: its checks, a fresh mask seed, Shamir shares
    of the seed and of its first private key, one pair per neighbour sealed for it; and who holds each pair with the
    SHA-256 of each (the server checks every share returned at unmasking against them, and each holder checks its
    own on receipt, so a share changed later is its sender's, named)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

    from .sharing import create_shares

    own.public_keys_dict = keys
    if len(keys) < own.threshold:
        raise ValueError("Available neighbours number smaller than threshold")
    public = [key for pair in keys.values() for key in pair]
    if len(set(public)) != len(public):
        raise ValueError("Some public keys are identical")
    own.rd_seed = os.urandom(32)
    seed_shares = create_shares(own.rd_seed, own.threshold, own.share_num)
    key_shares = create_shares(own.sk1, own.threshold, own.share_num)
    others = [nid for nid in keys if nid != own.nid]
    own.ss2_dict = dict(zip(others, shared_keys(own.sk2, [keys[nid][1] for nid in others], SHARES_PURPOSE)))
    destinations, ciphertexts, holders, digests = [], [], [], []
    for index, nid in enumerate(keys):
        holders.append(nid)
        digests.append(share_digest(seed_shares[index], key_shares[index]))
        if nid == own.nid:
            own.rd_seed_share_dict[nid], own.sk1_share_dict[nid] = seed_shares[index], key_shares[index]
            continue
        sealing = own.ss2_dict[nid]
        destinations.append(nid)
        ciphertexts.append(encrypt(sealing, share_keys_plaintext_concat(own.nid, nid, seed_shares[index],
                                                                        key_shares[index])))
    return {Key.DESTINATION_LIST: destinations, Key.CIPHERTEXT_LIST: ciphertexts}, holders, digests


def share_digest(seed_share: bytes, key_share: bytes) -> bytes:
    return hashlib.sha256(seed_share).digest() + hashlib.sha256(key_share).digest()


def mask_vector(state: "SecAggPlusState", flower, vector: np.ndarray, digests: Any, plan: bytes = b"") -> np.ndarray:
    """Flower's ``_collect_masked_vectors`` for an integer vector of ours: decrypt and check the neighbours' key
    shares (each against the digest its sender committed to, ``digests`` in the order of the sources), then add the
    private mask and one pairwise mask per neighbour, each expanded from its whole secret (the pairwise ones bound
    to the round plan's SHA-256, ``plan``)."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import check_configs
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

    check_configs(COLLECT, flower)
    ciphertexts, sources = list(flower[Key.CIPHERTEXT_LIST]), [int(s) for s in flower[Key.SOURCE_LIST]]
    if len(ciphertexts) + 1 < state.threshold:
        raise SecureAggregationRefusal("fewer neighbours sent key shares than the reconstruction threshold")
    if len(set(sources)) != len(sources) or len(sources) != len(ciphertexts):
        raise SecureAggregationRefusal("the server forwarded key shares twice from one hospital, or shares without "
                                       "a source")
    if not isinstance(digests, list) or len(digests) != len(sources):
        raise SecureAggregationRefusal("the server did not forward the digest of each key share")
    available = []
    for source, ciphertext, digest in zip(sources, ciphertexts, digests, strict=True):
        if source not in state.ss2_dict:
            raise SecureAggregationRefusal(f"key shares from node {source}, which is not its neighbour")
        try:
            opened = decrypt(state.ss2_dict[source], ciphertext)
        except ValueError as error:
            raise SecureAggregationRefusal(f"the key shares from node {source}: {error}") from None
        actual, destination, seed_share, key_share = share_keys_plaintext_separate(opened)
        if actual != source or destination != state.nid:
            raise SecureAggregationRefusal(f"key shares said to be from node {source} for it are from node {actual} "
                                           f"for node {destination}")
        if share_digest(seed_share, key_share) != digest:
            raise SecureAggregationRefusal(f"the key shares from node {source} are not the ones it committed to "
                                           "(their digests differ): its shares could not be told from a holder's "
                                           "changed ones at unmasking")
        state.rd_seed_share_dict[source] = seed_share
        state.sk1_share_dict[source] = key_share
        available.append(source)
    vector = np.asarray(vector, dtype=np.int64).ravel()
    if vector.size and (vector.min() < 0 or vector.max() >= state.mod_range):
        raise ValueError(f"the vector to mask leaves [0, {state.mod_range})")
    masked = vector + expand_mask(state.rd_seed, state.mod_range, vector.size)
    agreed = shared_keys(state.sk1, [state.public_keys_dict[node][0] for node in available], MASK_PURPOSE)
    for node, secret in zip(available, agreed):
        pairwise = expand_mask(secret, state.mod_range, vector.size, plan)
        masked = masked + pairwise if state.nid > node else masked - pairwise
    return np.mod(masked, state.mod_range)


def consistency(state: HospitalRound, rules: HospitalRules, config: Mapping[str, Any]) -> tuple[HospitalRound, dict]:
    """The survivor set the server tells it: it must hold this hospital, at least min-hospitals-per-sum hospitals and
    threshold of its neighbours; it signs it and will reveal shares only for exactly this set."""
    survivors = survivor_list(config)
    own = state.flower
    known = set(own.rd_seed_share_dict)  # itself and the neighbours whose key shares it holds
    if own.nid not in survivors:
        raise SecureAggregationRefusal("the survivor set leaves out this hospital, whose masked vector was sent")
    if len(survivors) < rules.min_hospitals_per_sum:
        raise SecureAggregationRefusal(f"the sum would hold {len(survivors)} hospitals, fewer than its policy's "
                                       f"min-hospitals-per-sum={rules.min_hospitals_per_sum}")
    if len(set(survivors) & known) < own.threshold:
        raise SecureAggregationRefusal(f"{len(set(survivors) & known)} of its neighbours survived, fewer than the "
                                       f"threshold {own.threshold}")
    own.current_stage, state.survivors = CONSISTENCY, survivors
    return state, {SIGNATURE_KEY: rules.sign(survivors_statement(state.run, state.rnd, state.session, survivors,
                                                                 state.plan))}


def survivor_list(config: Mapping[str, Any]) -> list[int]:
    survivors = config.get(SURVIVORS_KEY)
    if not isinstance(survivors, list) or not all(type(n) is int for n in survivors) \
            or len(set(survivors)) != len(survivors):
        raise SecureAggregationRefusal("the survivor set is not a list of distinct node ids")
    return sorted(survivors)


def unmask(state: HospitalRound, rules: HospitalRules, flower, config: Mapping[str, Any]) -> tuple[HospitalRound, dict]:
    """The shares the signed survivor set calls for, and no others: each surviving neighbour's mask-seed share,
    each other neighbour's key share; with the consortium's keys, only once threshold of its surviving neighbours
    signed the same set. The model it trained from is remembered, and every secret of the run forgotten."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import _unmask, check_configs
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    check_configs(UNMASK, flower)
    survivors = survivor_list(config)
    if survivors != state.survivors:
        raise SecureAggregationRefusal(f"the unmask request's survivor set {survivors} is not the one it signed "
                                       f"{state.survivors}: the server told hospitals different stories")
    own = state.flower
    known = set(own.rd_seed_share_dict)
    active, dead = list(flower[Key.ACTIVE_NODE_ID_LIST]), list(flower[Key.DEAD_NODE_ID_LIST])
    if sorted(active) != sorted(known & set(survivors)) or sorted(dead) != sorted(known - set(survivors)):
        raise SecureAggregationRefusal(
            f"asked for the mask-seed shares of {sorted(active)} and the key shares of {sorted(dead)}, but the "
            f"survivor set it signed calls for seeds of {sorted(known & set(survivors))} and keys of "
            f"{sorted(known - set(survivors))} (never both for one hospital)")
    try:
        table = survivor_table(config)
    except ValueError as error:
        raise SecureAggregationRefusal(f"the unmask request: {error}") from None
    names = survivor_names(state, survivors, table)
    counted = signed_survivors(state, rules, survivors, names, table) if rules.peer_keys else set(names.values())
    if len(counted) < rules.min_hospitals_per_sum:
        raise SecureAggregationRefusal(f"the sum would hold {len(counted)} hospitals, fewer than its policy's "
                                       f"min-hospitals-per-sum={rules.min_hospitals_per_sum}")
    few = parts_problem(state.parts, counted, rules.min_hospitals_per_sum)
    if few:
        raise SecureAggregationRefusal(f"among the survivors, {few}")
    if state.model:  # not revealed for this model meanwhile (another run), and remembered before anything leaves
        rules.memory.revealed(state.model, state.run, state.rnd)
    answer = _unmask(own, flower)
    return finished(), ours(answer)


def signed_survivors(state: HospitalRound, rules: HospitalRules, survivors: list[int], names: Mapping[int, str],
                     table: Mapping[int, tuple[str, bytes]]) -> set[str]:
    """The survivors, by name, whose signature of this set and this plan verifies with their registered (pinned)
    key: itself (it knows what it signed), every neighbour's (the ones whose shares it reveals), then the others'
    until min-hospitals-per-sum of them and every part of the sum hold enough (a survivor it does not check is not
    counted). Each signature is checked once; SecureAggregationRefusal when one it checks does not verify, or two
    survivors have one name."""
    statement = survivors_statement(state.run, state.rnd, state.session, survivors, state.plan)
    least = rules.min_hospitals_per_sum

    def signed(nid: int) -> bool:
        return rules.signature_problem(names.get(nid, ""), statement, table[nid][1]) is None

    own = state.flower.nid  # what it signed itself it knows: this set and this plan (checked above)
    neighbours = [nid for nid in survivors if nid in state.names and nid != own]
    unsigned = [nid for nid in neighbours if not signed(nid)]
    counted = {names[nid] for nid in [own, *neighbours] if nid not in unsigned}
    for nid in (nid for nid in survivors if nid not in state.names):
        if not unsigned and len(counted) >= least and parts_problem(state.parts, counted, least) is None:
            break
        if signed(nid):
            counted.add(names[nid])
        else:
            unsigned.append(nid)
    if unsigned or len(set(names.values())) != len(survivors):
        raise SecureAggregationRefusal(
            f"{len(survivors) - len(unsigned)} of the {len(survivors)} survivors signed the survivor set and the "
            f"round plan it signed with their registered keys (not: nodes {sorted(unsigned)[:5]}), or two have one "
            "name: a hospital the consortium did not register, or one told another set or plan, is in the sum")
    return counted


def survivor_names(state: HospitalRound, survivors: list[int], table: Mapping[int, tuple[str, bytes]]) -> dict[
        int, str]:
    """Each survivor's hospital name: its neighbours' as they were when it shared keys, the others' as the unmask
    request names them (``table``, :func:`~.messages.survivor_table`: with peer-keys, each checked through its
    signature)."""
    names = {}
    for nid in survivors:
        given = table[nid][0]
        if nid in state.names and given != state.names[nid]:
            raise SecureAggregationRefusal(f"the unmask request calls node {nid} {given!r}, which shared keys as "
                                           f"{state.names[nid]!r}")
        names[nid] = state.names.get(nid) or given or f"node {nid}"
    return names
