"""The enforcer: a hospital's policy applied to every job and reply, whatever the server asks; each decision is a
line of its audit log, each training an entry of its ledger (docs/privacy.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from common.methods.registry import local_dp_method_names, privacy_rules
from common.settings import ConfigError
from common.trust.ledger import PrivacyLedger
from common.trust.local_dp import (
    accountant_module,
    clip_and_noise,
    effective_noise_multiplier,
    noise_rng,
)
from common.trust.policy import (
    PROTOCOL_METRICS,
    DistributedDP,
    LocalDP,
    PatientDP,
    Policy,
    PolicyRefusal,
    read_policy,
)

AuditFn = Callable[..., Any]


class Enforcer:
    """A policy applied to one hospital's answers: checks before the work, what the reply may carry after it, the
    ledger of its trainings. ``audit(event, **fields)`` is told every decision (the hospital's audit log)."""

    def __init__(self, policy: Policy, ledger: PrivacyLedger, source: str = "policy", policy_sha256: str = "",
                 audit: AuditFn | None = None, peers_pinned: bool = False):
        self.policy = policy
        self.ledger = ledger
        self.source = source
        self.policy_sha256 = policy_sha256
        self._audit = audit
        #: whether every other hospital of a secure sum is one its policy pins (``peers``, checked through the
        #: consortium's keys it holds, ``peer-keys``); set by whoever built it from the node config
        self.peers_pinned = peers_pinned

    @property
    def honest_shares(self) -> int:
        """The hospitals of a sum whose distributed-DP noise it counts on: its policy's assumption among pinned
        peers; itself alone where the others are not pinned (the server could have run them)."""
        return self.policy.honest_shares if self.peers_pinned and self.policy.peers else 1

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
        rules = privacy_rules(cfg.strategy)
        if policy.local_dp is not None and not rules.local_dp:
            raise self.refuse(f"local-dp: {rules.no_local_dp}, so it cannot be trained under the policy's local DP "
                              f"(methods it can: {', '.join(local_dp_method_names())})", **where)
        if policy.patient_dp is not None and rules.no_patient_dp:
            raise self.refuse(f"patient-dp: {rules.no_patient_dp}, so it cannot be trained under the policy's "
                              "patient-level DP-SGD", **where)
        if kind == "evaluate" and policy.metrics_released == "none":
            raise self.refuse("release-metrics='none': it sends no metrics, so it does not evaluate", **where)

    def check_train(self, cfg, site, run: str, rnd: int, where: dict[str, Any],
                    distributed: dict[str, Any] | None = None, patient: dict[str, Any] | None = None) -> float | None:
        """Enough samples, rounds left in this run, epsilon left (``distributed``: the noise of the secure sum it
        goes into; ``patient``: its DP-SGD); returns this round's local-DP noise multiplier."""
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
        entry = {"noise-multiplier": z, "distributed-dp": distributed, "patient-dp": patient}
        for table in (dp, policy.distributed_dp, policy.patient_dp):
            if table is not None and table.max_epsilon:
                self.check_budget(table, entry, where)
        return z

    def check_budget(self, table: "LocalDP | DistributedDP | PatientDP", entry: dict[str, Any],
                     where: dict[str, Any]) -> None:
        """Refuse when one more training (``entry``) would take epsilon past the table's max-epsilon."""
        now, after = self.ledger.epsilon(table.delta), self.ledger.epsilon(table.delta, [entry])
        if after > table.max_epsilon:
            spent = "rounds trained without noise make it infinite" if math.isinf(now) else f"{now:.3g}"
            raise self.refuse(f"privacy budget spent: epsilon is {spent} at delta={table.delta:g}, one more round "
                              f"would make it {after:.3g}, above max-epsilon={table.max_epsilon:g}; it trains no "
                              "more on this data", epsilon=now if math.isfinite(now) else None, **where)

    def dp_sgd(self, cfg, site, where: dict[str, Any]):
        """The DP-SGD this training runs as under the policy's [patient-dp] (None without one)."""
        table = self.policy.patient_dp
        if table is None:
            return None
        from common.trust.patient_dp import DPSGD, plan_release

        try:
            return DPSGD(table, plan_release(table, cfg, site.train))
        except PolicyRefusal as error:
            raise self.refuse(str(error), **where) from None

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
        honest = self.honest_shares
        z = ddp.effective_noise_multiplier(params, honest)
        if z < table.min_noise_multiplier:
            counted = (f"min-hospitals-per-sum {self.policy.min_hospitals_per_sum} less max-dropped-or-colluding "
                       f"{table.max_dropped_or_colluding}" if self.peers_pinned and self.policy.peers else
                       "itself alone: its peers are not pinned, policy peers with node config peer-keys")
            raise self.refuse(f"distributed-dp: the round's noise multiplier {params.noise_multiplier:g}, shared by "
                              f"{params.hospitals} hospitals, is {z:.3g} from the {honest} honest ones it counts on "
                              f"({counted}), below its min-noise-multiplier={table.min_noise_multiplier:g}", **where)
        return ddp.release(params, honest)

    # --- the work ---------------------------------------------------------------------------------
    def train(self, method, rnd: int, payload, run: str, where: dict[str, Any]):
        """The method's training reply as the policy lets it leave; the round goes into the ledger first."""
        cfg, site = method.cfg, method.site
        with self.ledger.locked():
            self.check_job("train", cfg, where)
            distributed = self.distributed_release(payload, where)
            dp_sgd = self.dp_sgd(cfg, site, where)
            patient = dp_sgd.release.entry() if dp_sgd is not None else None
            z = self.check_train(cfg, site, run, rnd, where, distributed, patient)
            method.privacy_bounded = self.policy.local_dp is not None
            method.dp_sgd = dp_sgd
            try:
                reply = method.timed_train(rnd, payload)
            except PolicyRefusal as error:
                if dp_sgd is None:
                    raise
                raise self.refuse(str(error), **where) from None  # the network or the method DP-SGD cannot take
            if dp_sgd is not None and not dp_sgd.steps_done:  # fail closed: a training that bypassed DP-SGD
                raise self.refuse("patient-dp: the method's training did not run through DP-SGD, so its reply is "
                                  "not sent", **where)
            self.apply_min_samples(method, payload, reply, where)
            if self.policy.local_dp is not None:
                self.apply_local_dp(method, payload, reply, where)
            self.filter_metrics(reply.metrics, site, where, reply.config, cfg.strategy)
            self.ledger.record(run, rnd, cfg.strategy, z, distributed, patient)
        if patient is not None:
            table = self.policy.patient_dp
            self.note("epsilon", epsilon=self.ledger.epsilon(table.delta), delta=table.delta, unit=table.unit,
                      mechanism="dp-sgd", **{"noise-multiplier": patient["noise-multiplier"],
                                             "sample-rate": patient["sample-rate"], "steps": patient["steps"],
                                             "max-grad-norm": table.max_grad_norm, "max-epsilon": table.max_epsilon},
                      **where)
        elif z is not None:
            dp = self.policy.local_dp
            self.note("epsilon", epsilon=self.ledger.epsilon(dp.delta), delta=dp.delta,
                      **{"noise-multiplier": dp.noise_multiplier, "clip-norm": dp.clip_norm,
                         "effective-noise-multiplier": z, "max-epsilon": dp.max_epsilon}, **where)
        elif distributed is not None:
            table = self.policy.distributed_dp
            self.note("epsilon", epsilon=self.ledger.epsilon(table.delta), delta=table.delta, mechanism="skellam",
                      **{"honest-hospitals": self.honest_shares, "max-epsilon": table.max_epsilon},
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

    def filter_metrics(self, metrics: dict[str, Any], site, where: dict[str, Any], config: dict[str, Any],
                       method: str) -> None:
        """What the reply's metrics (and its ``device``, in ``config``) may say under ``release-metrics``: the counts
        every protocol needs and those ``method`` declares stay."""
        release = self.policy.metrics_released
        protocol = PROTOCOL_METRICS | privacy_rules(method).protocol_metrics
        dropped = []
        if release != "all" and config.pop("device", None) is not None:
            dropped.append("device")
        for key in list(metrics):
            if key in protocol:
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
        """k: what the method declares rests on fewer than k samples is withheld (FedProIn's influence counts, noised
        first under local DP, and their prototypes; FedProto's class means)."""
        k, dp = self.policy.min_samples, self.policy.local_dp
        sigma = dp.noise_multiplier if dp is not None else None
        withheld = privacy_rules(method.cfg.strategy).withhold_small(method, payload, reply, k, sigma,
                                                                     noise_rng() if sigma is not None else None)
        if withheld:
            self.note("min-samples", k=k, **withheld, **where)

    def apply_local_dp(self, method, payload, reply, where: dict[str, Any]) -> None:
        """The model update clipped to C, N(0, (sigma C)^2) added to each coordinate; the array groups beside it that
        the method makes safe first (FedBN sends the initial normalisation layers in place of its own). Any other
        array group makes the reply refused (fail closed)."""
        dp = self.policy.local_dp
        groups = set(reply.arrays) - {"model"}
        groups -= privacy_rules(method.cfg.strategy).before_local_dp(method, payload, reply)
        if groups:
            raise self.refuse(f"local-dp: the reply carries array groups {sorted(groups)} besides the model, which "
                              "the policy cannot bound", **where)
        noised, norm = clip_and_noise(payload.arrays["model"], reply.arrays["model"], dp.clip_norm,
                                      dp.noise_multiplier, noise_rng())
        reply.arrays["model"] = noised
        self.note("local-dp", **{"clip-norm": dp.clip_norm, "noise-multiplier": dp.noise_multiplier,
                                 "update-norm": norm, "clipped": bool(norm > dp.clip_norm)}, **where)


def enforcer_for(policy_file: str, state_root: str | Path | None, audit_log: Any = None,
                 peers_checked: bool = False) -> Enforcer | None:
    """The hospital's enforcer for the policy in ``policy_file`` (None without one); ``audit_log`` (an AuditLog) is
    told every decision and holds the ledger's entries. A policy whose limits are counted from the ledger needs it.
    ``peers_checked``: the hospital checks its peers' signatures (node config peer-keys), so the policy's ``peers``
    pin them."""
    if not policy_file:
        return None
    policy, digest = read_policy(policy_file)
    if policy.local_dp is not None:
        accountant_module()  # counting its epsilon needs dp-accounting: say so before the first job
    if policy.patient_dp is not None:
        from common.trust.patient_dp import opacus

        opacus()
    if audit_log is None and policy.counts_releases:
        raise ConfigError(f"policy-file {policy_file!r}: local-dp, patient-dp, max-rounds-per-run and "
                          "max-trainings-per-day are counted from the privacy ledger, which the audit log guards; node "
                          "config audit-log='none' cannot be used with them")
    return Enforcer(policy, PrivacyLedger(state_root, audit_log), policy_file, digest,
                    audit_log.append if audit_log is not None else None, peers_checked and bool(policy.peers))


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
