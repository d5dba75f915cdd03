"""A hospital's privacy ledger: every training it did, with the noise that covered it, kept in its state folder
and checked against its audit log, so its epsilon survives restarts and counts every run on the same data."""

from __future__ import annotations

import calendar
import contextlib
import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from common.trust.local_dp import epsilon_of
from common.trust.policy import PolicyRefusal

LEDGER_FILE = "privacy-ledger.json"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:
            pass
        yield
    finally:
        os.close(fd)


RELEASE_EVENT = "privacy-release"  #: the audit line of one training, the ledger's entry


#: what the ledger and the audit log must agree on (distributed-dp: the secure sum's noise it counted, or None)
RELEASE_FIELDS = ("run", "round", "method", "noise-multiplier", "distributed-dp", "patient-dp")


#: How far a ledger entry's time may be from its audit line's (entries written before both shared one time were
#: stamped a moment apart); a clock set back further, to train past max-trainings-per-day, stops training.
TIME_TOLERANCE_SECONDS = 120.0


def _seconds(stamp: Any) -> float | None:
    return _stamp_seconds(str(stamp))


@functools.lru_cache(maxsize=4096)
def _stamp_seconds(stamp: str) -> float | None:
    """Remembered: a ledger's trainings share their seconds with its log's lines, and are checked at every read."""
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def _same_time(ledger: Any, logged: Any) -> bool:
    a, b = _seconds(ledger), _seconds(logged)
    return a is not None and b is not None and abs(a - b) <= TIME_TOLERANCE_SECONDS


class PrivacyLedger:
    """Every training the hospital did (run, round, method, the noise multiplier of its release; None without local
    DP): what its epsilon and its training limits are counted from. Kept in ``privacy-ledger.json`` of its state
    folder and, entry for entry, as ``privacy-release`` lines of its hash-chained audit log (``audit``): a ledger
    that was deleted, rolled back or edited no longer matches the log, and the hospital refuses to train until an
    operator restores it from the log (``fedmed audit rebuild-ledger``). ``folder=None`` keeps it in memory (tests,
    in-process runs)."""

    def __init__(self, folder: str | Path | None, audit: Any = None):
        self.folder = Path(folder) if folder else None
        self.audit = audit  #: the hospital's AuditLog (common/trust/audit.py), or None
        self._memory: list[dict[str, Any]] = []

    @property
    def path(self) -> Path | None:
        return self.folder / LEDGER_FILE if self.folder else None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One training at a time per ledger (the warm worker and a ClientApp of the same hospital)."""
        if self.folder is None:
            yield
            return
        with _file_lock(self.folder / f".{LEDGER_FILE}.lock"):
            yield

    def releases(self) -> list[dict[str, Any]]:
        """The ledger's entries, checked against the audit log (PolicyRefusal when they differ)."""
        if self.path is None:
            return list(self._memory)
        releases = self._file_releases()
        if self.audit is not None:
            self._check_against(audit_releases(self.audit.path), releases)
        return releases

    def releases_against(self, logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The ledger's entries checked against ``logged``, the releases a reader already took from the verified
        audit log (``fedmed console``, which reads the log once): PolicyRefusal when they differ."""
        releases = self._file_releases()
        if self.audit is not None:
            self._check_against(logged, releases)
        return releases

    def _file_releases(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text())
            releases = data["releases"]
            if not isinstance(releases, list) or not all(isinstance(r, dict) for r in releases):
                raise ValueError("'releases' is not a list of entries")
        except (OSError, ValueError, KeyError, TypeError) as error:  # never start counting afresh by accident
            raise PolicyRefusal(f"its privacy ledger {self.path} cannot be read ({error}); it trains no more until "
                                "an operator repairs it (fedmed audit rebuild-ledger)") from None
        return releases

    def _check_against(self, logged: list[dict[str, Any]], releases: list[dict[str, Any]]) -> None:
        key = [tuple(r.get(f) for f in RELEASE_FIELDS) for r in releases]
        logged_key = [tuple(r.get(f) for f in RELEASE_FIELDS) for r in logged]
        if key == logged_key:
            moved = next((i for i, (r, l) in enumerate(zip(releases, logged)) if not _same_time(r.get("time"),
                                                                                                l.get("time"))), None)
            if moved is None:
                return
            what = (f"says training {moved + 1} was at {releases[moved].get('time')}, its audit log at "
                    f"{logged[moved].get('time')}: the ledger's clock was edited")
        elif len(key) < len(logged_key) and logged_key[:len(key)] == key:
            what = (f"holds {len(key)} trainings, its audit log {len(logged_key)}: the ledger was deleted or rolled "
                    "back")
        elif len(key) > len(logged_key) and key[:len(logged_key)] == logged_key:
            what = (f"holds {len(key)} trainings, its audit log only {len(logged_key)}: lines of the audit log were "
                    "removed, or the log was replaced")
        else:
            common = min(len(key), len(logged_key))
            first = next((i for i in range(common) if key[i] != logged_key[i]), common)
            what = f"and its audit log differ at training {first + 1}: the ledger was edited"
        raise PolicyRefusal(f"its privacy ledger {self.path} {what} ({self.audit.path}); it trains no more until an "
                            f"operator restores the ledger from the log: fedmed audit rebuild-ledger "
                            f"{self.audit.path} {self.folder}")

    def record(self, run: str, rnd: int, method: str, noise_multiplier: float | None,
               distributed: dict[str, Any] | None = None, patient: dict[str, Any] | None = None) -> None:
        """One training, in the audit log first (so that a crash between the two errs towards counting it);
        ``distributed``: the secure sum's noise it counted (``distributed_dp.release``); ``patient``: its DP-SGD
        (``patient_dp.Release.entry``)."""
        entry = {"run": run, "round": rnd, "method": method, "noise-multiplier": noise_multiplier,
                 "distributed-dp": distributed, "patient-dp": patient,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if self.path is None:
            self._memory.append(entry)
            return
        releases = self.releases()
        if self.audit is not None:
            line = self.audit.append(RELEASE_EVENT, **{f: entry[f] for f in RELEASE_FIELDS}, ledger=str(self.path))
            entry["time"] = line["time"]  # one time for both, so the ledger's clock is checked against the log's
        self._write(releases + [entry])

    def _write(self, releases: list[dict[str, Any]]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{LEDGER_FILE}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({"releases": releases}, indent=1))
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, self.path)

    def trainings_in(self, run: str) -> int:
        """Trainings done for ``run``: every one counts, a round number sent twice included."""
        return sum(1 for r in self.releases() if r.get("run") == run)

    def trainings_since(self, seconds: float) -> int:
        """Trainings done in the last ``seconds``, whatever the run (their times agree with the audit log's)."""
        since = time.time() - seconds
        count = 0
        for release in self.releases():
            when = _seconds(release.get("time"))
            count += 1 if when is None else int(when >= since)  # an entry whose time cannot be read counts
        return count

    def epsilon(self, delta: float, extra: list[Any] = ()) -> float:
        """Epsilon at ``delta`` of every training in the ledger and the ``extra`` ones to come (each a noise
        multiplier or a ledger entry)."""
        extra = [e if isinstance(e, dict) else {"noise-multiplier": e} for e in extra]
        return releases_epsilon(self.releases() + extra, delta)


#: ledger entries whose RDP only distributed_dp composes (a noised secure sum, patient-level DP-SGD): with any of them
#: among a hospital's entries, every entry is composed there
COMPOSED_KINDS = ("distributed-dp", "patient-dp")


def releases_epsilon(releases: list[dict[str, Any]], delta: float) -> float:
    """Epsilon at ``delta`` of ledger entries: local DP's Gaussian releases by Google's RDP accountant; with any
    secure sum under distributed DP or patient-level DP-SGD among them, every entry's RDP composed by
    :mod:`common.trust.secure_aggregation.distributed_dp` (Skellam sums, Poisson-subsampled and plain Gaussian releases
    alike, all add/remove one patient: docs/privacy.md). A training without noise makes it infinite."""
    if not any(r.get(kind) for r in releases for kind in COMPOSED_KINDS):
        return epsilon_of([r.get("noise-multiplier") for r in releases], delta)
    from common.trust.secure_aggregation import distributed_dp as ddp

    mechanisms = []
    for release in releases:
        parts = [release[kind] for kind in COMPOSED_KINDS if release.get(kind)]
        if release.get("noise-multiplier"):
            parts.append({"mechanism": "gaussian", "noise-multiplier": release["noise-multiplier"]})
        mechanisms += parts or [{"noise-multiplier": None}]
    return ddp.epsilon(mechanisms, delta)


def audit_releases(path: str | Path) -> list[dict[str, Any]]:
    """The ``privacy-release`` lines of an audit log (its chain checked, in the lines added since this process last
    read it: PolicyRefusal when it is broken), with the line's time."""
    from common.trust.audit import verified_events

    result, records = verified_events(path, RELEASE_EVENT)
    if not result.ok:
        line, what = result.problems[0]
        raise PolicyRefusal(f"its audit log {path} does not verify (line {line} {what}), so its privacy ledger cannot "
                            "be checked; it trains no more until an operator repairs the log")
    return [{**{f: record.get(f) for f in RELEASE_FIELDS}, "time": record.get("time")} for record in records]


def rebuild_ledger(audit_path: str | Path, folder: str | Path) -> int:
    """An operator's repair: the privacy ledger in ``folder`` written anew from the audit log's releases (its chain
    must verify). The old ledger is kept beside it. Returns how many trainings the ledger now holds."""
    path = Path(audit_path)
    if not path.is_file() or path.stat().st_size == 0:
        raise PolicyRefusal(f"the audit log {path} is {'empty' if path.is_file() else 'missing'}: there is nothing "
                            "to rebuild the ledger from, and a ledger started afresh would forget every training "
                            "(name the hospital's audit.jsonl; a damaged one is kept beside it as audit.jsonl.1)")
    releases = audit_releases(audit_path)
    ledger = PrivacyLedger(folder)
    if ledger.path.exists():
        os.replace(ledger.path, ledger.path.with_name(f"{LEDGER_FILE}.{time.strftime('%Y%m%dT%H%M%S')}.replaced"))
    ledger._write(releases)
    return len(releases)


class EpsilonCounter:
    """Epsilon at ``delta`` after each ledger entry, as :func:`releases_epsilon` counts the entries so far, in one
    pass: RDP adds up, so an entry costs one addition (its RDP is computed once per kind of noise) and one
    conversion, never a recount of the ones before it: a hospital's year of trainings is read in linear time."""

    _known: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  #: each kind of noise's RDP, for every counter

    def __init__(self, delta: float):
        from common.trust.local_dp import accountant_module
        from common.trust.secure_aggregation import distributed_dp as ddp

        self.delta, self.count, self._ddp = delta, 0, ddp
        self._rdp_module = accountant_module().rdp.rdp_privacy_accountant
        self._orders = np.asarray(self._rdp_module.DEFAULT_RDP_ORDERS, dtype=np.float64)  #: Google's accountant's
        self._local = np.zeros(len(self._orders))  #: its RDP of the Gaussian releases (inf: one without noise)
        self._sums = False  #: a noised secure sum or DP-SGD among the entries: every one composed by ddp
        self._rdp = np.zeros(len(ddp.ORDERS))  #: the ddp composition of every entry
        self._shift: np.ndarray | None = None  #: the orders' part of the epsilon bound (made once)

    def _rdp_of(self, entry: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        key = (entry.get("noise-multiplier"), *(json.dumps(entry[kind], sort_keys=True) if entry.get(kind) else None
                                                for kind in COMPOSED_KINDS))
        if key not in self._known:
            z = entry.get("noise-multiplier")
            local = np.full(len(self._orders), math.inf) if z is None else \
                self._rdp_module._compute_rdp_poisson_subsampled_gaussian(q=1.0, noise_multiplier=float(z),
                                                                          orders=self._orders)
            parts = [entry[kind] for kind in COMPOSED_KINDS if entry.get(kind)]
            if z:
                parts.append({"mechanism": "gaussian", "noise-multiplier": z})
            self._known[key] = (np.asarray(local, dtype=np.float64),
                                self._ddp.rdp(parts or [{"noise-multiplier": None}]))
        return self._known[key]

    def add(self, entry: dict[str, Any]) -> float:
        """Count one more entry; the epsilon of every entry counted so far."""
        return self.extend([entry])

    def extend(self, entries: list[dict[str, Any]]) -> float:
        """Count these entries; the epsilon of every entry counted so far (converted once, at the end)."""
        for entry in entries:
            local, distributed = self._rdp_of(entry)
            self.count += 1
            self._local = self._local + local
            self._rdp = self._rdp + distributed
            self._sums = self._sums or any(entry.get(kind) for kind in COMPOSED_KINDS)
        return self.epsilon()

    def epsilon(self) -> float:
        if not self.count:
            return 0.0
        if self._sums:
            if not np.isfinite(self._rdp).all():
                return math.inf
            orders = np.asarray(self._ddp.ORDERS, dtype=np.float64)
            eps = self._rdp + np.log1p(-1 / orders) - (math.log(self.delta) + np.log(orders)) / (orders - 1)
            return float(max(0.0, np.min(eps)))
        if not np.isfinite(self._local).all():
            return math.inf
        if self._shift is None:
            self._shift = _epsilon_shift(self._orders, self.delta)
        return _rdp_to_epsilon(self._orders, self._local, self.delta, self._shift)

    def after(self, entry: dict[str, Any]) -> float:
        """The epsilon one more entry would make it (what the hospital checks before it trains)."""
        import copy

        return copy.copy(self).add(entry)


def _epsilon_shift(orders: np.ndarray, delta: float) -> np.ndarray:
    """The part of :func:`_rdp_to_epsilon`'s bound that depends on the orders and delta only."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1)


def _rdp_to_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float, shift: np.ndarray | None = None) -> float:
    """dp-accounting's ``compute_epsilon`` (Balle et al. 2020, Proposition 12) over arrays: its branches, one
    NumPy pass instead of a Python loop per order (``shift``: :func:`_epsilon_shift`, made once per counter)."""
    bound = rdp + (_epsilon_shift(orders, delta) if shift is None else shift)
    eps = np.where(rdp < 0, 0.0, np.where(delta ** 2 + np.expm1(-rdp) > 0, 0.0,
                                          np.where(orders > 1.01, bound, math.inf)))
    return float(max(0.0, eps[int(np.argmin(eps))]))
