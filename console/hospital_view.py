"""What a hospital's own files say, for its data-protection officer: read from its state folder (the audit log
``audit.jsonl``, the privacy ledger ``privacy-ledger.json``, the secure-aggregation memory
``secure-aggregation.jsonl``), its policy file and, where given, the server's audit log of a run.

Everything is read with the project's own readers (``common.trust.audit.verify``/``cross_check``/``records_of``,
``common.trust.ledger``'s check and accountant, ``client_app.policy_rules``), so the page says what
``fedmed audit verify`` and ``fedmed policy check`` say and counts epsilon as the hospital counts it. Nothing is
written. A file that is missing or cannot be read is a problem named on the page, never an exception.
"""

from __future__ import annotations

import calendar
import functools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.trust.audit import AUDIT_HEAD_MARK, cross_check, records_of, verify
from common.trust.ledger import LEDGER_FILE, RELEASE_EVENT, RELEASE_FIELDS
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


@dataclass
class Message:
    """A line of the audit log about one message, in the words of the page."""

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


@dataclass
class SecureMemory:
    path: Path
    state: str
    rounds: list[dict[str, Any]]
    revealed: list[dict[str, Any]]


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
    records = _records(audit_path, problems)
    chain = audit_chain(audit_path)
    bad_lines = {line for line, _ in chain.problems}
    policy = read_policy_view(policy_file, node_config, records, name)
    if policy.problem:
        problems.append(policy.problem)
    privacy = read_privacy(folder, records, policy_file if not policy.problem else None, chain.ok, now)
    runs, refusals = read_runs(records, bad_lines, policy)
    for run in runs:
        mine = [t for t in privacy.trainings if t.run == run.name]
        run.trainings = len(mine)
        run.epsilon_after = mine[-1].epsilon_after if mine else None
        if mine and privacy.accountant and privacy.delta:
            run.epsilon = _epsilon([t.released for t in mine], privacy.delta)
    peer_checks = peer_audit_checks(audit_path, name, server_logs or {}, [r.name for r in runs]) \
        if audit_path.is_file() else []
    stamps = [p.stat().st_mtime for p in (folder / f for f in HOSPITAL_FILES) if p.is_file()]
    return HospitalView(name=name, folder=folder, audit_path=audit_path, chain=chain, peer_checks=peer_checks,
                        runs=runs, refusals=refusals, privacy=privacy, memory=read_memory(folder), policy=policy,
                        updated=max(stamps) if stamps else 0.0, problems=problems)


def _records(path: Path, problems: list[str]) -> list[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        problems.append(f"{path}: there is no audit log here, so no message, refusal or decision can be shown")
        return []
    try:
        return list(records_of(path))
    except OSError as error:
        problems.append(f"{path} cannot be read: {error.strerror or error}")
        return []


def audit_chain(path: Path, head: str | None = None) -> Check:
    """``fedmed audit verify`` in words: intact, or broken at its first bad line (every bad line listed)."""
    if not path.is_file():
        return Check(f"audit log {path}", False, "Missing", "there is no audit log to check")
    try:
        result = verify(path, head)
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
    return value if isinstance(value, str) else "" if value is None else str(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def clean_reason(reason: str) -> str:
    """A refusal's reason without the audit head the hospital put at its end."""
    mark = reason.rfind(AUDIT_HEAD_MARK)
    return reason[:mark].rstrip() if mark >= 0 else reason


def read_runs(records: list[tuple[int, dict[str, Any]]], bad_lines: set[int] | frozenset[int] = frozenset(),
              policy: PolicyView | None = None) -> tuple[list[RunAtSite], list[Refusal]]:
    """The runs that reached the site, in the order they first did: their messages, and per round what came in,
    what left (bytes, metric names, masked or not), what the policy decided; and every refusal."""
    runs: dict[str, dict[str, Any]] = {}
    refusals: list[Refusal] = []
    limit = 0
    if policy is not None:
        limit = next((int(v) for k, v in policy.rows if k == "max-rounds-per-run" and v.isdigit()), 0)

    def run_of(name: str) -> dict[str, Any]:
        return runs.setdefault(name, {"messages": [], "rounds": {}, "methods": []})

    def round_of(run: dict[str, Any], number: int) -> RoundAtSite:
        return run["rounds"].setdefault(number, RoundAtSite(number))

    for line, record in records:
        run_name, number = _text(record.get("run")), _int(record.get("round"))
        event = record.get("event")
        if event == "message":
            direction = "in" if record.get("direction") == "received" else "out"
            metrics = record.get("metrics")
            message = Message(line=line, time=_text(record.get("time")), direction=direction,
                              kind=_text(record.get("kind")), run=run_name, round=number,
                              method=_text(record.get("method")), stage=_text(record.get("stage")),
                              bytes=_int(record.get("bytes")) or 0,
                              metrics=[str(m) for m in metrics] if isinstance(metrics, list) else None,
                              masked=record.get("masked") if isinstance(record.get("masked"), bool) else None,
                              error=clean_reason(_text(record.get("error"))), verified=line not in bad_lines)
            run = run_of(run_name)
            run["messages"].append(message)
            if message.method and message.method not in run["methods"]:
                run["methods"].append(message.method)
            if number is None:
                continue
            at = round_of(run, number)
            if direction == "in":
                at.received += 1
                at.received_bytes += message.bytes
            else:
                at.sent += 1
                at.sent_bytes += message.bytes
                if message.masked:
                    at.masked = True
                elif message.masked is False and message.kind == "train" and not message.stage and \
                        not message.error:
                    at.masked = at.masked or False  # a plain training reply: its update left unmasked
                if message.metrics and not message.error:
                    at.released = sorted(set(at.released) | set(message.metrics))
                if message.error:
                    by_policy = "refused by its policy" in message.error
                    refusals.append(Refusal(line, message.time, run_name, number, message.kind,
                                            refusal_words(message.error), by_policy))
                    at.refused = at.refused or refusal_words(message.error)
        elif event == "policy" and number is not None:
            at = round_of(run_of(run_name), number)
            decision = record.get("decision")
            if decision == "metrics-withheld" and isinstance(record.get("metrics"), list):
                at.withheld = sorted(set(at.withheld) | {str(m) for m in record["metrics"]})
            elif decision == "epsilon":
                at.trained = True
                epsilon = record.get("epsilon")
                at.epsilon = float(epsilon) if isinstance(epsilon, (int, float)) else None
            elif decision == "trained":
                at.trained = True
            elif decision == "local-dp":
                at.clipped = bool(record.get("clipped"))
        elif event == RELEASE_EVENT and number is not None:
            round_of(run_of(run_name), number).trained = True
    result = []
    for name, run in runs.items():
        messages = run["messages"]
        if not messages:
            continue
        times = [m.time for m in messages if m.time]
        result.append(RunAtSite(name=name or "(no run name)", methods=run["methods"], first=min(times, default=""),
                                last=max(times, default=""), messages=messages,
                                rounds=[run["rounds"][k] for k in sorted(run["rounds"])], limit=limit))
    return result, refusals


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
def read_privacy(folder: Path, records: list[tuple[int, dict[str, Any]]], policy_file: Path | None, chain_ok: bool,
                 now: float) -> Privacy:
    """The ledger checked against the audit log as the hospital checks it before every training, each training's
    epsilon after it (Google's RDP accountant, as the hospital counts), per day, against the budget."""
    from common.trust.audit import AuditLog
    from common.trust.ledger import PrivacyLedger

    ledger_path = folder / LEDGER_FILE
    audit_path = folder / AUDIT_FILE
    ledger = PrivacyLedger(folder, AuditLog(audit_path) if audit_path.is_file() else None)
    logged = [{**{f: r.get(f) for f in RELEASE_FIELDS}, "time": r.get("time")} for _, r in records
              if r.get("event") == RELEASE_EVENT]
    try:
        releases = ledger.releases()
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
        last = next((r for _, r in reversed(records) if r.get("event") == "policy" and r.get("decision") == "epsilon"),
                    None)
        if last is not None and isinstance(last.get("delta"), (int, float)):
            delta = float(last["delta"])
            max_epsilon = float(last["max-epsilon"]) if isinstance(last.get("max-epsilon"), (int, float)) else None
            budget_from = f"the audit log (line {last.get('seq')}: the policy in force at the last training)"
    accountant = _has_accountant()
    trainings: list[Training] = []
    noises: list[float | None] = []
    entries: list[dict[str, Any]] = []  #: what each training released: local DP's noise, a noised secure sum's
    logged_epsilon = [r.get("epsilon") for _, r in records
                      if r.get("event") == "policy" and r.get("decision") == "epsilon"]
    for number, release in enumerate(releases, start=1):
        noise = release.get("noise-multiplier")
        noises.append(float(noise) if isinstance(noise, (int, float)) else None)
        entries.append({"noise-multiplier": noises[-1], "distributed-dp": release.get("distributed-dp"),
                        "patient-dp": release.get("patient-dp")})
        if delta and accountant:
            after = _epsilon(entries, delta)
        elif None in noises and not (entries[-1]["distributed-dp"] or entries[-1]["patient-dp"]):
            after = math.inf
        else:  # no accountant here: what the hospital wrote after the training
            value = logged_epsilon[number - 1] if number - 1 < len(logged_epsilon) else None
            after = float(value) if isinstance(value, (int, float)) else None
        trainings.append(Training(number, _text(release.get("run")), release.get("round"),
                                  _text(release.get("method")), _text(release.get("time")), noises[-1], after,
                                  entries[-1]))
    days: list[Day] = []
    for day in sorted({t.time[:10] for t in trainings}):
        mine = [t for t in trainings if t.time[:10] == day]
        alone = _epsilon([t.released for t in mine], delta) if delta and accountant else None
        days.append(Day(day, len(mine), alone, mine[-1].epsilon_after))
    since = now - 24 * 3600
    last_24h = sum(1 for t in trainings if _seconds(t.time) >= since)
    return Privacy(ledger_path=ledger_path, ledger_state=state, ledger_ok=ok, source=source, trainings=trainings,
                   days=days, delta=delta, max_epsilon=max_epsilon or None, budget_from=budget_from,
                   epsilon=trainings[-1].epsilon_after if trainings else (0.0 if delta else None),
                   last_24h=last_24h, max_per_day=max_per_day, accountant=accountant)


def _has_accountant() -> bool:
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        return False
    return True


def _epsilon(entries: list[dict[str, Any]], delta: float) -> float:
    return _epsilon_of(tuple(json.dumps(e, sort_keys=True) for e in entries), delta)


@functools.lru_cache(maxsize=8192)
def _epsilon_of(entries: tuple[str, ...], delta: float) -> float:
    """``common.trust.ledger.releases_epsilon``, remembered: a page that refreshes recounts only the trainings added
    since."""
    from common.trust.ledger import releases_epsilon

    return releases_epsilon([json.loads(e) for e in entries], delta)


def _seconds(stamp: str) -> float:
    """An audit/ledger time (UTC) in seconds; one that cannot be read counts as now (as the hospital counts it)."""
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return math.inf


# --- the secure-aggregation memory and the policy --------------------------------------------------------------------
def read_memory(folder: Path) -> SecureMemory:
    """The (run, round)s the hospital took part in under secure aggregation and the models it revealed shares for."""
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
    rounds = [{**r, "revealed": (r.get("run"), r.get("round")) in shown} for r in rounds if isinstance(r, dict)]
    return SecureMemory(path, f"{len(rounds)} secure round(s) taken part in, shares revealed for {len(revealed)} "
                              "model(s)", rounds, revealed)


def read_policy_view(policy_file: Path | None, node_config: str, records: list[tuple[int, dict[str, Any]]],
                     name: str) -> PolicyView:
    """What ``fedmed policy check`` prints for this site, and whether the file given is the one the log last
    recorded in force (its SHA-256)."""
    logged = next((r.get("policy-sha256") for _, r in reversed(records) if isinstance(r.get("policy-sha256"), str)),
                  "")
    if policy_file is None and not node_config:
        return PolicyView(None, [], "", logged, "")
    import hashlib

    from client_app.policy_rules import policy_rules
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
