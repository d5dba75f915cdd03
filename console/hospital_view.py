"""What a hospital's own files say, for its data-protection officer: read from its state folder (the audit log
``audit.jsonl``, the privacy ledger ``privacy-ledger.json``, the secure-aggregation memory
``secure-aggregation.jsonl``), its policy file and, where given, the server's audit log of a run.

Everything is read with the project's own readers (``common.trust.audit.check_chain``/``verify``/``cross_check``,
``common.trust.ledger``'s check and accountant, ``client_app.policy_rules``), so the page says what
``fedmed audit verify`` and ``fedmed policy check`` say and counts epsilon as the hospital counts it. Nothing is
written. A file that is missing or cannot be read is a problem named on the page, never an exception.
"""

from __future__ import annotations

import calendar
import contextlib
import functools
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client_app.policy_rules import policy_rules  # imported with the console: no page waits for its imports
from common.trust.audit import AUDIT_HEAD_MARK, Verification, check_chain, cross_check, line_problem, verify
from common.trust.ledger import LEDGER_FILE, RELEASE_EVENT, RELEASE_FIELDS, EpsilonCounter
from common.trust.policy import PolicyRefusal
from common.trust.secure_aggregation.messages import COLLECT, MEMORY_FILE, parse_memory

AUDIT_FILE = "audit.jsonl"
HOSPITAL_FILES = (AUDIT_FILE, LEDGER_FILE, MEMORY_FILE)
#: a log written to within this many seconds belongs to a run that may still be going: the page refreshes
LIVE_SECONDS = 300.0
#: the secure-aggregation stages in words
STAGE_WORDS = {"setup": "1 setup", "share_keys": "2 share keys", COLLECT: "3 masked update",
               "consistency_check": "4 consistency check", "unmask": "5 unmask"}


# --- finding hospitals ---------------------------------------------------------------------------------------------
def is_hospital_folder(folder: Path) -> bool:
    return any((folder / name).is_file() for name in HOSPITAL_FILES)


def hospital_name(folder: Path) -> str:
    """The name the hospital's audit log gives itself (``writer: hospital:<name>``), else its folder's name."""
    path = folder / AUDIT_FILE
    if path.is_file():
        try:
            with path.open("rb") as handle:
                first = json.loads(handle.readline() or b"{}")
            writer = first.get("writer", "") if isinstance(first, dict) else ""
            if isinstance(writer, str) and writer.startswith("hospital:") and writer[9:]:
                return writer[9:]
        except (OSError, ValueError):
            pass
    return folder.name


def hospital_folders(state: Path) -> dict[str, Path]:
    """name -> state folder: ``state`` itself when it is a hospital's folder, else each of its sub-folders that is
    one (a simulation's ``state/<hospital>``). Only folders inside ``state`` are ever listed."""
    state = Path(state)
    if is_hospital_folder(state):
        return {hospital_name(state): state}
    found: dict[str, Path] = {}
    for sub in sorted(p for p in state.iterdir() if p.is_dir() and not p.is_symlink()):
        if is_hospital_folder(sub):
            found.setdefault(hospital_name(sub), sub)
    return found


# --- what the page shows -------------------------------------------------------------------------------------------
@dataclass
class Check:
    """One check of a log in words: ``ok``, what was checked, a headline ("Chain intact", "BROKEN at line 3"), the
    detail, and every problem by line."""

    what: str
    ok: bool
    headline: str
    detail: str = ""
    problems: list[tuple[int, str]] = field(default_factory=list)

    @property
    def summary(self) -> str:
        return f"{self.headline}: {self.detail}" if self.detail else self.headline

    @property
    def first_bad_line(self) -> int | None:
        return self.problems[0][0] if self.problems else None


@dataclass(slots=True)
class Message:
    """A line of the audit log about one message, in the words of the page (a year of them is held: slots)."""

    line: int
    time: str
    direction: str  # "in" (from the server) or "out" (to the server)
    kind: str
    run: str
    round: int | None
    method: str
    stage: str
    bytes: int
    metrics: list[str] | None  # names of the metrics that left (None: the log does not say)
    masked: bool | None
    error: str
    flower_run: int | None = None  #: the Flower run id it belonged to
    peer_node: int | None = None  #: the node id of the other end (the SuperLink's, as Flower names it)
    superlink: str = ""  #: the SuperLink's address as the hospital's SuperNode was told it ("": not recorded)
    verified: bool = True


@dataclass
class Refusal:
    line: int
    time: str
    run: str
    round: int | None
    kind: str
    reason: str
    by_policy: bool


@dataclass
class RoundAtSite:
    """One round of a run as the hospital saw it."""

    round: int
    received: int = 0
    received_bytes: int = 0
    sent: int = 0
    sent_bytes: int = 0
    trained: bool = False
    masked: bool | None = None
    released: list[str] = field(default_factory=list)
    withheld: list[str] = field(default_factory=list)
    refused: str = ""
    epsilon: float | None = None
    clipped: bool | None = None
    unmasked: bool = False  #: the server's unmask stage reached it (a secure round that completed)
    never_unmasked: bool = False  #: epsilon charged for a masked update the round never unmasked (it was given up)


@dataclass
class RunAtSite:
    name: str
    methods: list[str]
    first: str
    last: str
    messages: list[Message]
    rounds: list[RoundAtSite]
    trainings: int = 0
    limit: int = 0  # max-rounds-per-run (0: none or unknown)
    epsilon: float | None = None  # of this run's trainings alone
    epsilon_after: float | None = None  # in total after its last training
    policies: list[str] = field(default_factory=list)  #: SHA-256 of each policy it recorded in force in this run
    peers: str = ""  #: whom it exchanged messages with, as the log names them (Flower run ids, node ids)
    unverified: int = 0  #: its messages on lines that do not verify

    @property
    def bytes_in(self) -> int:
        return sum(m.bytes for m in self.messages if m.direction == "in")

    @property
    def bytes_out(self) -> int:
        return sum(m.bytes for m in self.messages if m.direction == "out")

    @property
    def refusals(self) -> int:
        return sum(1 for r in self.rounds if r.refused)


@dataclass
class Training:
    """One entry of the privacy ledger, with the total epsilon after it."""

    number: int
    run: str
    round: Any
    method: str
    time: str
    noise_multiplier: float | None
    epsilon_after: float | None
    released: dict[str, Any] = field(default_factory=dict)  #: its noise as the ledger counts it (local, a sum's)


@dataclass
class Day:
    day: str
    trainings: int
    epsilon: float | None  # of that day's trainings alone
    epsilon_after: float | None  # in total at the end of the day


@dataclass
class Privacy:
    """The ledger and what it adds up to against the policy's budget."""

    ledger_path: Path
    ledger_state: str  # in words: matches the log, missing, differs, unreadable
    ledger_ok: bool
    source: str  # where the trainings below were read from
    trainings: list[Training]
    days: list[Day]
    delta: float | None
    max_epsilon: float | None
    budget_from: str
    epsilon: float | None
    last_24h: int
    max_per_day: int | None  # 0: no limit; None: unknown (no policy file given)
    accountant: bool
    next_epsilon: float | None = None  #: the total after one more training like the last (as the hospital checks)

    @property
    def unit(self) -> str:
        """What one epsilon protects: 'image' when any DP-SGD training protected images only, else a patient."""
        units = {(t.released.get("patient-dp") or {}).get("unit") for t in self.trainings}
        return "image" if "image" in units else "patient"

    @property
    def left(self) -> float | None:
        if self.max_epsilon and self.epsilon is not None and math.isfinite(self.epsilon):
            return max(0.0, self.max_epsilon - self.epsilon)
        return None

    @property
    def spent(self) -> bool:
        """Whether the hospital refuses to train on: one more training would pass the budget (or already does)."""
        if not self.max_epsilon or self.epsilon is None:
            return False
        return self.epsilon > self.max_epsilon or (self.next_epsilon is not None and
                                                   self.next_epsilon > self.max_epsilon)


@dataclass
class SecureMemory:
    path: Path
    state: str
    rounds: list[dict[str, Any]]
    revealed: list[dict[str, Any]]
    taken_part: int = 0  #: rounds it took part in: set up and not refused


@dataclass
class PolicyView:
    path: Path | None
    rows: list[tuple[str, str]]
    problem: str
    sha256_logged: str
    sha256_file: str

    @property
    def matches_log(self) -> bool | None:
        if not self.sha256_logged or not self.sha256_file:
            return None
        return self.sha256_logged == self.sha256_file


@dataclass
class HospitalView:
    name: str
    folder: Path
    audit_path: Path
    chain: Check
    peer_checks: list[Check]
    runs: list[RunAtSite]
    refusals: list[Refusal]
    privacy: Privacy
    memory: SecureMemory
    policy: PolicyView
    updated: float
    problems: list[str]

    @property
    def live(self) -> bool:
        return time.time() - self.updated < LIVE_SECONDS


# --- reading ---------------------------------------------------------------------------------------------------------
def read_hospital(folder: Path, *, policy_file: Path | None = None, node_config: str = "",
                  server_logs: dict[str, Path] | None = None, now: float | None = None) -> HospitalView:
    """Everything the hospital view shows, from ``folder`` (its state folder), its policy file and the server's
    logs of the runs (run name -> that run's ``audit.jsonl``; key ``""``: one log for every run)."""
    folder = Path(folder)
    now = time.time() if now is None else now
    name = hospital_name(folder)
    audit_path = folder / AUDIT_FILE
    problems: list[str] = []
    site, verification = SiteLog(), None
    if not audit_path.is_file():
        problems.append(f"{audit_path}: there is no audit log here, so no message, refusal or decision can be shown")
    else:
        try:
            reader = read_log(audit_path)
            site, verification = reader.site, reader.verification
        except OSError as error:
            problems.append(f"{audit_path} cannot be read: {error.strerror or error}")
    chain = audit_chain(audit_path, verification=verification)
    bad_lines = {line for line, _ in chain.problems}
    policy = read_policy_view(policy_file, node_config, site.policy_sha256, name)
    if policy.problem:
        problems.append(policy.problem)
    privacy = read_privacy(folder, site, policy_file if not policy.problem else None, chain.ok, now)
    runs, refusals = site.site_runs(bad_lines, policy_limit(policy)), site.refusals
    by_run: dict[str, list[Training]] = {}
    for training in privacy.trainings:
        by_run.setdefault(training.run, []).append(training)
    for run in runs:
        mine = by_run.get(run.name, [])
        run.trainings = len(mine)
        run.epsilon_after = mine[-1].epsilon_after if mine else None
        if mine and privacy.accountant and privacy.delta:
            run.epsilon = group_epsilon(mine, privacy.delta)
    peer_checks = peer_audit_checks(audit_path, name, server_logs or {}, [r.name for r in runs]) \
        if audit_path.is_file() else []
    stamps = [p.stat().st_mtime for p in (folder / f for f in HOSPITAL_FILES) if p.is_file()]
    return HospitalView(name=name, folder=folder, audit_path=audit_path, chain=chain, peer_checks=peer_checks,
                        runs=runs, refusals=refusals, privacy=privacy, policy=policy,
                        memory=read_memory(folder, refusals),
                        updated=max(stamps) if stamps else 0.0, problems=problems)


def audit_chain(path: Path, head: str | None = None, verification: Verification | None = None) -> Check:
    """``fedmed audit verify`` in words: intact, or broken at its first bad line (every bad line listed);
    ``verification``: what a reader of the log found already."""
    if not path.is_file():
        return Check(f"audit log {path}", False, "Missing", "there is no audit log to check")
    try:
        result = verification or verify(path, head)
    except OSError as error:
        return Check(f"audit log {path}", False, "Cannot be read", str(error.strerror or error))
    if result.ok:
        return Check(f"audit log {path}", True, "Chain intact", f"{result.lines} lines, each sealed to the one "
                                                                f"before it; last hash {result.head}")
    line, what = result.problems[0]
    return Check(f"audit log {path}", False, f"BROKEN at line {line}", f"line {line} {what}", list(result.problems))


def peer_audit_checks(hospital_log: Path, name: str, server_logs: dict[str, Path], runs: list[str]) -> list[Check]:
    """``fedmed audit verify --peer`` both ways against each server log given: the heads the server recorded for
    this hospital must be lines of its log, and the heads the hospital recorded must be lines of the server's."""
    logs = [("", path) for key, path in server_logs.items() if key == ""]
    logs += [(run, server_logs[run]) for run in runs if run in server_logs]
    checks = []
    for run, server_log in logs:
        label = f"run {run}: " if run else ""
        try:
            mine = cross_check(hospital_log, server_log, name)
            theirs = cross_check(server_log, hospital_log, "server")
        except OSError as error:
            checks.append(Check(f"{label}server log {server_log}", False, "Cannot be read",
                                str(error.strerror or error)))
            continue
        checks.append(Check(f"{label}this log against the server's {server_log}", not mine,
                            "Consistent" if not mine else f"BROKEN at server log line {mine[0][0]}",
                            "every audit head of this hospital that the server recorded is a line of this log"
                            if not mine else mine[0][1], mine))
        checks.append(Check(f"{label}the server's log {server_log} against this one", not theirs,
                            "Consistent" if not theirs else f"BROKEN at this log's line {theirs[0][0]}",
                            "every audit head of the server that this hospital recorded is a line of the server's log"
                            if not theirs else theirs[0][1], theirs))
    return checks


def _text(value: Any) -> str:
    return value if type(value) is str else "" if value is None else str(value)


def _int(value: Any) -> int | None:
    return value if type(value) is int else None  # not a bool


def clean_reason(reason: str) -> str:
    """A refusal's reason without the audit head the hospital put at its end."""
    mark = reason.rfind(AUDIT_HEAD_MARK)
    return reason[:mark].rstrip() if mark >= 0 else reason


class SiteLog:
    """A hospital's audit log read once, line by line, into what the page shows: the runs that reached the site
    (their messages, and per round what came in, what left, what the policy decided), every refusal, the trainings
    and epsilon it logged, the policies it recorded in force. Fed the lines a log gains, it grows with them: a
    log is read once per change, in the lines added (:class:`LogReader`)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}
        self.refusals: list[Refusal] = []
        self.releases: list[dict[str, Any]] = []  #: its privacy-release lines (the ledger's entries), with time
        self.logged_epsilon: list[Any] = []  #: the epsilon it wrote after each training
        self.last_epsilon: dict[str, Any] | None = None  #: its last epsilon decision (delta, max-epsilon, seq)
        self.policy_sha256 = ""  #: the policy it last recorded in force

    def _run(self, name: str) -> dict[str, Any]:
        run = self.runs.get(name)
        if run is None:
            run = self.runs[name] = {"messages": [], "rounds": {}, "methods": [], "policies": []}
        return run

    @staticmethod
    def _round(run: dict[str, Any], number: int) -> RoundAtSite:
        at = run["rounds"].get(number)
        if at is None:
            at = run["rounds"][number] = RoundAtSite(number)
        return at

    def feed(self, line: int, record: dict[str, Any]) -> None:
        run_name, number = _text(record.get("run")), _int(record.get("round"))
        event = record.get("event")
        if isinstance(record.get("policy-sha256"), str):
            self.policy_sha256 = record["policy-sha256"]
            if run_name and record["policy-sha256"] not in self._run(run_name)["policies"]:
                self._run(run_name)["policies"].append(record["policy-sha256"])
        if event == "message":
            self._message(line, record, run_name, number)
        elif event == "policy" and number is not None:
            at = self._round(self._run(run_name), number)
            decision = record.get("decision")
            if decision == "metrics-withheld" and isinstance(record.get("metrics"), list):
                at.withheld = sorted(set(at.withheld) | {str(m) for m in record["metrics"]})
            elif decision == "epsilon":
                at.trained = True
                epsilon = record.get("epsilon")
                at.epsilon = float(epsilon) if isinstance(epsilon, (int, float)) else None
                self.logged_epsilon.append(epsilon)
                self.last_epsilon = {k: record.get(k) for k in ("delta", "max-epsilon", "seq")}
            elif decision == "trained":
                at.trained = True
            elif decision == "local-dp":
                at.clipped = bool(record.get("clipped"))
        elif event == RELEASE_EVENT:
            self.releases.append({**{f: record.get(f) for f in RELEASE_FIELDS}, "time": record.get("time")})
            if number is not None:
                self._round(self._run(run_name), number).trained = True

    def _message(self, line: int, record: dict[str, Any], run_name: str, number: int | None) -> None:
        get, intern = record.get, sys.intern  # a year of messages: one call per field, strings shared
        direction = "in" if get("direction") == "received" else "out"
        metrics, masked, error = get("metrics"), get("masked"), get("error")
        message = Message(line, _text(get("time")), direction, intern(_text(get("kind"))), intern(run_name), number,
                          intern(_text(get("method"))), intern(_text(get("stage"))), _int(get("bytes")) or 0,
                          [intern(str(m)) for m in metrics] if isinstance(metrics, list) else None,
                          masked if isinstance(masked, bool) else None,
                          clean_reason(_text(error)) if error else "", _int(get("flower-run")), _int(get("peer-node")),
                          intern(_text(get("superlink"))))
        run = self._run(run_name)
        run["messages"].append(message)
        if message.method and message.method not in run["methods"]:
            run["methods"].append(message.method)
        if number is None:
            return
        at = self._round(run, number)
        if direction == "in":
            at.received += 1
            at.received_bytes += message.bytes
            at.unmasked = at.unmasked or message.stage == "unmask"
            return
        at.sent += 1
        at.sent_bytes += message.bytes
        if message.masked:
            at.masked = True
        elif message.masked is False and message.kind == "train" and not message.stage and not message.error:
            at.masked = at.masked or False  # a plain training reply: its update left unmasked
        if message.metrics and not message.error:
            at.released = sorted(set(at.released) | set(message.metrics))
        if message.error:
            words = refusal_words(message.error)
            self.refusals.append(Refusal(line, message.time, run_name, number, message.kind, words,
                                         "refused by its policy" in message.error))
            at.refused = at.refused or words

    def site_runs(self, bad_lines: set[int] | frozenset[int] = frozenset(), limit: int = 0) -> list[RunAtSite]:
        """The runs, in the order they first reached the site (a run without messages left out)."""
        result = []
        for name, run in self.runs.items():
            messages = run["messages"]
            if not messages:
                continue
            rounds = [run["rounds"][k] for k in sorted(run["rounds"])]
            for message in messages if bad_lines else ():
                message.verified = message.line not in bad_lines
            last_round = rounds[-1].round if rounds else 0
            for at in rounds:  # a secure round it trained for whose masked update was never unmasked
                at.never_unmasked = bool(at.trained and at.masked and not at.unmasked and at.round < last_round)
            result.append(RunAtSite(name=name or "(no run name)", methods=run["methods"], first=messages[0].time,
                                    last=messages[-1].time, messages=messages, rounds=rounds, limit=limit,
                                    policies=run["policies"], peers=peers_of(messages),
                                    unverified=sum(1 for m in messages if not m.verified)))
        return result


class LogReader:
    """A hospital's audit log verified and read once per change, a piece at a time (its memory is the page's, not
    the log's): a log that only grew costs its new lines, each checked on its own and chained to the last one read;
    one replaced, cut back or changed in its last line read is read whole again. An edit further back is for
    ``fedmed audit verify`` (and for every new console, and ``--report``, which read it whole)."""

    CHUNK = 1 << 22  #: bytes verified at a time

    def __init__(self, path: Path):
        self.path = Path(path)
        self.reset()

    def reset(self) -> None:
        self.inode: tuple[int, int] | None = None
        self.offset, self.last, self.previous = 0, b"", None
        self.result = Verification(self.path)
        self.cut: tuple[int, str] | None = None  #: a last line without its newline (a write under way, or cut)
        self.site = SiteLog()

    @property
    def verification(self) -> Verification:
        problems = self.result.problems + ([self.cut] if self.cut else [])
        return Verification(self.path, self.result.lines + (1 if self.cut else 0), self.result.head, problems)

    def read(self) -> "LogReader":
        with self.path.open("rb") as handle, without_cycle_collection():
            with contextlib.suppress(ImportError):
                import fcntl

                fcntl.flock(handle.fileno(), fcntl.LOCK_SH)  # no line half written while it reads
            status = os.fstat(handle.fileno())
            inode = (status.st_dev, status.st_ino)
            grew = (inode == self.inode and status.st_size >= self.offset and self.last
                    and os.pread(handle.fileno(), len(self.last), self.offset - len(self.last)) == self.last)
            if not grew:
                self.reset()
                self.inode = inode
            self.cut = None
            handle.seek(self.offset)
            pending = b""
            while block := handle.read(self.CHUNK):
                data = pending + block
                end = data.rfind(b"\n") + 1
                if end:
                    self._check(data[:end])
                pending = data[end:]
        if pending:
            self.cut = (self.result.lines + 1, "is cut short: the file does not end with a newline (a write was "
                                               "interrupted, or the end of the file was removed)")
        return self

    def _check(self, data: bytes) -> None:
        first, known = self.result.lines + 1, len(self.result.problems)
        records = check_chain(data, first, self.previous, self.result)
        last = data[data.rstrip(b"\n").rfind(b"\n") + 1:]
        self.previous = json.loads(last) if line_problem(last.rstrip(b"\n")) is None else None
        self.offset, self.last = self.offset + len(data), last
        for record in records:
            self.site.feed(record["seq"], record)
        if len(self.result.problems) > known:  # a line that does not verify is still shown, marked as such
            texts = data.split(b"\n")
            for number in sorted({n for n, _ in self.result.problems[known:]}):
                text = texts[number - first]
                if line_problem(text) is not None:
                    with contextlib.suppress(ValueError, UnicodeDecodeError):
                        record = json.loads(text)
                        if isinstance(record, dict):
                            self.site.feed(number, record)


@contextlib.contextmanager
def without_cycle_collection():
    """Python's cycle collector paused while a log is read: its lines make a year of small objects and no cycle,
    which the collector would otherwise scan again and again as they pile up (a tenth or more of the read)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


_READERS: dict[Path, LogReader] = {}


def read_log(path: Path) -> LogReader:
    """The reader of the audit log at ``path``, brought up to date (one per log for the process)."""
    reader = _READERS.get(path) or _READERS.setdefault(path, LogReader(path))
    return reader.read()


def peers_of(messages: list[Message]) -> str:
    """The other end of a run's messages in words: the server, by the Flower run and node ids and the SuperLink's
    address the log holds."""
    return _peer_text({m.flower_run for m in messages if m.flower_run is not None},
                      {m.peer_node for m in messages if m.peer_node is not None},
                      {m.superlink for m in messages if m.superlink}, "SuperLink address not recorded")


def peer_words(message: Message) -> str:
    return _peer_text({message.flower_run} - {None}, {message.peer_node} - {None}, {message.superlink} - {""}, "")


def _peer_text(runs: set[int], nodes: set[int], addresses: set[str], unrecorded: str) -> str:
    parts = ([f"Flower run {', '.join(map(str, sorted(runs)))}"] if runs else []) + \
        ([f"node {', '.join(map(str, sorted(nodes)))}"] if nodes else []) + \
        ([f"SuperLink {', '.join(sorted(addresses))}"] if addresses else [unrecorded] if unrecorded else [])
    return f"the server ({'; '.join(parts)})" if parts else "the server"


def policy_limit(policy: PolicyView | None) -> int:
    if policy is None:
        return 0
    return next((int(v) for k, v in policy.rows if k == "max-rounds-per-run" and v.isdigit()), 0)


def refusal_words(error: str) -> str:
    """A refusal's reason without who said it (the page says) or its audit head: ``hospital reported an error:
    hospital h: PolicyRefusal: refused by its policy (p.toml): why`` -> ``refused by its policy (p.toml): why``."""
    error = clean_reason(error)
    for marker in ("refused by its policy", "secure aggregation refused"):
        at = error.find(marker)
        if at >= 0:
            return error[at:]
    for prefix in ("hospital reported an error: ", "hospital "):
        if error.startswith(prefix):
            error = error[len(prefix):] if prefix.endswith(": ") else error.split(": ", 1)[-1]
    return error


# --- the privacy ledger and epsilon ----------------------------------------------------------------------------------
def read_privacy(folder: Path, site: SiteLog, policy_file: Path | None, chain_ok: bool, now: float) -> Privacy:
    """The ledger checked against the audit log as the hospital checks it before every training, each training's
    epsilon after it (Google's RDP accountant, as the hospital counts), per day, against the budget."""
    from common.trust.audit import AuditLog
    from common.trust.ledger import PrivacyLedger

    ledger_path = folder / LEDGER_FILE
    audit_path = folder / AUDIT_FILE
    ledger = PrivacyLedger(folder, AuditLog(audit_path) if audit_path.is_file() else None)
    logged = site.releases
    try:
        if not chain_ok and audit_path.is_file():
            raise PolicyRefusal(f"its audit log {audit_path} does not verify, so its privacy ledger cannot be checked")
        releases = ledger.releases_against(logged)
        if ledger_path.is_file():
            state, ok, source = ("matches the audit log, training for training" if audit_path.is_file() else
                                 "read (there is no audit log to check it against)"), True, "privacy ledger"
        elif logged:
            state, ok, source = "missing", False, "audit log"
        else:
            state, ok, source = "none yet: the hospital has not trained", True, "privacy ledger"
    except PolicyRefusal as error:
        text = str(error)
        state = (f"missing: {text}" if not ledger_path.is_file() else text)
        ok, source, releases = False, "audit log" + ("" if chain_ok else " (whose chain is broken)"), logged
    if not ledger_path.is_file() and logged:
        releases = logged
    delta, max_epsilon, budget_from, max_per_day = None, None, "", None
    if policy_file is not None:
        try:
            from common.trust.policy import read_policy

            policy, _ = read_policy(policy_file)
            max_per_day = policy.max_trainings_per_day
            table = policy.patient_dp or policy.local_dp or policy.distributed_dp
            if table is not None:
                delta, max_epsilon = table.delta, table.max_epsilon
                budget_from = f"the policy file {policy_file}"
        except Exception:  # named on the page by the policy section
            pass
    if delta is None:
        last = site.last_epsilon
        if last is not None and isinstance(last.get("delta"), (int, float)):
            delta = float(last["delta"])
            max_epsilon = float(last["max-epsilon"]) if isinstance(last.get("max-epsilon"), (int, float)) else None
            budget_from = f"the audit log (line {last.get('seq')}: the policy in force at the last training)"
    accountant = _has_accountant()
    counter = EpsilonCounter(delta) if delta and accountant else None
    trainings: list[Training] = []
    logged_epsilon = site.logged_epsilon
    without_noise = False
    for number, release in enumerate(releases, start=1):
        noise = release.get("noise-multiplier")
        entry = {"noise-multiplier": float(noise) if isinstance(noise, (int, float)) else None,
                 "distributed-dp": release.get("distributed-dp"), "patient-dp": release.get("patient-dp")}
        without_noise = without_noise or (entry["noise-multiplier"] is None and not entry["distributed-dp"]
                                          and not entry["patient-dp"])
        if counter is not None:
            after = counter.add(entry)
        elif without_noise:
            after = math.inf
        else:  # no accountant here: what the hospital wrote after the training
            value = logged_epsilon[number - 1] if number - 1 < len(logged_epsilon) else None
            after = float(value) if isinstance(value, (int, float)) else None
        trainings.append(Training(number, _text(release.get("run")), release.get("round"),
                                  _text(release.get("method")), _text(release.get("time")), entry["noise-multiplier"],
                                  after, entry))
    days = [Day(day, len(mine), group_epsilon(mine, delta) if counter is not None else None, mine[-1].epsilon_after)
            for day, mine in _grouped(trainings, lambda t: t.time[:10])]
    last_24h = trainings_since(trainings, now - 24 * 3600)
    next_epsilon = counter.after(trainings[-1].released) if counter is not None and trainings else None
    return Privacy(ledger_path=ledger_path, ledger_state=state, ledger_ok=ok, source=source, trainings=trainings,
                   days=days, delta=delta, max_epsilon=max_epsilon or None, budget_from=budget_from,
                   epsilon=trainings[-1].epsilon_after if trainings else (0.0 if delta else None),
                   last_24h=last_24h, max_per_day=max_per_day, accountant=accountant, next_epsilon=next_epsilon)


def trainings_since(trainings: list[Training], since: float) -> int:
    """Trainings at or after ``since`` (seconds), as the hospital counts them against max-trainings-per-day."""
    return sum(1 for t in trainings if _seconds(t.time) >= since)


def _grouped(trainings: list[Training], key) -> list[tuple[str, list[Training]]]:
    groups: dict[str, list[Training]] = {}
    for training in trainings:
        groups.setdefault(key(training), []).append(training)
    return sorted(groups.items())


def group_epsilon(trainings: list[Training], delta: float) -> float:
    """Epsilon of some trainings alone (a day's, a run's), in one pass."""
    return EpsilonCounter(delta).extend([training.released for training in trainings])


def _has_accountant() -> bool:
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _seconds(stamp: str) -> float:
    """An audit/ledger time (UTC) in seconds; one that cannot be read counts as now (as the hospital counts it).
    Remembered: a log's lines share their seconds, a page asks again."""
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return math.inf


# --- the secure-aggregation memory and the policy --------------------------------------------------------------------
def read_memory(folder: Path, refusals: list[Refusal] = ()) -> SecureMemory:
    """The (run, round)s the hospital took part in under secure aggregation and the models it revealed shares for;
    a round it set up and then refused (one of ``refusals``) was not taken part in."""
    path = folder / MEMORY_FILE
    if not path.is_file():
        return SecureMemory(path, "none: this hospital has not taken part in a secure round", [], [])
    try:
        memory = parse_memory(path.read_bytes())
        rounds, revealed = memory["rounds"], memory["revealed"]
    except (OSError, ValueError) as error:
        return SecureMemory(path, f"cannot be read ({error}): the hospital takes part in no secure round until an "
                                  "operator repairs it", [], [])
    revealed = [r for r in revealed if isinstance(r, dict)]
    shown = {(r.get("run"), r.get("round")) for r in revealed}
    refused = {(r.run, r.round) for r in refusals}
    rounds = [{**r, "revealed": (r.get("run"), r.get("round")) in shown,
               "refused": (r.get("run"), r.get("round")) in refused} for r in rounds if isinstance(r, dict)]
    taken = sum(1 for r in rounds if not r["refused"])
    state = f"{taken} secure round(s) taken part in"
    if taken < len(rounds):
        state += f" ({len(rounds) - taken} more set up, then refused)"
    return SecureMemory(path, f"{state}, shares revealed for {len(revealed)} model(s)", rounds, revealed, taken)


def read_policy_view(policy_file: Path | None, node_config: str, logged: str, name: str) -> PolicyView:
    """What ``fedmed policy check`` prints for this site, and whether the file given is the one the log last
    recorded in force (``logged``: its SHA-256)."""
    if policy_file is None and not node_config:
        return PolicyView(None, [], "", logged, "")
    import hashlib

    from common.settings import ConfigError

    config = node_config or f"hospital='{name}' data-dir='.'"
    try:
        rows = policy_rules(config, policy_file)
        digest = hashlib.sha256(Path(policy_file).read_bytes()).hexdigest() if policy_file else ""
    except (ConfigError, ValueError, OSError) as error:
        return PolicyView(policy_file, [], f"the policy cannot be read: {error}", logged, "")
    return PolicyView(policy_file, rows, "", logged, digest)


def stage_words(stage: str) -> str:
    return STAGE_WORDS.get(stage, stage)
