"""A hospital's own data-protection policy, read from the file its node config names (``policy-file``) and enforced
at the hospital, whatever the server asks (docs/privacy.md).

    # policy.toml (or the same keys in a JSON object)
    tasks = ["classification"]          # which tasks it takes part in (absent: any)
    methods = ["fedavg", "fedproin"]    # which methods (strategies) it trains (absent: any)
    min-samples = 20                    # k: no statistic of fewer than k samples leaves the hospital
    max-rounds-per-run = 50             # the most rounds of one run it trains in (0: no limit)
    release-metrics = "validation"      # all | validation | none (default: all; none under local-dp)

    [local-dp]                          # clip each update to clip-norm, add N(0, (noise-multiplier * clip-norm)^2)
    clip-norm = 1.0
    noise-multiplier = 1.0
    delta = 1e-5
    max-epsilon = 8.0                   # refuse to train once the next round would pass it (0: no limit)

What the rules do to each method's reply, and what epsilon means, is docs/privacy.md. Nothing in a message changes a
policy: the hospital reads the file (again for every message) and the server only sees what it leads to (a smaller
reply, a refusal with its reason). The privacy ledger (every round the hospital trained in, with its noise) is kept
in the hospital's state folder, so its epsilon survives restarts and counts every run on the same data; epsilon is
computed with Google's ``dp-accounting`` (RDP accountant), installed by the ``privacy`` extra.
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping

import numpy as np
from pydantic import Field, ValidationError, field_validator, model_validator

from common.settings import ConfigError, Section

#: Methods whose reply is the model the hospital received, trained: local DP clips and noises its update.
DP_METHODS = frozenset({"fedavg", "fedprox", "moon", "fedbn", "fedproin"})
#: Why local DP is refused for the others (their reply is not the received model).
NO_DP_REASON = {
    "fedproto": "FedProto's reply is its class means and its own model, never a model it received, so there is no "
                "update to clip",
    "qfedpolyp": "QFedPolyp's reply is b-bit packed codes of its update (common/quantization), which noise added "
                 "here would not survive",
    "fedmepd": "FedMEPD's reply (modality encoders and shared decoder filters, its personal filters masked out) is "
               "not covered: local DP is not implemented for the FedMEPD family",
    "fedmepd-fedavg": "local DP is not implemented for the FedMEPD family",
    "fedmepd-federated-decoder": "local DP is not implemented for the FedMEPD family",
    "fedmepd-local": "local DP is not implemented for the FedMEPD family",
}
#: Reply metrics that are counts the protocol needs, not statistics of the data (``release-metrics`` keeps them).
PROTOCOL_METRICS = frozenset({"num-examples", "server-round", "state-from-round", "bit-width", "influence",
                              "personal-filters"})
#: What a reply says of the hospital's machine (its compute time, its device): sent only with release-metrics='all',
#: as under secure aggregation (timing tells something of the data's size and the site's hardware).
MACHINE_METRICS = frozenset({"hospital-seconds", "clientapp-start-seconds"})
LEDGER_FILE = "privacy-ledger.json"
#: FedProIn's influence counts are noised with this many times noise-multiplier (in samples) under local DP.
COUNT_NOISE_FACTOR = 2.0


class PolicyRefusal(RuntimeError):
    """The hospital's policy does not allow what the message asks; ``str()`` is the reason the server is given."""


class LocalDP(Section):
    """Local differential privacy of each training reply (docs/privacy.md)."""

    clip_norm: float = Field(gt=0.0, description="C: the update's L2 norm is cut to at most this.")
    noise_multiplier: float = Field(gt=0.0, description="sigma: Gaussian noise of std sigma * C per coordinate.")
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="The delta epsilon is reported at.")
    max_epsilon: float = Field(0.0, ge=0.0, description="Refuse to train once the next round would pass this "
                                                        "(0: track epsilon, no limit).")


class DistributedDP(Section):
    """Distributed DP under secure aggregation (docs/privacy.md): what a hospital requires of every secure round's
    noise, and what it counts of it."""

    min_noise_multiplier: float = Field(gt=0.0, description=(
        "The sum's noise (std over the norm bound) as this hospital counts it, from the honest hospitals' shares "
        "alone, may not be below this; a round plan with less is refused before training."))
    max_dropped_or_colluding: int = Field(0, ge=0, description=(
        "Of the min-hospitals-per-sum hospitals of a sum, how many may add noise the server knows or none at all "
        "(dropped out, or colluding with it): their shares are not counted."))
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="The delta epsilon is reported at.")
    max_epsilon: float = Field(0.0, ge=0.0, description="Refuse to train once the next sum would pass this "
                                                        "(0: track epsilon, no limit).")


class Policy(Section):
    """What the hospital allows: tasks, methods, the fewest samples behind a statistic, rounds per run, local DP."""

    tasks: list[str] = Field(default_factory=list, description="Tasks it takes part in (empty: any).")
    methods: list[str] = Field(default_factory=list, description="Methods it trains (empty: any).")
    min_samples: int = Field(1, ge=1, description="k: no prototype, class mean or count of fewer than k samples "
                                                  "leaves; with fewer than k training samples it does not train.")
    max_rounds_per_run: int = Field(0, ge=0, description=(
        "The most trainings it does for one run (0: no limit), counted from its ledger: every training counts, "
        "whatever round number the server gives it, a round sent again included."))
    max_trainings_per_day: int = Field(0, ge=0, description=(
        "The most trainings it does in any 24 hours, whatever the run (0: no limit): a new run name does not start "
        "the count afresh."))
    models: list[str] = Field(default_factory=list, description=(
        "Networks of the consortium's own it runs, by import path ('*' matches any run of characters); built-in "
        "ones need no listing (common/trust/code_gate.py)."))
    datasets: list[str] = Field(default_factory=list, description="Data loaders of its own it runs, by import path.")
    apps: list[str] = Field(default_factory=list, description=(
        "SHA-256 hashes of the app bundles (FABs) it runs (`fedmed app-hash`); fedmed-supernode refuses others."))
    release_metrics: Literal["all", "validation", "none"] | None = Field(None, description=(
        "Metrics a reply may carry besides the counts the protocol needs: all (validation and training), "
        "validation (val-*), none (and no evaluate replies). Default: all; none under local-dp."))
    local_dp: LocalDP | None = None
    distributed_dp: DistributedDP | None = Field(None, description=(
        "Distributed DP: every training goes into a secure sum that carries noise (its [distributed-dp] table), "
        "counted in the ledger; anything else is refused unless local-dp noises it."))
    require_secure_aggregation: bool = Field(False, description=(
        "It sends its training replies only masked (secure aggregation): a plain training request is refused."))
    min_hospitals_per_sum: int = Field(2, ge=2, description=(
        "Under secure aggregation: the fewest hospitals a round and a survivor set (the hospitals in the sum) may "
        "have; fewer are refused (docs/secure-aggregation.md)."))
    allow_pretrained: bool = Field(False, description=(
        "Networks and loaders may be asked for pretrained weights (from the hospital's own cache: nothing is "
        "downloaded while it answers). Default: such flags in model-args or dataset-args are refused."))
    argument_folders: list[str] = Field(default_factory=list, description=(
        "Folders besides data-dir and state-dir that paths in model-args, dataset-args and encoder-weights may "
        "name (a folder of reviewed weights, say); any other path is refused (common/trust/argument_gate.py)."))
    job_limits: dict[str, int] = Field(default_factory=dict, description=(
        "The most a job may ask of this hospital, by run-config key (local-epochs, batch-size, data-workers, "
        "image-size, ...); keys left out keep common/trust/argument_gate.py's DEFAULT_JOB_LIMITS."))
    min_update_norm_bound: float = Field(0.0, ge=0.0, description=(
        "Under secure aggregation: the round plan's norm bound (every hospital clips its update to it) may not be "
        "below this (0: any)."))
    max_sample_weight: int = Field(0, ge=0, description=(
        "Under secure aggregation: the most samples its own weight in a sum counts (0: its training samples, under "
        "the round plan's common cap)."))
    min_threshold_fraction: float = Field(0.5, ge=0.5, lt=1.0, description=(
        "Under secure aggregation: the reconstruction threshold must be more than this fraction of the shares (at "
        "least one half, which holds without a policy too: a server telling two groups different survivor sets "
        "cannot then rebuild both secrets of one hospital)."))

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, value: list[str]) -> list[str]:
        from common.config import TASK_DATASETS

        unknown = [task for task in value if task not in TASK_DATASETS]
        if unknown:
            raise ValueError(f"unknown task {unknown[0]!r}; tasks are {', '.join(TASK_DATASETS)}")
        return value

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, value: list[str]) -> list[str]:
        from common.methods.registry import method_names

        unknown = [name for name in value if name not in method_names()]
        if unknown:
            raise ValueError(f"unknown method {unknown[0]!r}; methods are {', '.join(method_names())}")
        return value

    @field_validator("apps")
    @classmethod
    def _app_hashes(cls, value: list[str]) -> list[str]:
        bad = [item for item in value if len(item) != 64 or any(c not in "0123456789abcdef" for c in item.lower())]
        if bad:
            raise ValueError(f"{bad[0]!r} is not the SHA-256 of an app bundle (64 hex digits; `fedmed app-hash APP` "
                             "prints it)")
        return [item.lower() for item in value]

    @field_validator("job_limits")
    @classmethod
    def _known_limits(cls, value: dict[str, int]) -> dict[str, int]:
        from common.trust.argument_gate import DEFAULT_JOB_LIMITS

        for key, most in value.items():
            if key not in DEFAULT_JOB_LIMITS:
                raise ValueError(f"{key!r} is not a job key with a limit ({', '.join(DEFAULT_JOB_LIMITS)})")
            if most < 1:
                raise ValueError(f"{key}={most}: a limit is at least 1")
        return value

    @property
    def limits(self) -> dict[str, int]:
        """The most each job key may ask of this hospital: the policy's ``job-limits`` over the defaults."""
        from common.trust.argument_gate import DEFAULT_JOB_LIMITS

        return {**DEFAULT_JOB_LIMITS, **self.job_limits}

    @property
    def counts_releases(self) -> bool:
        """Whether the policy depends on what its ledger holds (then the audit log must hold it too)."""
        return bool(self.local_dp or self.distributed_dp or self.max_rounds_per_run or self.max_trainings_per_day)

    @model_validator(mode="after")
    def _honest_shares(self) -> "Policy":
        dp = self.distributed_dp
        if dp is not None and self.min_hospitals_per_sum - dp.max_dropped_or_colluding < 1:
            raise ValueError(f"distributed-dp: max-dropped-or-colluding={dp.max_dropped_or_colluding} leaves no "
                             f"honest hospital of min-hospitals-per-sum={self.min_hospitals_per_sum} to count on")
        return self

    @property
    def honest_shares(self) -> int:
        """The hospitals of a sum whose noise shares it counts on (distributed DP)."""
        dp = self.distributed_dp
        return self.min_hospitals_per_sum - (dp.max_dropped_or_colluding if dp is not None else 0)

    @model_validator(mode="after")
    def _dp_methods_only(self) -> "Policy":
        if self.local_dp is not None and self.methods:
            refused = [name for name in self.methods if name not in DP_METHODS]
            if refused:
                raise ValueError(f"local-dp: method {refused[0]!r} cannot be trained under local DP "
                                 f"({NO_DP_REASON.get(refused[0], 'its reply is not the model')}); allow only "
                                 f"{', '.join(sorted(DP_METHODS))} with local-dp")
        return self

    @property
    def metrics_released(self) -> str:
        return self.release_metrics or ("none" if self.local_dp is not None else "all")


#: the policy file formats by suffix (anything else is read as TOML)
POLICY_FORMATS = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}


def parse_policy_text(path: Path, data: bytes) -> Any:
    """The file's table, read in the format its suffix names; ConfigError naming the file and the format."""
    form = POLICY_FORMATS.get(path.suffix.lower(), "TOML")
    try:
        text = data.decode("utf-8")
        if form == "JSON":
            return json.loads(text)
        if form == "YAML":
            try:
                import yaml
            except ImportError:
                raise ConfigError(f"policy-file {str(path)!r} is YAML, which needs PyYAML (pip install pyyaml); or "
                                  "write the policy as TOML or JSON") from None
            try:
                return yaml.safe_load(text)  # plain data only: no tags that build objects
            except yaml.YAMLError as error:
                raise ValueError(str(error)) from None
        import tomllib

        return tomllib.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise ConfigError(f"policy-file {str(path)!r} is not valid {form}: {error}") from None


def read_policy(path: str | Path) -> tuple[Policy, str]:
    """The policy in ``path`` (TOML; JSON or YAML when it ends in .json, .yaml or .yml) and the SHA-256 of the
    file's bytes; ConfigError names the file and the key at fault."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"policy-file {str(path)!r} cannot be read: {error.strerror or error}") from None
    raw = parse_policy_text(path, data)
    if not isinstance(raw, dict):
        raise ConfigError(f"policy-file {str(path)!r} must hold a table of keys, not {type(raw).__name__}")
    try:
        policy = Policy.model_validate(raw)
    except ValidationError as error:
        from common.config import describe_validation_error

        raise ConfigError(describe_validation_error(error, what=f"policy-file {str(path)!r}")) from None
    if policy.local_dp is not None:
        accountant_module()
    return policy, hashlib.sha256(data).hexdigest()


def accountant_module():
    try:
        import dp_accounting
    except ImportError:
        raise ConfigError("the policy's local-dp needs Google's dp-accounting to count epsilon: pip install "
                          "'fedmed-hospitals[privacy]' (or dp-accounting) in the hospital's environment") from None
    return dp_accounting


def epsilon_of(noise_multipliers: list[float | None], delta: float) -> float:
    """Epsilon at ``delta`` of the Gaussian mechanisms with these noise multipliers (relative to their sensitivity),
    composed (RDP accountant); a release without noise (None) makes it infinite; no release, 0."""
    if not noise_multipliers:
        return 0.0
    if any(z is None for z in noise_multipliers):
        return math.inf
    dp_accounting = accountant_module()
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant()
    counts: dict[float, int] = {}
    for z in noise_multipliers:
        counts[float(z)] = counts.get(float(z), 0) + 1
    for z, count in sorted(counts.items()):
        accountant.compose(dp_accounting.GaussianDpEvent(z), count)
    return float(accountant.get_epsilon(delta))


def effective_noise_multiplier(method: str, noise_multiplier: float) -> float:
    """The noise multiplier of one round's release relative to its sensitivity when one sample of the hospital's
    data is replaced by another: the clipped update moves by at most 2C, so sigma * C of noise is sigma / 2 of it;
    FedProIn's influence counts (one sample moves two counts by 1, noise COUNT_NOISE_FACTOR * sigma) add to it."""
    ratio = (2.0 / noise_multiplier) ** 2
    if method == "fedproin":
        ratio += (math.sqrt(2.0) / (COUNT_NOISE_FACTOR * noise_multiplier)) ** 2
    return 1.0 / math.sqrt(ratio)


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
RELEASE_FIELDS = ("run", "round", "method", "noise-multiplier", "distributed-dp")
#: How far a ledger entry's time may be from its audit line's (entries written before both shared one time were
#: stamped a moment apart); a clock set back further, to train past max-trainings-per-day, stops training.
TIME_TOLERANCE_SECONDS = 120.0


def _seconds(stamp: Any) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ")))
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
               distributed: dict[str, Any] | None = None) -> None:
        """One training, in the audit log first (so that a crash between the two errs towards counting it);
        ``distributed``: the secure sum's noise it counted (``distributed_dp.release``)."""
        entry = {"run": run, "round": rnd, "method": method, "noise-multiplier": noise_multiplier,
                 "distributed-dp": distributed,
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


def releases_epsilon(releases: list[dict[str, Any]], delta: float) -> float:
    """Epsilon at ``delta`` of ledger entries: local DP's Gaussian releases by Google's RDP accountant; with any
    secure sum under distributed DP among them, every entry composed by :mod:`common.trust.secure_aggregation.
    distributed_dp` (Skellam sums and Gaussian releases alike). A training without noise makes it infinite."""
    if not any(r.get("distributed-dp") for r in releases):
        return epsilon_of([r.get("noise-multiplier") for r in releases], delta)
    from common.trust.secure_aggregation import distributed_dp as ddp

    mechanisms = []
    for release in releases:
        parts = [release["distributed-dp"]] if release.get("distributed-dp") else []
        if release.get("noise-multiplier"):
            parts.append({"mechanism": "gaussian", "noise-multiplier": release["noise-multiplier"]})
        mechanisms += parts or [{"noise-multiplier": None}]
    return ddp.epsilon(mechanisms, delta)


def audit_releases(path: str | Path) -> list[dict[str, Any]]:
    """The ``privacy-release`` lines of an audit log (its chain checked: PolicyRefusal when it is broken), with the
    line's time."""
    from common.trust.audit import records_of, verify

    path = Path(path)
    if not path.exists():
        return []
    result = verify(path)
    if not result.ok:
        line, what = result.problems[0]
        raise PolicyRefusal(f"its audit log {path} does not verify (line {line} {what}), so its privacy ledger cannot "
                            "be checked; it trains no more until an operator repairs the log")
    return [{**{f: record.get(f) for f in RELEASE_FIELDS}, "time": record.get("time")}
            for _, record in records_of(path) if record.get("event") == RELEASE_EVENT]


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


AuditFn = Callable[..., Any]


class Enforcer:
    """A policy applied to one hospital's answers: checks before the work, what the reply may carry after it, the
    ledger of its trainings. ``audit(event, **fields)`` is told every decision (the hospital's audit log)."""

    def __init__(self, policy: Policy, ledger: PrivacyLedger, source: str = "policy", policy_sha256: str = "",
                 audit: AuditFn | None = None):
        self.policy = policy
        self.ledger = ledger
        self.source = source
        self.policy_sha256 = policy_sha256
        self._audit = audit

    def note(self, decision: str, **fields: Any) -> None:
        if self._audit is not None:
            self._audit("policy", decision=decision, policy=self.source, **{"policy-sha256": self.policy_sha256},
                        **fields)

    def refuse(self, reason: str, **fields: Any) -> PolicyRefusal:
        self.note("refused", reason=reason, **fields)
        return PolicyRefusal(f"refused by its policy ({Path(self.source).name}): {reason}")

    # --- before the work ---------------------------------------------------------------------------
    def check_job(self, kind: str, cfg, where: dict[str, Any]) -> None:
        """The task and method are allowed (and local DP can cover the method); evaluate: metrics may leave."""
        policy = self.policy
        if policy.tasks and cfg.task not in policy.tasks:
            raise self.refuse(f"task {cfg.task!r} is not among the tasks it takes part in "
                              f"({', '.join(policy.tasks)})", **where)
        if policy.methods and cfg.strategy not in policy.methods:
            raise self.refuse(f"method {cfg.strategy!r} is not among the methods it trains "
                              f"({', '.join(policy.methods)})", **where)
        if policy.local_dp is not None and cfg.strategy not in DP_METHODS:
            raise self.refuse(f"local-dp: {NO_DP_REASON.get(cfg.strategy, 'its reply is not the model')}, so it "
                              f"cannot be trained under the policy's local DP (methods it can: "
                              f"{', '.join(sorted(DP_METHODS))})", **where)
        if kind == "evaluate" and policy.metrics_released == "none":
            raise self.refuse("release-metrics='none': it sends no metrics, so it does not evaluate", **where)

    def check_train(self, cfg, site, run: str, rnd: int, where: dict[str, Any],
                    distributed: dict[str, Any] | None = None) -> float | None:
        """Enough samples, rounds left in this run, epsilon left (``distributed``: the noise of the secure sum it
        goes into); returns this round's local-DP noise multiplier."""
        policy = self.policy
        k = policy.min_samples
        if len(site.train) < k:
            raise self.refuse(f"it holds fewer training samples than min-samples={k}, so it does not train", **where)
        try:
            self.ledger.releases()  # a ledger that no longer matches the audit log stops everything below
        except PolicyRefusal as error:
            raise self.refuse(str(error), **where) from None
        if policy.max_rounds_per_run:
            done = self.ledger.trainings_in(run)
            if done >= policy.max_rounds_per_run:
                raise self.refuse(f"it has trained {done} times for run {run!r} (a round sent again counts again), "
                                  f"max-rounds-per-run={policy.max_rounds_per_run}", **where)
        if policy.max_trainings_per_day:
            done = self.ledger.trainings_since(24 * 3600)
            if done >= policy.max_trainings_per_day:
                raise self.refuse(f"it has trained {done} times in the last 24 hours (any run), "
                                  f"max-trainings-per-day={policy.max_trainings_per_day}", **where)
        dp = policy.local_dp
        z = effective_noise_multiplier(cfg.strategy, dp.noise_multiplier) if dp is not None else None
        entry = {"noise-multiplier": z, "distributed-dp": distributed}
        for table in (dp, policy.distributed_dp):
            if table is not None and table.max_epsilon:
                self.check_budget(table, entry, where)
        return z

    def check_budget(self, table: "LocalDP | DistributedDP", entry: dict[str, Any], where: dict[str, Any]) -> None:
        """Refuse when one more training (``entry``) would take epsilon past the table's max-epsilon."""
        now, after = self.ledger.epsilon(table.delta), self.ledger.epsilon(table.delta, [entry])
        if after > table.max_epsilon:
            spent = "rounds trained without noise make it infinite" if math.isinf(now) else f"{now:.3g}"
            raise self.refuse(f"privacy budget spent: epsilon is {spent} at delta={table.delta:g}, one more round "
                              f"would make it {after:.3g}, above max-epsilon={table.max_epsilon:g}; it trains no "
                              "more on this data", epsilon=now if math.isfinite(now) else None, **where)

    def distributed_release(self, payload, where: dict[str, Any]) -> dict[str, Any] | None:
        """The noise of the secure sum this training goes into, as the policy's [distributed-dp] counts it (None:
        the policy has no such table); refused when the round plan adds no noise (unless local DP noises the
        update) or less than the policy's min-noise-multiplier, counted from the honest hospitals' shares."""
        table = self.policy.distributed_dp
        if table is None:
            return None
        from common.trust.secure_aggregation import distributed_dp as ddp
        from common.trust.secure_aggregation.messages import PLAN_KEY

        text = payload.config.get(PLAN_KEY)
        try:
            params = ddp.Parameters.from_plan(json.loads(text)) if isinstance(text, str) else None
        except ValueError as error:
            raise self.refuse(f"distributed-dp: {error}", **where) from None
        if params is None:
            if self.policy.local_dp is None:
                raise self.refuse("distributed-dp: this training is not part of a secure sum with distributed DP, "
                                  "so its update would leave without noise", **where)
            return None
        honest = self.policy.honest_shares
        z = ddp.effective_noise_multiplier(params, honest)
        if z < table.min_noise_multiplier:
            raise self.refuse(f"distributed-dp: the round's noise multiplier {params.noise_multiplier:g}, shared by "
                              f"{params.hospitals} hospitals, is {z:.3g} from the {honest} honest ones it counts on "
                              f"(min-hospitals-per-sum {self.policy.min_hospitals_per_sum} less "
                              f"max-dropped-or-colluding {table.max_dropped_or_colluding}), below its "
                              f"min-noise-multiplier={table.min_noise_multiplier:g}", **where)
        return ddp.release(params, honest)

    # --- the work ---------------------------------------------------------------------------------
    def train(self, method, rnd: int, payload, run: str, where: dict[str, Any]):
        """The method's training reply as the policy lets it leave; the round goes into the ledger first."""
        cfg, site = method.cfg, method.site
        with self.ledger.locked():
            self.check_job("train", cfg, where)
            distributed = self.distributed_release(payload, where)
            z = self.check_train(cfg, site, run, rnd, where, distributed)
            method.privacy_bounded = self.policy.local_dp is not None
            reply = method.timed_train(rnd, payload)
            self.apply_min_samples(method, payload, reply, where)
            if self.policy.local_dp is not None:
                self.apply_local_dp(method, payload, reply, where)
            self.filter_metrics(reply.metrics, site, where, reply.config)
            self.ledger.record(run, rnd, cfg.strategy, z, distributed)
        if z is not None:
            dp = self.policy.local_dp
            self.note("epsilon", epsilon=self.ledger.epsilon(dp.delta), delta=dp.delta,
                      **{"noise-multiplier": dp.noise_multiplier, "clip-norm": dp.clip_norm,
                         "effective-noise-multiplier": z, "max-epsilon": dp.max_epsilon}, **where)
        elif distributed is not None:
            table = self.policy.distributed_dp
            self.note("epsilon", epsilon=self.ledger.epsilon(table.delta), delta=table.delta, mechanism="skellam",
                      **{"honest-hospitals": self.policy.honest_shares, "max-epsilon": table.max_epsilon},
                      **where)
        else:
            self.note("trained", **where)
        return reply

    def evaluate_metrics(self, metrics: dict[str, Any], site, where: dict[str, Any]) -> dict[str, Any]:
        """An evaluate reply's metrics as they may leave (validation data of at least k samples)."""
        if self.policy.min_samples > 1 and len(site.val) < self.policy.min_samples:
            raise self.refuse(f"its validation data holds fewer samples than min-samples={self.policy.min_samples}",
                              **where)
        kept = {k: v for k, v in metrics.items() if not self._per_subset(k)}
        dropped = sorted(set(metrics) - set(kept))
        if dropped:
            self.note("metrics-withheld", metrics=dropped, **where)
        return kept

    # --- what the reply may carry -------------------------------------------------------------------
    def _per_subset(self, key: str) -> bool:
        """A metric of a part of the data (polyp ``dice/<source>``), which may hold fewer than k samples."""
        return self.policy.min_samples > 1 and "/" in key

    def filter_metrics(self, metrics: dict[str, Any], site, where: dict[str, Any], config: dict[str, Any]) -> None:
        """What the reply's metrics (and its ``device``, in ``config``) may say under ``release-metrics``."""
        release = self.policy.metrics_released
        dropped = []
        if release != "all" and config.pop("device", None) is not None:
            dropped.append("device")
        for key in list(metrics):
            if key in PROTOCOL_METRICS:
                continue
            validation = key.startswith("val-")
            keep = (release == "all" or release == "validation" and validation) and not self._per_subset(key)
            if validation and len(site.val) < self.policy.min_samples:
                keep = False
            if not keep:
                dropped.append(key)
                del metrics[key]
        if dropped:
            self.note("metrics-withheld", metrics=sorted(dropped), **{"release-metrics": release}, **where)

    def apply_min_samples(self, method, payload, reply, where: dict[str, Any]) -> None:
        """k: FedProIn's influence counts below k are sent as 0 and those prototypes as received; FedProto's means
        of classes with fewer than k samples are not sent (count 0, the received global mean in their place)."""
        k, name = self.policy.min_samples, method.cfg.strategy
        if name == "fedproin":
            received = payload.arrays["model"]["prototypes"]
            counts = np.asarray(reply.metrics["influence"], dtype=np.float64).reshape(received.shape[:2])
            if self.policy.local_dp is not None:  # noised first: the threshold is then applied to noisy counts
                sigma = COUNT_NOISE_FACTOR * self.policy.local_dp.noise_multiplier
                counts = np.clip(np.rint(counts + noise_rng().normal(0.0, sigma, counts.shape)), 0, None)
                limit = float(len(method.site.train))
                if counts.sum() > limit:  # the server refuses more than the declared samples (post-processing)
                    counts = np.floor(counts * limit / counts.sum())
            small = counts < k
            counts[small] = 0
            prototypes = reply.arrays["model"]["prototypes"]
            prototypes[small] = received[small]
            reply.metrics["influence"] = [int(c) for c in counts.ravel()]
            self.note("min-samples", k=k, **{"prototypes-withheld": int(small.sum()), "of": int(small.size)}, **where)
        elif name == "fedproto" and k > 1:
            from strategies.fedproto.server import PROTOTYPES

            group = reply.arrays[PROTOTYPES]
            per_class = np.bincount(np.asarray(method.site.train.labels), minlength=len(group["count"]))
            small = per_class[:len(group["count"])] < k
            group["count"] = np.where(small, 0, group["count"]).astype(group["count"].dtype)
            group["mean"][small] = payload.arrays[PROTOTYPES]["mean"][small]
            self.note("min-samples", k=k, **{"class-means-withheld": int(small.sum()), "of": int(small.size)},
                      **where)

    def apply_local_dp(self, method, payload, reply, where: dict[str, Any]) -> None:
        """The model update clipped to C, N(0, (sigma C)^2) added to each coordinate; FedBN sends the initial
        normalisation layers in place of its own. Any other array group makes the reply refused (fail closed)."""
        dp = self.policy.local_dp
        groups = set(reply.arrays) - {"model"}
        if method.cfg.strategy == "fedbn":
            from strategies.fedbn.norm_layers import NORM_GROUP

            reply.arrays[NORM_GROUP] = initial_norm_layers(method, payload, set(reply.arrays[NORM_GROUP]))
            groups.discard(NORM_GROUP)
        if groups:
            raise self.refuse(f"local-dp: the reply carries array groups {sorted(groups)} besides the model, which "
                              "the policy cannot bound", **where)
        noised, norm = clip_and_noise(payload.arrays["model"], reply.arrays["model"], dp.clip_norm,
                                      dp.noise_multiplier, noise_rng())
        reply.arrays["model"] = noised
        self.note("local-dp", **{"clip-norm": dp.clip_norm, "noise-multiplier": dp.noise_multiplier,
                                 "update-norm": norm, "clipped": bool(norm > dp.clip_norm)}, **where)


def noise_rng() -> np.random.Generator:
    """Noise the server cannot reproduce: seeded from the operating system's entropy, never from the run's seed
    (which the server knows)."""
    return np.random.default_rng(secrets.randbits(128))


def clip_and_noise(received: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray], clip_norm: float,
                   noise_multiplier: float, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], float]:
    """``received + clip(trained - received, C) + N(0, (sigma C)^2)``, every array; the update's norm before
    clipping. Arrays must be floating point of the received shapes (anything else could leave unbounded)."""
    deltas: dict[str, np.ndarray] = {}
    for name, value in trained.items():
        value = np.asarray(value)
        base = received.get(name)
        if base is None or np.shape(base) != value.shape or value.dtype.kind != "f":
            raise PolicyRefusal(f"local-dp: array {name!r} of the reply is not a floating-point array of the received "
                                "model, so its change cannot be bounded")
        deltas[name] = value.astype(np.float64) - np.asarray(base, dtype=np.float64)
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in deltas.values()))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    std = noise_multiplier * clip_norm
    noised = {}
    for name, delta in deltas.items():
        value = np.asarray(received[name], dtype=np.float64) + scale * delta + rng.normal(0.0, std, delta.shape)
        if name.endswith("running_var"):  # post-processing: a variance stays positive (the server refuses others)
            value = np.maximum(value, 1e-5)
        noised[name] = value.astype(np.asarray(trained[name]).dtype)
    return noised, norm


def initial_norm_layers(method, payload, names: set[str]) -> dict[str, np.ndarray]:
    """FedBN: the normalisation layers of the job's initial model (the same seed as the server's), which say nothing
    about the hospital's data."""
    import torch

    from common.engine.arrays import model_arrays

    method.task.adopt_spec(payload.config)
    torch.manual_seed(method.cfg.seed)
    initial = model_arrays(method.task.initial_model())
    return {name: initial[name] for name in names}


def enforcer_for(policy_file: str, state_root: str | Path | None, audit_log: Any = None) -> Enforcer | None:
    """The hospital's enforcer for the policy in ``policy_file`` (None without one); ``audit_log`` (an AuditLog) is
    told every decision and holds the ledger's entries. A policy whose limits are counted from the ledger needs it."""
    if not policy_file:
        return None
    policy, digest = read_policy(policy_file)
    if audit_log is None and policy.counts_releases:
        raise ConfigError(f"policy-file {policy_file!r}: local-dp, max-rounds-per-run and max-trainings-per-day are "
                          "counted from the privacy ledger, which the audit log guards; node config audit-log='none' "
                          "cannot be used with them")
    return Enforcer(policy, PrivacyLedger(state_root, audit_log), policy_file, digest,
                    audit_log.append if audit_log is not None else None)


def policed(hospital_class: type, enforcer: Enforcer | Callable[[str], Enforcer], run: str = "in-process") -> type:
    """``hospital_class`` whose training replies go through ``enforcer`` (or ``enforcer(hospital name)``, one per
    hospital, each with its own ledger): in-process runs (benchmarks/privacy, tests)."""

    class Policed(hospital_class):
        def timed_train(self, rnd, payload):
            if getattr(self, "_policed", False):
                return super().timed_train(rnd, payload)
            self._policed = True
            try:
                chosen = enforcer if isinstance(enforcer, Enforcer) else enforcer(self.site.name)
                return chosen.train(self, rnd, payload, run, {"run": run, "round": rnd})
            finally:
                self._policed = False

    Policed.__name__ = f"Policed{hospital_class.__name__}"
    return Policed
