"""A hospital's side of secure aggregation (SecAgg+): the answer to each stage's TRAIN message.

``secure_train(message, context, train)`` answers a training message: one without a stage goes to ``train`` as
today; the key stages (setup, share keys, unmask) are answered here with Flower's stage logic
(``common/secure_aggregation.py``), the hospital's secrets kept between stages in the ClientApp's
``context.state`` as Flower's ``secaggplus_mod`` keeps them; in the collect stage the hospital trains with
``train`` (the method's hospital half, as today), and its reply's arrays are replaced by its contribution, bounded,
quantised and masked: only its metrics (numbers) leave it in the clear. ``secure_aggregation_mod`` is the same as a
Flower mod, for a ClientApp of a consortium's own::

    app = ClientApp(mods=[secure_aggregation_mod])

Imports neither torch nor the methods (QFedPolyp's codes are read with its codec, which does).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from flwr.app import ConfigRecord, Context, Message, MessageType
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.common.secure_aggregation.secaggplus_constants import Stage

from common.payload import Payload
from common.secure_aggregation import (
    LAYOUT_KEY,
    MASKED_ARRAY,
    MASKED_GROUP,
    STAGE_KEY,
    Layout,
    encode,
    hospital_stage,
    modulus_bits,
    ours,
    pack_values,
    secure_method,
)
from common.wire import RecordKeys, from_recorddict, to_recorddict

STATE_RECORD = "fedmed.secagg"  #: context.state: the protocol's state (Flower's SecAggPlusState)
ROUND_RECORD = "fedmed.secagg.round"  #: context.state: the run and round the state belongs to

TrainHandler = Callable[[Message], Message]


def stage_of(message: Message) -> str | None:
    """The secure-aggregation stage a TRAIN message belongs to (None: an ordinary training message)."""
    if message.has_error() or message.metadata.message_type.split(".")[0] != MessageType.TRAIN:
        return None
    for record in message.content.config_records.values():
        stage = record.get(STAGE_KEY)
        if stage is not None:
            if stage not in Stage.all():
                raise ValueError(f"unknown secure-aggregation stage {stage!r}")
            return str(stage)
    return None


def load_state(context: Context) -> SecAggPlusState:
    record = context.state.config_records.get(STATE_RECORD)
    return SecAggPlusState(**dict(record)) if record is not None else SecAggPlusState()


def save_state(context: Context, state: SecAggPlusState, bound_to: dict[str, Any]) -> None:
    context.state[STATE_RECORD] = ConfigRecord(state.to_dict())
    context.state[ROUND_RECORD] = ConfigRecord(bound_to)


def forget(context: Context, bound_to: dict[str, Any]) -> None:
    """End this hospital's part in the round: its keys and shares are dropped, the next stage it takes is a setup."""
    done = SecAggPlusState()
    done.current_stage = Stage.UNMASK
    save_state(context, done, bound_to)


def secure_train(message: Message, context: Context, train: TrainHandler, required: bool = False) -> Message:
    """The reply to a TRAIN message: ``train(message)`` for an ordinary one (refused when ``required``: a hospital
    that sends its updates only masked), the stage's answer for a secure-aggregation one."""
    stage = stage_of(message)
    if stage is None:
        if required and message.metadata.message_type.split(".")[0] == MessageType.TRAIN:
            raise ValueError("this hospital sends its updates only under secure aggregation (the server asked for "
                             "an unmasked one)")
        return train(message)
    keys = RecordKeys.of(message.content)
    config = dict(message.content.config_records[keys.config])
    bound_to = {"run-name": str(config.get("run-name", "")), "server-round": int(config.get("server-round", -1))}
    state = load_state(context)
    if stage != Stage.SETUP:
        previous = context.state.config_records.get(ROUND_RECORD)
        if previous is None or dict(previous) != bound_to:
            raise ValueError(f"secure-aggregation stage {stage!r} of run {bound_to['run-name']!r} round "
                             f"{bound_to['server-round']}, but this hospital's keys are of "
                             f"{dict(previous) if previous is not None else 'no round'}")
    node = message.metadata.dst_node_id
    if stage == Stage.COLLECT_MASKED_VECTORS:
        reply = train(message)
        if reply.has_error():
            return reply
        return masked_reply(message, reply, context, state, config, keys, bound_to)
    try:
        state, answer = hospital_stage(state, stage, config, node)
    except Exception:
        if stage != Stage.SETUP:  # a refused or failed stage ends this hospital's round: no secret is kept
            forget(context, bound_to)
        raise
    save_state(context, state, bound_to)
    return Message(to_recorddict(Payload(config={STAGE_KEY: stage, **ours(answer)}), keys=keys), reply_to=message)


def masked_reply(message: Message, reply: Message, context: Context, state: SecAggPlusState, config: dict[str, Any],
                 keys: RecordKeys, bound_to: dict[str, Any]) -> Message:
    """The training reply with its arrays replaced by the hospital's masked contribution (what its method sums,
    its update bounded to the round's norm bound) and the metrics the method keeps at the hospital left out."""
    started = time.perf_counter()
    received, trained = from_recorddict(message.content), from_recorddict(reply.content)
    method = secure_method(str(received.config.get("strategy", "")))
    layout = Layout.from_json(config.get(LAYOUT_KEY))
    try:
        values, metrics = method.contribution(received, trained, config, layout)
        vector = encode(layout, values, state.clipping_range, state.target_range)
        state, masked = hospital_stage(state, Stage.COLLECT_MASKED_VECTORS, config, message.metadata.dst_node_id,
                                       vector)
    except Exception:
        forget(context, bound_to)
        raise
    save_state(context, state, bound_to)
    clear = {k: v for k, v in trained.metrics.items() if k not in method.hidden_metrics and not isinstance(v, list)}
    payload = Payload(arrays={MASKED_GROUP: {MASKED_ARRAY: pack_values(masked, modulus_bits(state.mod_range))}},
                      config={**trained.config, STAGE_KEY: Stage.COLLECT_MASKED_VECTORS},
                      metrics={**clear, **metrics, "secagg-seconds": round(time.perf_counter() - started, 3)})
    return Message(to_recorddict(payload, "per-tensor", keys), reply_to=message)


def secure_aggregation_mod(message: Message, context: Context, call_next) -> Message:
    """``secure_train`` as a Flower ClientApp mod (``ClientApp(mods=[secure_aggregation_mod])``)."""
    return secure_train(message, context, lambda m: call_next(m, context))
