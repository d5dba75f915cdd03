"""The server's side of secure aggregation (SecAgg+ with the malicious-server checks) for our strategies, over any
``flwr.serverapp.Grid``.

A secure round is five exchanges of TRAIN messages whose ConfigRecord carries the stage (``secagg.stage``):

1. setup: the protocol's parameters to the round's hospitals; each answers with two public keys, signed with its
   identity key;
2. share keys: each gets its neighbours' public keys, names and signatures, and answers with its key shares,
   encrypted for each, and the signed SHA-256 of its mask seed;
3. collect masked vectors: each gets the training message as today plus its neighbours' encrypted shares and the
   round's sum layout; it trains with the method's hospital half, bounds its update, and answers with its
   contribution masked (``strategies/<method>/secure.py``: what each method sums) and its metrics in the clear as
   its policy allows;
4. consistency check (with ``hospital-keys``: where signatures are compared): each hospital whose vector is in the
   sum is told the survivor set and signs it;
5. unmask: each is asked, with the others' signatures, for the shares that remove the masks; the server adds the
   masked vectors, removes the masks (also those of hospitals that dropped out after sharing keys), naming any
   hospital whose share does not fit, and turns the sums into the method's next state. The request also carries
   the next round's setup, which each hospital answers with its shares: a next round of the same hospitals and
   parameters opens with stage 2.

Stages 1-2 run inside ``configure_train`` (which has the grid) and return the stage-3 messages, stages 4-5 inside
``aggregate_train`` (through :class:`SecureRoundEngine`), so a round runs the same under our ``start()`` and under
Flower's own loop (a DP wrapper's). The protocol itself is ``common/trust/secure_aggregation/``.
:class:`SecureAggregation` is what ``strategies/base.py`` calls; :class:`SecureAggregationMixin` adds it to any of our
strategies (``with_secure_aggregation(FedAvgStrategy)``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from common.config import ConfigError
from common.engine.round_engine import RoundEngine, RoundReply, describe
from common.engine.round_record import round_record, screened_shares
from common.engine.screening import brief, cut, metrics_problem, sample_count_problem
from common.engine.wire import FLAT_LAYOUT, MalformedPayload, from_recorddict, to_recorddict
from common.methods.base import HospitalInfo, HospitalUpdate, Payload
from common.trust.audit import SERVER_HEAD_KEY, message_digest
from common.trust.secure_aggregation import SecureAggregationSettings, decode_sum, modulus_bits
from common.trust.secure_aggregation.distributed_dp import expand
from common.trust.secure_aggregation.hospital import model_description
from common.trust.secure_aggregation.messages import (
    AHEAD_PREFIX,
    COLLECT,
    CONSISTENCY,
    HOSPITAL_CONFIG_KEY,
    MASKED_ARRAY,
    MASKED_GROUP,
    MODEL_KEY,
    PROTOCOL_KEY,
    SESSION_KEY,
    SETUP,
    SHARE_KEYS,
    STAGE_KEY,
    TRAIN_CONFIG_KEY,
    UNMASK,
    config_in_plan,
)
from common.trust.secure_aggregation.methods import MethodPlan, distributed_dp_method_names, secure_method
from common.trust.secure_aggregation.server import (
    ServerRound,
    Verifier,
    add_masked_vector,
    collect_config,
    consistency_config,
    plan_round,
    receive_key_shares,
    receive_public_keys,
    receive_survivor_signatures,
    settle_survivors,
    setup_config,
    share_keys_config,
    threshold_problem,
    unmask_config,
    unmask_sum,
)
from common.trust.secure_aggregation.vector import unpack_values

log = logging.getLogger("fedmed")


def same_setup(ahead: ServerRound, fresh: ServerRound) -> bool:
    """Whether a round set up ahead is the round ``fresh`` plans: its hospitals, their neighbours, every parameter the
    setup stage sends, and every hospital's keys."""
    return (ahead.run, ahead.rnd, ahead.nodes, ahead.neighbours, ahead.names) == (
        fresh.run, fresh.rnd, fresh.nodes, fresh.neighbours, fresh.names) \
        and setup_config(ahead) | {SESSION_KEY: ""} == setup_config(fresh) | {SESSION_KEY: ""} \
        and ahead.setup_done == set(fresh.nodes)


@dataclass
class SecureRound:
    """One round in progress: its hospitals by node, what it sums, the protocol's state, and what each stage cost."""

    rnd: int
    hospitals: dict[int, HospitalInfo]
    plan: MethodPlan | None = None
    protocol: ServerRound | None = None
    skipped: str | None = None
    norm_bound: float = 0.0
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)  #: hospital -> key-stage bytes each way
    silent: set[int] = field(default_factory=set)  #: nodes that did not answer some key stage in time

    def name(self, node: int) -> str:
        return self.hospitals[node].name


class SecureAggregation:
    """SecAgg+ for one of our strategies (a ``strategies.base.HospitalStrategy``), its round workflow (the interface
    of ``strategies.round_workflow.PlainRounds``): :meth:`prepare` (from ``configure_train``) runs setup and share keys
    and returns the training messages with the collect stage's keys; :meth:`complete` (the round engine's
    ``complete_round``) takes the masked replies, runs the unmask stage and records the round."""

    masks_own_training = True  #: a ClientApp that trains itself gets the stage messages; its mod masks its reply
    stores_replies = False  #: masked vectors are summed as they come, never kept

    def __init__(self, strategy: Strategy, settings: SecureAggregationSettings):
        self.strategy = strategy
        self.settings = settings
        try:
            self.method = secure_method(strategy.job.strategy, strategy.job)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if settings.distributed_dp != "off" and not self.method.distributed_dp:
            raise ConfigError(f"secure-aggregation.distributed-dp with strategy {strategy.job.strategy!r}: its sum is "
                              "more than a model update (counts, codes, per-filter parts), which the noise does not "
                              f"cover; it runs with {', '.join(distributed_dp_method_names())}")
        self.rounds: dict[int, SecureRound] = {}
        self._warned_weight = False  # hospital_without_count: once per run
        self.grid: Grid | None = None
        self.ahead: ServerRound | None = None  #: the next round's setup, answered with this round's unmask stage

    @classmethod
    def of(cls, strategy: Strategy) -> "SecureAggregation | None":
        """The strategy's secure aggregation when its job enables it (``[secure-aggregation]``), else None."""
        settings = getattr(strategy.job, "secure_aggregation", None)
        if settings is None or not settings.enabled:
            return None
        return cls(strategy, settings)

    def round_engine(self) -> "SecureRoundEngine":
        """The strategy's round engine, with rounds completed by :meth:`complete`."""
        return SecureRoundEngine(self.strategy.job, weight_key=self.strategy.weighted_by_key, secure=self)

    def unsigned_problem(self, what: str) -> str | None:
        return (f"{what}, but secure aggregation masks every reply at the hospital: make its ClientApp a "
                "HospitalClientApp (from client_app.hospital_mod), whose mod masks what its own train handler "
                "returns, as Flower's secaggplus_mod does (docs/own-clientapp.md)")

    def hospital_without_count(self, name: str) -> None:
        if self._warned_weight:
            return
        self._warned_weight = True
        log.warning("%s trains the model itself and declares no sample count: under secure aggregation its weight "
                    "counts at most screening.max-samples=%d samples, and each hospital's weight is its samples over "
                    "the largest declared count (as Flower's SecAggPlusWorkflow's max_weight): set "
                    "screening.max-samples near your hospitals' size, or the masked sum's quantisation swamps the "
                    "update", name, self.strategy.job.screening.max_samples)

    def central_dp_problem(self) -> str | None:
        return ("with secure aggregation (secure-aggregation.enabled): hospitals send masked sums, never the update "
                "of one hospital that the wrapper clips (and that Flower's clipping mod would clip after masking). "
                "Nothing was sent to the hospitals. For DP with secure aggregation use each hospital's own local DP "
                "(its policy's local-dp, docs/privacy.md)")

    def who_trains_note(self) -> str:
        return (": under secure aggregation a HospitalClientApp's mod masks what the app's own train handler returns, "
                "as Flower's secaggplus_mod does")

    # --- configure_train: setup, share keys, the training messages ---------------------------------------------
    def prepare(self, server_round: int, messages: Iterable[Message], grid: Grid,
                sent: list[tuple] | None = None) -> list[Message]:
        """Run the setup and share-keys stages with the hospitals ``messages`` go to, and return those messages (to
        the hospitals that shared their keys) with the collect stage's keys, logged as they leave then (``sent``, the
        lines of the messages as built, are not written); none when the round cannot run."""
        messages = list(messages)
        strategy = self.strategy
        if any(STAGE_KEY in message.content.config_records.get(strategy.records.config, {}) for message in messages) \
                or (not messages and server_round in self.rounds):
            return messages  # prepared already (asked twice for one round; a skipped round returned none)
        self.grid = grid
        progress = SecureRound(server_round, {m.metadata.dst_node_id: strategy.hospitals[m.metadata.dst_node_id]
                                              for m in messages})
        progress.traffic = {h.name: {"down": 0, "up": 0} for h in progress.hospitals.values()}
        self.rounds = {server_round: progress}
        if not messages:
            return messages
        chosen = sorted(progress.hospitals.values(), key=lambda h: h.name)
        try:
            progress.norm_bound = self.norm_bound()
            plan = progress.plan = self.method.plan(strategy.engine.method, chosen, self.settings, progress.norm_bound)
            protocol = progress.protocol = plan_round(
                list(progress.hospitals), self.settings, [strategy.job.seed, server_round], plan.layout.size,
                plan.modulus, plan.quantization_range, {n: h.name for n, h in progress.hospitals.items()},
                strategy.job.run_name, server_round)
            protocol.plan_text = self.closed_plan(plan, protocol, messages)  # one plan, the same for every hospital
            largest = plan.layout.largest(plan.quantization_range)
            if len(chosen) * largest >= plan.modulus:
                raise ValueError(f"{len(chosen)} hospitals x {largest} (the largest value one adds) does not stay "
                                 f"below the modulus {plan.modulus}: raise modulus-range or lower quantization-range")
        except ValueError as error:
            return self.skip(progress, str(error))

        ahead, self.ahead = self.ahead, None
        if ahead is not None and same_setup(ahead, protocol):  # set up already, with the last round's key stages
            if ahead.keyed:  # its keys shared too, with the last round's unmask stage: it is this round's protocol
                ahead.plan_text = protocol.plan_text
                protocol = progress.protocol = ahead
            else:
                protocol.session, protocol.public_keys = ahead.session, ahead.public_keys
                protocol.key_signatures, protocol.setup_done = ahead.key_signatures, set(ahead.setup_done)
        else:
            answers = self.exchange(progress, SETUP, {node: setup_config(protocol) for node in protocol.nodes})
            receive_public_keys(protocol, answers, self.verifier())
        problem = few_problem(protocol, protocol.setup_done) \
            or threshold_problem(protocol, protocol.setup_done, protocol.setup_done)
        if problem:
            return self.skip(progress, f"after the setup stage, {problem}")
        if not protocol.keyed:
            answers = self.exchange(progress, SHARE_KEYS, {node: share_keys_config(protocol, node)
                                                                 for node in sorted(protocol.setup_done)})
            receive_key_shares(protocol, answers, self.verifier())
        problem = few_problem(protocol, protocol.keyed) or threshold_problem(protocol, protocol.keyed, protocol.keyed)
        if problem:
            return self.skip(progress, f"after the share-keys stage, {problem}")

        prepared, lines = [], []
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in protocol.keyed:
                continue
            name = progress.name(node)
            config: ConfigRecord = message.content.config_records[strategy.records.config]
            for key, value in {STAGE_KEY: COLLECT, **collect_config(protocol, node)}.items():
                config[key] = value
            digest = message_digest(message)  # the training message as it leaves, logged as the hospital logs it
            strategy._bytes_down[name] = digest["bytes"]
            lines.append(("sent", message, server_round, name, node, False, digest))
            prepared.append(message)
        audit = getattr(strategy, "audit_messages", None)
        if audit is not None:
            audit(lines)
        return prepared

    def closed_plan(self, plan: MethodPlan, protocol: ServerRound, messages: list[Message]) -> str:
        """The round plan every hospital gets alike and signs: what the method sums, the protocol's parameters (the
        setup stage's), the training config and the model to train from, so that nothing a hospital adds depends on
        a value told to it alone (docs/secure-aggregation.md, "The round plan"). ValueError when the training
        messages differ between hospitals: a secure round trains every hospital from one config and one model."""
        records, configs, models, parsed = self.strategy.records, {}, {}, {}
        for message in messages:
            name = self.strategy.hospitals[message.metadata.dst_node_id].name
            configs[name] = {k: v for k, v in message.content.config_records[records.config].items()
                             if k != SERVER_HEAD_KEY and not k.startswith(FLAT_LAYOUT)}  # the audit head as it
            # stood, each message its own, and how its arrays are packed (the plan's model pins what they hold)
            arrays = tuple(id(record) for record in message.content.array_records.values())
            if arrays not in parsed:  # one model record shared by every message is read once
                parsed[arrays] = model_description(from_recorddict(message.content).arrays)
            models[name] = parsed[arrays]
        first = next(iter(configs.values()), {})
        missing = object()
        own = {k for config in configs.values() for k in set(config) | set(first)
               if config.get(k, missing) != first.get(k, missing)}  # keys whose value differs between hospitals
        differ = sorted(own - self.method.own_config)
        if differ:
            raise ValueError(f"the training messages differ between hospitals in {', '.join(differ[:5])}: a secure "
                             "round trains every hospital from one config (the plan's), but for what its method "
                             f"sets per hospital ({', '.join(sorted(self.method.own_config)) or 'nothing'})")
        described = {model["sha256"]: model for model in models.values()}  # one entry per model (FedMEPD's differ)
        return plan.text({PROTOCOL_KEY: protocol.protocol_plan(),
                          MODEL_KEY: {"models": described, "hospitals": {n: m["sha256"] for n, m in models.items()}},
                          TRAIN_CONFIG_KEY: config_in_plan({k: v for k, v in first.items() if k not in own}),
                          HOSPITAL_CONFIG_KEY: {name: config_in_plan({k: v for k, v in config.items() if k in own})
                                                for name, config in configs.items()} if own else {}})

    def plan_ahead(self, progress: SecureRound) -> ServerRound | None:
        """The next round's protocol parameters for this round's hospitals, set up with this round's unmask stage
        (used if the next round has the same hospitals and parameters; none after the run's last round)."""
        job, protocol = self.strategy.job, progress.protocol
        if protocol is None or progress.plan is None or progress.rnd >= job.num_server_rounds:
            return None
        try:
            return plan_round(list(progress.hospitals), self.settings, [job.seed, progress.rnd + 1], protocol.size,
                              protocol.modulus, protocol.quantization_range, dict(protocol.names), job.run_name,
                              progress.rnd + 1)
        except ValueError:
            return None

    def setup_ahead_config(self, ahead: ServerRound | None) -> dict[str, Any]:
        """What the hospitals need to answer ``ahead``'s setup stage now (``secagg.ahead.*``): its parameters, run and
        round."""
        if ahead is None:
            return {}
        return {AHEAD_PREFIX + key: value for key, value in
                {**setup_config(ahead), "run-name": ahead.run, "server-round": ahead.rnd}.items()}

    def share_keys_ahead_config(self, ahead: ServerRound | None, node: int) -> dict[str, Any]:
        """What ``node`` needs to answer ``ahead``'s share-keys stage now (``secagg.ahead.*``), once its setup was
        answered: its neighbours' signed keys, run and round; none for a node that did not set it up."""
        if ahead is None or node not in ahead.setup_done:
            return {}
        return {AHEAD_PREFIX + key: value for key, value in
                {**share_keys_config(ahead, node), "run-name": ahead.run, "server-round": ahead.rnd}.items()}

    @staticmethod
    def ahead_answers(answers: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
        """The ``secagg.ahead.*`` part of each reply, unprefixed."""
        return {node: {k[len(AHEAD_PREFIX):]: v for k, v in answer.items() if k.startswith(AHEAD_PREFIX)}
                for node, answer in answers.items()}

    def verifier(self) -> Verifier | None:
        """Checks a hospital's signature with its registered key (run config ``hospital-keys``), so that a hospital
        whose keys are not signed is set aside at once, named; None without registered keys."""
        folder = self.strategy.job.hospital_keys
        if not folder:
            return None
        from common.trust.identity import statement_problem

        return lambda name, statement, signature: statement_problem(folder, name, statement, signature)

    def norm_bound(self) -> float:
        """The L2 bound hospitals clip their update to this round: ``update-norm-bound``, else ``update-norm-factor``
        x the last aggregated update's norm (none before the first)."""
        if self.settings.update_norm_bound > 0:
            return self.settings.update_norm_bound
        for record in reversed(self.strategy.engine.history):
            norm = record.get("secure-aggregation", {}).get("mean-update-norm")
            if norm:
                return self.settings.update_norm_factor * float(norm)
        return 0.0

    def skip(self, progress: SecureRound, reason: str) -> list[Message]:
        progress.skipped = f"secure aggregation cannot go on: {reason}; the global model is unchanged"
        log.warning("round %d: %s", progress.rnd, progress.skipped)
        return []

    def exchange(self, progress: SecureRound, stage: str, configs: Mapping[int, dict[str, Any]]) -> dict[int, dict]:
        """One key stage: a TRAIN message to each node with its config, and the config of each reply (nodes that
        failed, answered out of turn or not at all are recorded in the protocol's ``lost``)."""
        from strategies.grid_messages import messages_in_flight, send_and_receive

        strategy, job, protocol = self.strategy, self.strategy.job, progress.protocol
        base = {**strategy.records.as_config(), "server-round": progress.rnd, "run-name": job.run_name,
                "strategy": job.strategy, STAGE_KEY: stage}
        audit = getattr(strategy, "audit_messages", None)  # a stage's lines at once: one lock, one fsync
        started, down, up = time.time(), 0, 0
        messages, lines = [], []
        for node, config in configs.items():
            content = to_recorddict(Payload(config={**base, **config}), keys=strategy.records)
            message = Message(content, message_type=MessageType.TRAIN, dst_node_id=node, group_id=str(progress.rnd))
            digest = message_digest(message)  # measured once: the traffic record and the audit line share it
            progress.traffic[progress.name(node)]["down"] += digest["bytes"]
            down += digest["bytes"]
            lines.append(("sent", message, progress.rnd, progress.name(node), node, False, digest))
            messages.append(message)
        if audit is not None:
            audit(lines)
        timeout = self.settings.stage_timeout or job.round_timeout
        replies = send_and_receive(self.grid, messages, timeout, messages_in_flight(job, self.grid, queries=True))
        answers: dict[int, dict] = {}
        lines, kept = [], {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if node not in configs or node in kept:
                continue
            digest = message_digest(reply)
            kept[node] = reply, digest["bytes"]
            lines.append(("received", reply, progress.rnd, progress.name(node), None, False, digest))
        if audit is not None:
            audit(lines)
        for node, (reply, size) in kept.items():
            name = progress.name(node)
            if reply.has_error():
                protocol.lost.setdefault(node, f"{stage}: {cut(reply.error.reason)}")
                continue
            progress.traffic[name]["up"] += size
            up += size
            try:
                payload = from_recorddict(reply.content, 1_000_000 + 16_384 * len(configs), strategy.records)
            except MalformedPayload as error:
                protocol.lost.setdefault(node, f"{stage}: malformed reply: {error}")
                continue
            if payload.config.get(STAGE_KEY) != stage:
                other = brief(payload.config.get(STAGE_KEY))
                protocol.lost.setdefault(node, f"{stage}: its reply is for stage {other}")
                continue
            answers[node] = payload.config
        for node in configs:
            if node not in answers:
                if node not in kept:
                    progress.silent.add(node)
                protocol.lost.setdefault(node, f"{stage}: no reply within {timeout:.0f} s")
                log.warning("round %d: secure aggregation lost %s at the %s stage: %s", progress.rnd,
                            progress.name(node), stage, protocol.lost[node])
        progress.stages[stage] = {"seconds": round(time.time() - started, 3), "bytes-down": down, "bytes-up": up}
        return answers

    # --- aggregate_train: the masked vectors, unmask, the method's next state ----------------------------------
    def complete(self, engine: RoundEngine, rnd: int, chosen: list[HospitalInfo], replies: list[RoundReply],
                 started: float, bytes_down: Mapping[str, int] | None = None, evaluate: bool = True) -> dict[str, Any]:
        """Round ``rnd`` from its masked replies, recorded as ``RoundEngine.complete_round`` records a round: what
        each hospital's reply says in the clear is screened (a refused one counts as dropped: its masks are removed,
        its vector never unmasked), the masked vectors are summed, the unmask stage removes the masks, and the
        method turns the sums into its next state; below the threshold the round is skipped with its reason."""
        progress = self.rounds.get(rnd)
        if progress is None:
            raise RuntimeError(f"round {rnd} did not run the secure-aggregation key stages (configure_train)")
        protocol, plan = progress.protocol, progress.plan
        node_of = {h.name: node for node, h in progress.hospitals.items()}
        refused: dict[str, str] = {}
        accepted: list[RoundReply] = []
        stage_started = time.time()
        for reply in sorted(replies, key=lambda r: r.hospital.name):
            name = reply.hospital.name
            node = node_of.get(name)
            if reply.payload is None:
                refused[name] = f"hospital reported an error: {cut(str(reply.error))}"
            elif protocol is not None and node is not None:
                reason, vector = self.screen(engine, reply, rnd, protocol)
                if reason is None:
                    try:
                        add_masked_vector(protocol, node, vector)
                        accepted.append(reply)
                        continue
                    except ValueError as error:
                        reason = str(error)
                refused[name] = cut(reason)
            if protocol is not None and node is not None:
                protocol.lost.setdefault(node, f"{COLLECT}: {refused.get(name, 'refused')}")
        for name, reason in refused.items():
            log.warning("round %d: refused the update of %s: %s", rnd, name, reason)
        progress.stages[COLLECT] = {"seconds": round(time.time() - stage_started, 3),
                                    "bytes-up": int(sum(r.bytes_up for r in accepted))}
        answered = {r.hospital.name for r in replies}
        missing = [h.name for h in chosen if h.name not in answered]
        if missing:
            log.warning("round %d: no reply from %s before the timeout", rnd, ", ".join(missing))
        for name in missing:
            if protocol is not None and node_of.get(name) in protocol.keyed:
                protocol.lost.setdefault(node_of[name], f"{COLLECT}: no reply before the round's timeout")

        method, method_record, mean_norm = engine.method, None, None
        clear = [HospitalUpdate(r.hospital, Payload(config=r.payload.config, metrics=r.payload.metrics),
                                weight_key=engine.weight_key) for r in accepted]  # what they said openly
        skipped = progress.skipped
        needed = max(2, engine.cfg.min_train_hospitals, protocol.threshold if protocol else 2)
        if skipped is None and len(accepted) < needed:
            skipped = (f"{len(accepted)} masked update(s), fewer than {needed} (at least 2, min-train-hospitals, the "
                       "reconstruction threshold): a sum of fewer would not hide a hospital; the global model is "
                       "unchanged")
        if skipped is None:
            problem = threshold_problem(protocol, protocol.masked, protocol.masked | protocol.dropped) \
                or self.method.sum_problem(plan, [r.hospital for r in accepted])
            if problem:
                skipped = f"before the unmask stage, {problem}; the global model is unchanged"
        if skipped is None:
            # the next round's key stages ride on this round's last two: its setup on the consistency stage and its
            # key shares on the unmask stage (without a consistency stage, its setup on the unmask stage)
            verifier, ahead = self.verifier(), self.plan_ahead(progress)
            if verifier is not None:  # signatures to collect and check (hospitals with peer keys require them)
                asked = self.setup_ahead_config(ahead)
                answers = self.exchange(progress, CONSISTENCY, {node: {**consistency_config(protocol, node), **asked}
                                                                for node in sorted(protocol.masked)})
                receive_survivor_signatures(protocol, answers, verifier)
                if ahead is not None:
                    receive_public_keys(ahead, self.ahead_answers(answers), verifier)
                    if few_problem(ahead, ahead.setup_done) or threshold_problem(ahead, ahead.setup_done,
                                                                                 ahead.setup_done):
                        ahead = None  # the next round sets itself up
                asking = {node: self.share_keys_ahead_config(ahead, node) for node in protocol.masked}
            else:  # nobody compares signatures: the hospitals check the set at the unmask stage
                settle_survivors(protocol)
                asking = {node: self.setup_ahead_config(ahead) for node in protocol.masked}
            answers = self.exchange(progress, UNMASK, {node: {**unmask_config(protocol, node), **asking[node]}
                                                       for node in sorted(protocol.masked)})
            if ahead is not None:
                if verifier is not None:
                    receive_key_shares(ahead, self.ahead_answers(answers), verifier)
                else:
                    receive_public_keys(ahead, self.ahead_answers(answers), verifier)
                self.ahead = ahead
            computing, before = time.perf_counter(), None
            try:
                total = unmask_sum(protocol, answers)
                sums = expand(decode_sum(plan.layout, total, len(protocol.masked), protocol.clipping_range,
                                         protocol.quantization_range), plan.common)  # distributed DP's noised part
                before = {k: v.copy() for k, v in method.global_arrays.items()}
                method_record = self.method.apply(method, rnd, sums, plan, clear)
                mean_norm = distance(method.global_arrays, before)
                progress.stages[UNMASK]["sum-seconds"] = round(time.perf_counter() - computing, 3)
            except ValueError as error:
                method.global_arrays = before if before is not None else method.global_arrays
                skipped = f"the unmasked sums cannot be used: {error}; the global model is unchanged"
            else:
                method_record.update(method.server_step(rnd))
        if skipped is not None:  # a hospital that fell silent after its update came in cost the round: missing too
            silent = {progress.name(node) for node in progress.silent}
            missing += [h.name for h in chosen if h.name in silent and h.name not in missing]
        for node, why in sorted(protocol.hostile.items()) if protocol is not None else ():
            log.warning("round %d: %s sent a share that does not fit: %s", rnd, progress.name(node), why)
        bytes_down = bytes_down or {}
        bytes_up = {r.hospital.name: r.bytes_up for r in replies}
        keys = {h.name: progress.traffic.get(h.name, {}) for h in chosen}  # the key stages' bytes
        traffic = {h.name: {"down": int(bytes_down.get(h.name, 0)) + keys[h.name].get("down", 0),
                            "up": int(bytes_up.get(h.name, 0)) + keys[h.name].get("up", 0)} for h in chosen}
        screened_shares(clear, engine.cfg.screening)  # the train metrics weighed as a plain round's: screened shares
        record = round_record(rnd, chosen, clear, started=started, traffic=traffic, missing=missing, refused=refused,
                              method=method_record, skipped=skipped,
                              **{"secure-aggregation": self.summary(progress, mean_norm)})
        engine.history.append(record)
        self.rounds.pop(rnd, None)
        if evaluate:
            engine.evaluate_round(record)
        else:
            log.debug("round %d: %s", rnd, describe(record))
        return record

    def screen(self, engine: RoundEngine, reply: RoundReply, rnd: int,
               protocol: ServerRound) -> tuple[str | None, np.ndarray | None]:
        """What the server can still check of a masked reply: its metrics (numbers only: no list leaves a hospital
        in the clear), its round, its sample count against what the hospital declared, and that it holds one
        masked vector of the round's size and nothing else."""
        payload, hospital = reply.payload, reply.hospital
        metrics = payload.metrics
        reason = metrics_problem(metrics)
        if reason is None and metrics.get("server-round") != rnd:
            reason = (f"the reply is for round {brief(metrics.get('server-round'))}, not this round {rnd} (a reply "
                      "replayed from another round, or one that does not say its round)")
        if reason is None:
            reason = sample_count_problem(metrics.get(engine.weight_key), hospital.num_examples, engine.weight_key)
        if reason is None and payload.config.get(STAGE_KEY) != COLLECT:
            reason = "the reply is not a masked update (no collect stage in its config)"
        if reason is None and (set(payload.arrays) != {MASKED_GROUP}
                               or set(payload.arrays[MASKED_GROUP]) != {MASKED_ARRAY}):
            reason = (f"the reply carries arrays {sorted(payload.arrays)} besides the one masked vector "
                      f"{MASKED_GROUP!r}: under secure aggregation no array leaves a hospital in the clear")
        if reason is not None:
            return reason, None
        try:
            return None, unpack_values(payload.arrays[MASKED_GROUP][MASKED_ARRAY], modulus_bits(protocol.modulus),
                                       protocol.size)
        except ValueError as error:
            return f"malformed masked vector: {error}", None

    def summary(self, progress: SecureRound, mean_norm: float | None) -> dict[str, Any]:
        """What the round record keeps of the protocol: its parameters, who was lost at which stage, each stage's
        seconds and bytes, the norm bound hospitals applied and the aggregated update's norm."""
        protocol, plan = progress.protocol, progress.plan
        summary: dict[str, Any] = {"stages": progress.stages, "norm-bound": progress.norm_bound}
        if protocol is not None:
            summary.update({"shares": protocol.num_shares, "threshold": protocol.threshold,
                            "modulus-bits": modulus_bits(protocol.modulus), "values": protocol.size,
                            "hospitals-in-sum": len(protocol.masked), "session": protocol.session,
                            "lost": {progress.name(node): why for node, why in sorted(protocol.lost.items())},
                            "hostile-shares": {progress.name(node): why
                                               for node, why in sorted(protocol.hostile.items())}})
        if plan is not None:
            summary["quantization-range"] = plan.quantization_range
        if mean_norm is not None:
            summary["mean-update-norm"] = float(mean_norm)
        return summary


def few_problem(protocol: ServerRound, alive: set[int]) -> str | None:
    """Why so few hospitals are left that the round cannot go on (None: enough are)."""
    needed = max(2, protocol.threshold)
    if len(alive) < needed:
        return f"{len(alive)} hospital(s) are left, fewer than {needed} (at least 2 and the reconstruction threshold)"
    return None


def distance(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
    """L2 distance over the float arrays both hold (without BLAS, whose threads spin on a busy machine)."""
    total = 0.0
    for name, value in arrays.items():
        if name in reference and value.dtype.kind == "f" and value.shape == reference[name].shape:
            difference = (value.astype(np.float64) - reference[name]).ravel()
            total += float(np.einsum("i,i->", difference, difference))
    return total ** 0.5


class SecureRoundEngine(RoundEngine):
    """A RoundEngine whose rounds are completed by secure aggregation (:meth:`SecureAggregation.complete`)."""

    def __init__(self, cfg, method=None, test_data=None, weight_key: str = "num-examples",
                 secure: SecureAggregation | None = None):
        super().__init__(cfg, method, test_data, weight_key)
        self.secure = secure

    def complete_round(self, rnd: int, chosen: list[HospitalInfo], replies: list[RoundReply], started: float,
                       bytes_down: dict[str, int] | None = None, evaluate: bool = True) -> dict[str, Any]:
        if self.secure is None:
            return super().complete_round(rnd, chosen, replies, started, bytes_down, evaluate)
        return self.secure.complete(self, rnd, chosen, replies, started, bytes_down, evaluate)


class SecureAggregationMixin:
    """Secure aggregation for one of our strategies: ``class SecureFedAvg(SecureAggregationMixin, FedAvgStrategy)``,
    or :func:`with_secure_aggregation`. ``secure_aggregation`` (keyword): its settings (a
    :class:`SecureAggregationSettings` or its fields by run-config name); default: the run config's
    ``[secure-aggregation]`` table where it has one, switched on."""

    def __init__(self, *args: Any, secure_aggregation: SecureAggregationSettings | Mapping[str, Any] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        if isinstance(secure_aggregation, SecureAggregationSettings):
            settings = secure_aggregation
        else:
            table = getattr(self.job, "secure_aggregation", None)
            base = table.model_dump(by_alias=True) if table is not None else {}
            given = {key.replace("_", "-"): value for key, value in dict(secure_aggregation or {}).items()}
            settings = SecureAggregationSettings.model_validate({**base, "enabled": True, **given})
        self.workflow = SecureAggregation(self, settings)  # the strategy's rounds, chosen once


def with_secure_aggregation(strategy_type: type) -> type:
    """``strategy_type`` (one of our strategies) with secure aggregation: ``with_secure_aggregation(FedAvgStrategy)(
    run_config=..., secure_aggregation={"reconstruction-threshold": 2})``."""
    return type(f"Secure{strategy_type.__name__}", (SecureAggregationMixin, strategy_type), {})
