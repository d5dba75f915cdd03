"""A hospital's own data-protection policy, read from the file its node config names (``policy-file``) and enforced
at the hospital, whatever the server asks (docs/privacy.md).

    # policy.toml (or the same keys in a JSON object)
    tasks = ["classification"]          # which tasks it takes part in (absent: any)
    methods = ["fedavg", "fedproin"]    # which methods (strategies) it trains (absent: any)
    min-samples = 20                    # k: no statistic of fewer than k samples leaves the hospital
    max-rounds-per-run = 50             # the most rounds of one run it trains in (0: no limit)
    release-metrics = "validation"      # all | validation | none (default: all; none under local-dp or distributed-dp)

    [local-dp]                          # clip each update to clip-norm, add N(0, (noise-multiplier * clip-norm)^2)
    clip-norm = 1.0
    noise-multiplier = 1.0
    delta = 1e-5
    max-epsilon = 8.0                   # refuse to train once the next round would pass it (0: no limit)

    [patient-dp]                        # or: DP-SGD while it trains, epsilon per patient (patient_dp.py)
    target-epsilon = 8.0
    max-grad-norm = 1.0

What the rules do to each method's reply, and what epsilon means, is docs/privacy.md. Nothing in a message changes a
policy: the hospital reads the file (again for every message) and the server only sees what it leads to (a smaller
reply, a refusal with its reason). This module reads the file; ``enforcer.py`` applies it to every job and reply, as
each method declares its reply (its package's ``privacy.py``); ``ledger.py`` keeps every training with its noise in
the hospital's state folder, so its epsilon survives restarts; ``local_dp.py`` clips, noises and counts epsilon.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from common.settings import ConfigError, Section

#: Reply metrics that are counts every method's protocol needs, not statistics of the data (``release-metrics``
#: keeps them, and those each method declares: ``common.methods.privacy.PrivacyRules.protocol_metrics``).
PROTOCOL_METRICS = frozenset({"num-examples", "server-round", "state-from-round"})
#: What a reply says of the hospital's machine (its compute time, its device): sent only with release-metrics='all',
#: as under secure aggregation (timing tells something of the data's size and the site's hardware).
MACHINE_METRICS = frozenset({"hospital-seconds", "clientapp-start-seconds"})
#: a pinned key's fingerprint (``peers``): OpenSSH's SHA-256 one, common/trust/identity.py's ``key_fingerprint``
FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")


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


class PatientDP(Section):
    """Patient-level DP-SGD while the hospital trains (common/trust/patient_dp.py, docs/privacy.md): every step's
    gradient is the sum of per-patient gradients, each clipped, plus Gaussian noise; patients Poisson-sampled."""

    target_epsilon: float = Field(0.0, ge=0.0, description=(
        "The epsilon per patient the consortium's plan (num-server-rounds trainings) may spend; the noise is set "
        "from it. 0: noise-multiplier gives the noise."))
    noise_multiplier: float = Field(0.0, ge=0.0, description="sigma: noise of std sigma * max-grad-norm per step.")
    max_grad_norm: float = Field(gt=0.0, description="C: each patient's gradient (sum of its images') cut to this.")
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="The delta epsilon is reported at.")
    unit: Literal["patient", "image"] = Field("patient", description=(
        "What one protected record is: a patient (the data's group: HAM10000's lesion, a loader's group column; an "
        "image where the data has no groups) or each image."))
    max_epsilon: float = Field(0.0, ge=0.0, description="Refuse to train once the next round would pass this "
                                                        "(0: track epsilon, no limit).")

    @model_validator(mode="after")
    def _one_noise(self) -> "PatientDP":
        if bool(self.target_epsilon) == bool(self.noise_multiplier):
            raise ValueError("patient-dp: give exactly one of target-epsilon and noise-multiplier")
        return self


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
        "validation (val-*), none (and no evaluate replies). Default: all; none under local-dp, patient-dp or "
        "distributed-dp (a training loss, validation scores or a clipping flag in the clear are outside epsilon)."))
    local_dp: LocalDP | None = None
    patient_dp: PatientDP | None = Field(None, description=(
        "Patient-level DP-SGD: the hospital trains with clipped per-patient gradients and noise (Opacus), each "
        "training's epsilon per patient counted in the ledger."))
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
    peers: dict[str, str] = Field(default_factory=dict, description=(
        "Under secure aggregation: the consortium's hospitals it accepts, by name, each with the fingerprint of its "
        "registered public key (OpenSSH's SHA-256 fingerprint, 'SHA256:' and 43 base64 characters, as `fedmed "
        "key-fingerprint KEY.pub` and `ssh-keygen -l -f KEY.pub` print it), compared with the other hospitals' "
        "officers, not through the coordinator. A key in peer-keys that is not pinned here is refused, and "
        "distributed DP counts honest hospitals only among pinned ones. Its own key is pinned by its identity key."))
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

    @field_validator("peers")
    @classmethod
    def _fingerprints(cls, value: dict[str, str]) -> dict[str, str]:
        for name, fingerprint in value.items():
            if not FINGERPRINT.fullmatch(fingerprint):
                raise ValueError(f"peers: {name} = {fingerprint!r} is not a key fingerprint ('SHA256:' and 43 base64 "
                                 "characters, as `fedmed key-fingerprint KEY.pub` prints it)")
        return value

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
        return bool(self.local_dp or self.patient_dp or self.distributed_dp or self.max_rounds_per_run
                    or self.max_trainings_per_day)

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
            from common.methods.registry import local_dp_method_names, privacy_rules

            refused = [name for name in self.methods if not privacy_rules(name).local_dp]
            if refused:
                raise ValueError(f"local-dp: method {refused[0]!r} cannot be trained under local DP "
                                 f"({privacy_rules(refused[0]).no_local_dp}); allow only "
                                 f"{', '.join(local_dp_method_names())} with local-dp")
        return self

    @property
    def metrics_released(self) -> str:
        noised = self.local_dp is not None or self.distributed_dp is not None or self.patient_dp is not None
        return self.release_metrics or ("none" if noised else "all")


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


#: policies as parsed: (suffix, SHA-256 of the file's bytes) -> the policy (a few per process)
_PARSED: dict[tuple[str, str], Policy] = {}


def read_policy(path: str | Path) -> tuple[Policy, str]:
    """The policy in ``path`` (TOML; JSON or YAML when it ends in .json, .yaml or .yml) and the SHA-256 of the
    file's bytes; ConfigError names the file and the key at fault. The file is read for every message and parsed
    again whenever its bytes differ from any it had (a secure round reads it at each of its stages). Callers must
    not change the policy returned."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"policy-file {str(path)!r} cannot be read: {error.strerror or error}") from None
    digest = hashlib.sha256(data).hexdigest()
    known = _PARSED.get((path.suffix.lower(), digest))
    if known is not None:
        return known, digest
    raw = parse_policy_text(path, data)
    if not isinstance(raw, dict):
        raise ConfigError(f"policy-file {str(path)!r} must hold a table of keys, not {type(raw).__name__}")
    try:
        policy = Policy.model_validate(raw)
    except ValidationError as error:
        from common.config import describe_validation_error

        raise ConfigError(describe_validation_error(error, what=f"policy-file {str(path)!r}")) from None
    _PARSED[path.suffix.lower(), digest] = policy
    return policy, digest


