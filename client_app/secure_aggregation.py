"""A hospital's side of secure aggregation over Flower messages: the answer to each stage's TRAIN message.

``secure_train(message, context, train)`` answers a training message: one without a stage goes to ``train`` as
today (refused when the hospital's policy says ``require-secure-aggregation``); the key stages (setup, share keys,
consistency check, unmask) are answered by the protocol (``common/trust/secure_aggregation/hospital.py``) under the
hospital's own rules (its node config's name, ``identity-key`` and ``peer-keys``, its policy's minimums, its replay
memory in its state folder), its secrets kept between stages in the ClientApp's ``context.state`` as Flower's
``secaggplus_mod`` keeps them. In the collect stage it trains with ``train`` (the method's hospital half, as today)
unless it already helped unmask a sum trained from the same model, and replaces its reply's arrays by its
contribution, bounded, quantised and masked: its metrics leave in the clear only as its policy's
``release-metrics`` allows. ``secure_aggregation_mod`` is the same as a Flower mod, for a ClientApp of a
consortium's own::

    app = ClientApp(mods=[secure_aggregation_mod])

Imports neither torch nor the methods (QFedPolyp's codes are read with its codec, which does).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType

from common.engine.wire import RecordKeys, from_recorddict, to_recorddict
from common.payload import Payload
from common.trust.secure_aggregation import Layout, encode, modulus_bits, pack_values
from common.trust.secure_aggregation import distributed_dp as ddp
from common.trust.secure_aggregation.hospital import (
    HospitalRound,
    HospitalRules,
    ReplayMemory,
    SecureAggregationRefusal,
    canonical_model,
    check_turn,
    dtype_problem,
    finished,
    hospital_stage,
    model_digest,
    own_model,
    protocol_problem,
    round_plan,
)
from common.trust.secure_aggregation.messages import (
    COLLECT,
    HOSPITAL_CONFIG_KEY,
    LAYOUT_KEY,
    MASKED_ARRAY,
    MASKED_GROUP,
    OWN_NAME_KEY,
    OWN_WEIGHT_CAP_KEY,
    PLAN_KEY,
    SETUP,
    STAGE_KEY,
    STAGES,
    TRAIN_CONFIG_KEY,
    config_from_plan,
)
from common.trust.secure_aggregation.methods import secure_method
from common.trust.secure_aggregation.settings import MIN_THRESHOLD_FRACTION

STATE_RECORD = "fedmed.secagg"  #: context.state: the hospital's part in the protocol run (``HospitalRound``)
STATE_KEY = "state"
ALWAYS_CLEAR = frozenset({"num-examples", "server-round"})  #: reply metrics the server needs whatever the policy

TrainHandler = Callable[[Message], Message]


def stage_of(message: Message) -> str | None:
    """The secure-aggregation stage a TRAIN message belongs to (None: an ordinary training message)."""
    if message.has_error() or message.metadata.message_type.split(".")[0] != MessageType.TRAIN:
        return None
    for record in message.content.config_records.values():
        stage = record.get(STAGE_KEY)
        if stage is not None:
            if stage not in STAGES:
                raise ValueError(f"unknown secure-aggregation stage {stage!r}")
            return str(stage)
    return None


def hospital_policy(context: Context):
    """The hospital's policy (node config ``policy-file``, read afresh for every message); None without one."""
    from common.trust.policy import read_policy

    path = context.node_config.get("policy-file")
    return read_policy(str(path))[0] if path else None


def hospital_rules(context: Context):
    """This hospital's rules (node config and policy, read afresh for every message) and its policy (None: none).
    Its replay memory is mirrored in its audit log; a deployed hospital whose policy requires secure aggregation
    takes part only with the consortium's keys (``peer-keys``), so it counts only registered hospitals."""
    from common.trust.audit import AuditLog

    from .node_config import load_node_config

    node = load_node_config(context.node_config)
    policy = hospital_policy(context)
    run_state = str(context.run_config.get("state-dir") or "state")
    audit_path = node.audit_path(run_state)
    audit = AuditLog(audit_path, f"hospital:{node.name}") if audit_path is not None else None
    unusable = ""
    if policy is not None and policy.require_secure_aggregation and not node.virtual and not (
            node.peer_keys and policy.peers):
        unusable = ("require-secure-aggregation in a deployment needs the consortium's keys pinned: node config "
                    "peer-keys and identity-key, and the policy's peers (each hospital's key fingerprint, compared "
                    "with its officers): without them the server could invent the other hospitals of a sum")
    rules = HospitalRules(node.name, node.identity_key, node.peer_keys,
                          policy.min_threshold_fraction if policy else MIN_THRESHOLD_FRACTION,
                          policy.min_hospitals_per_sum if policy else 2,
                          ReplayMemory(node.state_root(run_state), audit),
                          policy.min_update_norm_bound if policy else 0.0, unusable,
                          pinned_peers(node, policy))
    return rules, policy


def pinned_peers(node, policy) -> dict[str, str] | None:
    """The keys the hospital accepts, by name (its policy's ``peers``, and its own key's fingerprint, from its
    identity key); None where its policy pins none (every key in its peer-keys folder is then accepted)."""
    if policy is None or not policy.peers:
        return None
    from common.trust.identity import own_fingerprint

    own = {node.name: own_fingerprint(node.identity_key)} if node.identity_key else {}
    return {**policy.peers, **own}


#: the state this process last stored for each context (id of its stored bytes -> those bytes, the state): the next
#: stage reads it back without parsing it again, while the context still holds those very bytes
_STORED: dict[int, tuple[bytes, HospitalRound]] = {}
_STORED_KEPT = 256


def load_state(context: Context) -> HospitalRound:
    record = context.state.config_records.get(STATE_RECORD)
    data = record.get(STATE_KEY) if record is not None else None
    stored = _STORED.pop(id(data), None)  # taken: the stage that reads it changes it, then stores it again
    if stored is not None and stored[0] is data:
        return stored[1]
    return HospitalRound.from_bytes(data)


def save_state(context: Context, state: HospitalRound) -> None:
    data = state.to_bytes()
    context.state[STATE_RECORD] = ConfigRecord({STATE_KEY: data})
    while len(_STORED) >= _STORED_KEPT:
        del _STORED[next(iter(_STORED))]
    _STORED[id(data)] = (data, state)


def secure_train(message: Message, context: Context, train: TrainHandler, required: bool = False,
                 train_payload: Callable[[Payload], Payload] | None = None) -> Message:
    """The reply to a TRAIN message: ``train(message)`` for an ordinary one (refused when ``required`` or when the
    hospital's policy requires secure aggregation), the stage's answer for a secure-aggregation one. A refused or
    failed stage past setup ends this hospital's part in the protocol run: no secret of it is kept.
    ``train_payload``: the same training on a parsed payload (fedmed's ClientApp), which spares the collect stage
    a reply built as a message only to be read back and masked."""
    stage = stage_of(message)
    if stage is None:
        if message.metadata.message_type.split(".")[0] == MessageType.TRAIN:
            policy = hospital_policy(context)
            if required or (policy is not None and policy.require_secure_aggregation):
                from pathlib import Path

                from common.trust.policy import PolicyRefusal

                source = Path(str(context.node_config.get("policy-file") or "its ClientApp")).name
                raise PolicyRefusal(f"refused by its policy ({source}): require-secure-aggregation: this hospital "
                                    "sends its updates only masked, and the server asked for an unmasked one")
        return train(message)
    keys = RecordKeys.of(message.content)
    config = dict(message.content.config_records[keys.config])
    rules, policy = hospital_rules(context)
    state = load_state(context)
    try:
        if stage == COLLECT:
            return masked_reply(message, train, context, state, rules, policy, config, keys, train_payload)
        state, answer = hospital_stage(state, stage, config, message.metadata.dst_node_id, rules)
    except Exception:
        if stage != SETUP:
            save_state(context, finished())
        raise
    save_state(context, state)
    return Message(to_recorddict(Payload(config={STAGE_KEY: stage, **answer}), keys=keys), reply_to=message)


def masked_reply(message: Message, train: TrainHandler, context: Context, state: HospitalRound, rules: HospitalRules,
                 policy, config: dict[str, Any], keys: RecordKeys,
                 train_payload: Callable[[Payload], Payload] | None = None) -> Message:
    """Train from the round plan's config and model, and nothing else of the message (unless it revealed shares for
    a sum trained from this model before), then the training reply with its arrays replaced by the hospital's
    masked contribution (what its method sums, its update bounded to the round's norm bound); what the method
    keeps at the hospital, and what its policy withholds, are left out."""
    check_turn(state, COLLECT, config)
    plan_digest, plan = round_plan(config, rules)  # the same for every hospital, within its bounds, before training
    problem = protocol_problem(state.flower, plan) or train_config_problem(state, plan)  # (masking checks it
    if problem:  # again; here nothing trains first)
        raise SecureAggregationRefusal(f"the round plan: {problem}")
    arrays, digest = canonical_model(from_recorddict(message.content).arrays, own_model(plan, rules.name))
    rules.memory.check_model(digest)
    rows = plan.get(HOSPITAL_CONFIG_KEY) or {}
    row = rows.get(rules.name, {}) if isinstance(rows, dict) else None  # its own values of its method's keys
    method = secure_method(str(plan[TRAIN_CONFIG_KEY]["strategy"]))
    if not isinstance(row, dict) or not set(row) <= method.own_config:
        raise SecureAggregationRefusal(f"the round plan sets {sorted(row or ['?'])[:5]} for this hospital alone; its "
                                       f"method sets only {sorted(method.own_config)} per hospital")
    received = Payload(arrays, {**config_from_plan({**plan[TRAIN_CONFIG_KEY], **row}), PLAN_KEY: config[PLAN_KEY]})
    if train_payload is not None:  # on its own copy: what it received stays as received, to take the update from
        trained = train_payload(Payload({group: {name: np.array(value, copy=True) for name, value in arrays.items()}
                                         for group, arrays in received.arrays.items()}, dict(received.config)))
        started = time.perf_counter()
    else:
        message.content = to_recorddict(received, "per-tensor", keys)  # a ClientApp of its own reads the plan's too
        reply = train(message)
        if reply.has_error():
            save_state(context, finished())
            return reply
        started = time.perf_counter()
        trained = from_recorddict(reply.content)
    problem = dtype_problem(own_model(plan, rules.name), trained.arrays)
    if problem:
        raise SecureAggregationRefusal(f"the round plan: {problem}")
    personal = method.personal(trained)  # received arrays its method keeps its own of: the replay memory keys on
    if any(personal.values()):  # the rest, what it trained from (the same with other values for those)
        inputs = {group: {name: value for name, value in named.items() if name not in set(personal.get(group, ()))}
                  for group, named in arrays.items()}
        digest = model_digest(inputs)
        rules.memory.check_model(digest)
    layout = Layout.from_json(plan.get(LAYOUT_KEY))
    own = {OWN_NAME_KEY: rules.name, OWN_WEIGHT_CAP_KEY: policy.max_sample_weight if policy is not None else 0}
    problem = method.check_plan(plan, rules.name, received, trained)
    if problem:
        raise SecureAggregationRefusal(f"the round plan: {problem}")
    noise = ddp.Parameters.from_plan(plan)  # distributed DP: this hospital's share of the sum's noise
    values, metrics = method.contribution(received, trained, {**plan, **own},
                                          ddp.method_layout(plan) if noise is not None else layout)
    if noise is not None:
        from common.trust.local_dp import noise_rng

        values = ddp.contribute(values, noise, plan, noise_rng())
    vector = encode(layout, values, state.flower.clipping_range, state.flower.target_range)
    state, answer = hospital_stage(state, COLLECT, config, message.metadata.dst_node_id, rules, vector, digest,
                                   (plan_digest, plan))
    save_state(context, state)
    metrics = {**trained.metrics, **metrics, "secagg-seconds": round(time.perf_counter() - started, 3)}
    release = policy.metrics_released if policy is not None else "all"
    weight_key = received.config.get("weighted-by-key")
    needed = ALWAYS_CLEAR | ({weight_key} if isinstance(weight_key, str) else set())
    clear = {k: v for k, v in metrics.items() if k not in method.hidden_metrics and not isinstance(v, list)
             and (k in needed or release == "all" or (release == "validation" and k.startswith("val-")))}
    reply_config = {k: v for k, v in trained.config.items() if release == "all" or k != "device"}
    payload = Payload(arrays={MASKED_GROUP: {MASKED_ARRAY: pack_values(answer["masked"],
                                                                       modulus_bits(state.flower.mod_range))}},
                      config={**reply_config, STAGE_KEY: COLLECT}, metrics=clear)
    return Message(to_recorddict(payload, "per-tensor", keys), reply_to=message)


def train_config_problem(state: HospitalRound, plan: dict[str, Any]) -> str | None:
    """Why the round plan's training config cannot be the one this round trains from (None: it can): it must name
    the run and round this hospital was set up for, and a method."""
    train_config = plan.get(TRAIN_CONFIG_KEY)
    if not isinstance(train_config, dict) or not isinstance(train_config.get("strategy"), str):
        return "it carries no training config (secagg.train-config) naming a method"
    if (train_config.get("run-name"), train_config.get("server-round")) != (state.run, state.rnd):
        return (f"its training config is for run {train_config.get('run-name')!r} round "
                f"{train_config.get('server-round')!r}, this protocol run for run {state.run!r} round {state.rnd}")
    return None


def secure_aggregation_mod(message: Message, context: Context, call_next) -> Message:
    """``secure_train`` as a Flower ClientApp mod (``ClientApp(mods=[secure_aggregation_mod])``)."""
    return secure_train(message, context, lambda m: call_next(m, context))
