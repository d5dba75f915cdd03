"""The hospital-side API: fedmed's methods in a ClientApp of your own, with your own mods and logging.

    from flwr.clientapp import ClientApp
    from client_app.api import Hospital

    app = ClientApp(mods=[my_size_limit_mod])

    @app.query()
    def query(message, context):
        return Hospital(context).answer(message)

    @app.train()
    def train(message, context):
        reply = Hospital(context).answer(message)
        my_audit_log.write(...)
        return reply

    @app.evaluate()
    def evaluate(message, context):
        return Hospital(context).answer(message)

A :class:`Hospital` is the method's hospital half (``strategies/<method>/hospital.py``) over this hospital's network
and data, both named in the run config (``model``, ``dataset``: built in, or ``package.module:factory`` of your
own) and its node config (``data-dir``, ``state-dir``...). Which method runs comes with every message from the
server's strategy. fedmed's own ClientApp (``client_app/app.py``) is these three handlers and nothing else.
Any failure becomes an error reply whose reason names the hospital and the file or key at fault, so the server
logs it and goes on.

The hospital's policy (node config ``policy-file``: methods, min-samples, local DP, rounds; ``common/trust/policy.py``)
is applied to every answer, here or in the warm worker, so a ClientApp of your own enforces it as fedmed's does; what it
refuses is an error reply with the reason. Every message received and every reply sent is a line of the hospital's audit
log (node config ``audit-log``, default ``audit.jsonl`` in its state folder; ``common/trust/audit.py``), and each reply
carries the log's last hash (``audit-head``), which the server's own audit log records.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from common.engine.wire import LAYOUTS, MODEL_GROUP, RecordKeys, from_flower_reply, from_recorddict, to_recorddict
from common.payload import Payload
from common.trust.audit import AUDIT_HEAD_MARK, RUN_ENDED_QUERY, SERVER_HEAD_KEY, AuditLog, message_digest
from common.trust.secure_aggregation.messages import COLLECT, STAGE_KEY

from .secure_aggregation import secure_train

log = logging.getLogger("fedmed")

HOSPITAL_ERROR = 1  #: ``Error.code`` of a failure inside the hospital's answer
#: config keys of fedmed's protocol, not the app's train config: left out of the message its own train handler gets
PROTOCOL_PREFIXES = ("fedmed.", "secagg.")
AUDIT_HEAD_KEY = "audit-head"  #: reply config key: the hash of the last line of the hospital's audit log
#: the SuperLink's address as the hospital's SuperNode was told it (``fedmed-supernode --superlink``, which sets it for
#: the ClientApp's process): each audit line of a message names it, so the hospital's log says to whom
SUPERLINK_ENV = "FEDMED_SUPERLINK"


class Hospital:
    """This hospital's answers to the server's messages: who it is (query), training, evaluation."""

    def __init__(self, context: Context, own_train: Callable[[Message], Message] | None = None):
        self.context = context
        #: the ClientApp's own train handler, for the secure rounds of a method it trains itself (FedAvg's family):
        #: it trains on Flower's message, and the reply it returns is masked (``HospitalClientApp``)
        self.own_train = own_train

    @property
    def name(self) -> str:
        node = self.context.node_config
        return str(node.get("hospital") or f"partition {node.get('partition-id', '?')}")

    def answer(self, message: Message) -> Message:
        """The reply to ``message`` (query, train or evaluate), or an error reply naming this hospital; both, and the
        message, are written to the hospital's audit log."""
        kind = message.metadata.message_type.split(".")[0]
        handlers = {MessageType.QUERY: self.query, MessageType.EVALUATE: self.evaluate,
                    MessageType.TRAIN: lambda m: secure_train(m, self.context, self.train,  # SecAgg+ stages
                                                              train_payload=self.train_payload)}
        if self.own_train is not None:
            handlers[MessageType.TRAIN] = lambda m: secure_train(m, self.context, self.train_own_way)
        audit, about = None, {}
        try:
            audit, about = self.audit_log(), message_about(message, kind)
            if audit is not None:
                audit.append_many([("message", {"direction": "received", **about, **message_digest(message)})],
                                  sync=False)  # made durable with the line of the reply, before it leaves
            if kind not in handlers:
                raise ValueError(f"message type {message.metadata.message_type!r} is not one fedmed answers")
            reply = handlers[kind](message)
            if audit is not None and not reply.has_error():
                stamp_audit_head(reply, audit.head())
        except (Exception, SystemExit) as error:  # reported to the server, which logs it and carries on
            what = "" if type(error).__name__ == "WorkerFailed" else f"{type(error).__name__}: "  # already says
            reason = f"hospital {self.name}: {what}{error}"
            log.error("%s\n%s", reason, traceback.format_exc())  # here in full; what leaves names no local path
            reply = Message(Error(code=HOSPITAL_ERROR, reason=with_audit_head(without_local_paths(reason), audit)),
                            reply_to=message)
        if audit is not None:
            try:
                audit.append("message", direction="sent", **about, **reply_about(reply), **message_digest(reply),
                             **(policy_in_force(self.context) if kind == "query" else {}))
            except Exception as error:  # the reply is not sent unlogged
                reason = f"hospital {self.name}: {type(error).__name__}: {error}"
                log.error("%s", reason)
                reply = Message(Error(code=HOSPITAL_ERROR, reason=without_local_paths(reason)), reply_to=message)
        return reply

    def audit_log(self) -> AuditLog | None:
        """This hospital's audit log (node config ``audit-log``; default: in its state folder), None for 'none'."""
        from .node_config import load_node_config

        node = load_node_config(self.context.node_config)
        path = node.audit_path(str(self.context.run_config.get("state-dir", "state")))
        return AuditLog(path, f"hospital:{node.name}") if path is not None else None

    def query(self, message: Message) -> Message:
        payload = from_recorddict(message.content)
        if payload.config.get("query") == RUN_ENDED_QUERY:  # its log recorded the server's last head: all it needs
            return Message(RecordDict({"hospital": ConfigRecord({"run-ended": True})}), reply_to=message)
        identity = self.payload_answer("query", payload)
        return Message(RecordDict({"hospital": ConfigRecord(identity.config)}), reply_to=message)

    def train(self, message: Message) -> Message:
        payload = from_recorddict(message.content)
        reply = self.train_payload(payload)
        layout = payload.config.get("message-arrays")  # the layout and record names the server chose, both ways
        return Message(to_recorddict(reply, layout if layout in LAYOUTS else "per-tensor",
                                     RecordKeys.of(message.content)), reply_to=message)

    def train_own_way(self, message: Message) -> Message:
        """The ClientApp's own train handler on Flower's message of ``message`` (the model as one ArrayRecord of one
        Array per tensor, and the train config; fedmed's protocol keys left out), its reply (Flower's FedAvg
        contract: one ArrayRecord, one MetricRecord) as fedmed's, for the secure round to mask."""
        assert self.own_train is not None
        keys = RecordKeys.of(message.content)
        payload = from_recorddict(message.content, keys=keys)
        config = {k: v for k, v in payload.config.items() if not k.startswith(PROTOCOL_PREFIXES)}
        model = ArrayRecord({name: Array(np.require(value, requirements="C"))
                             for name, value in payload.arrays.get(MODEL_GROUP, {}).items()})
        flower = make_message(copy.copy(message.metadata), RecordDict({keys.arrays: model,
                                                                        keys.config: ConfigRecord(config)}))
        reply = self.own_train(flower)
        if reply.has_error():
            return reply
        trained = from_flower_reply(reply.content)
        if isinstance(payload.config.get("server-round"), int):  # the round it answers, as fedmed's replies say it
            trained.metrics["server-round"] = payload.config["server-round"]
        return Message(to_recorddict(trained, "per-tensor", keys), reply_to=message)

    def train_payload(self, payload: Payload) -> Payload:
        """The method's hospital half trains from ``payload``: its reply, before it becomes a message (a secure round
        masks it first)."""
        started = seconds_before_handler()
        reply = self.payload_answer("train", payload)
        if started is not None and "hospital-seconds" in reply.metrics:  # the round's overhead (benchmarks/overhead),
            reply.metrics["clientapp-start-seconds"] = round(started, 3)  # when the policy lets timing leave
        return reply

    def evaluate(self, message: Message) -> Message:
        """Flower's evaluate phase: metrics of the received model on this hospital's validation data."""
        metrics = self.payload_answer("evaluate", from_recorddict(message.content)).metrics
        return Message(to_recorddict(Payload(metrics=metrics), keys=RecordKeys.of(message.content)), reply_to=message)

    def payload_answer(self, kind: str, payload: Payload) -> Payload:
        """The method's hospital half answers the payload: here, or in the hospital's warm worker when Flower
        runs every message in a fresh process (``client_app/worker.py``)."""
        if uses_worker(self.context):
            from .worker import ask_worker

            return ask_worker(kind, payload, self.context.run_config, self.context.node_config)
        from . import hospital  # torch, the methods and the data loaders

        return hospital.answer(kind, payload, self.context.run_config, self.context.node_config)


def stamp_audit_head(reply: Message, head: str) -> None:
    """Every answer, a secure-aggregation stage's included, carries the hospital's audit head in its config record
    (the identity reply's ``hospital`` record), which the server's audit log records."""
    for record in reply.content.config_records.values():  # every reply of ours has exactly one
        record[AUDIT_HEAD_KEY] = head
        return


#: An absolute path in a reason (POSIX, or home-relative), up to a quote, space, bracket or separator of the text.
_LOCAL_PATH = re.compile(r"(?<![\w:/.])(?:~|/)[^\s'\"(),;\[\]<>]*")


def without_local_paths(reason: str) -> str:
    """``reason`` with every absolute path cut to its last part (``/var/lib/fedmed/st-olav/privacy-ledger.json`` ->
    ``<...>/privacy-ledger.json``): a refusal names the file at fault without telling the server the hospital's
    folders; the hospital's own log keeps the full reason."""
    def short(match: re.Match) -> str:
        path = match.group(0).rstrip(".:")
        tail = match.group(0)[len(path):]
        name = path.rstrip("/").rsplit("/", 1)[-1]
        return f"<...>/{name}{tail}" if name and name != "~" else f"<...>{tail}"

    return _LOCAL_PATH.sub(short, reason)


def with_audit_head(reason: str, audit: AuditLog | None) -> str:
    """An error reply's reason with the hospital's audit head at its end (a Flower error reply carries no records),
    so the server's log anchors refusals as it anchors answers (:func:`common.trust.audit.head_in_reason`)."""
    if audit is None:
        return reason
    try:
        return f"{reason} {AUDIT_HEAD_MARK}{audit.head()}]"
    except Exception:  # a damaged log: the reason still goes out, and the next append stops the hospital
        return reason


def message_about(message: Message, kind: str) -> dict[str, Any]:
    """What an audit line says of a message besides its digest: the run, round and method it names, its kind, the
    secure-aggregation stage, the Flower run, the peer that sent it (its node id and, under ``fedmed-supernode``, the
    SuperLink's address) and the head of the server's audit log the message carries."""
    config: dict[str, Any] = {}
    if not message.has_error():
        for record in message.content.config_records.values():
            config.update({k: record[k] for k in ("run-name", "server-round", "strategy", SERVER_HEAD_KEY, STAGE_KEY)
                           if k in record})
    head = config.get(SERVER_HEAD_KEY)
    return {"kind": kind, "run": config.get("run-name"), "round": config.get("server-round"),
            "method": config.get("strategy"), "stage": config.get(STAGE_KEY), "flower-run": message.metadata.run_id,
            "peer-node": message.metadata.src_node_id, "peer": "server",
            "superlink": os.environ.get(SUPERLINK_ENV) or None,
            "peer-audit-head": head if isinstance(head, str) else None}


def reply_about(reply: Message) -> dict[str, Any]:
    """What the hospital's log says of a reply it sends, for its data-protection officer (``fedmed console``): the
    names of the metrics that leave in it, and whether its arrays are masked (secure aggregation's collect stage)."""
    if reply.has_error():
        return {}
    records = list(reply.content.values())  # not .metric_records, whose view holds the message in a cycle
    names = sorted({key for record in records if isinstance(record, MetricRecord) for key in record})
    stages = {record.get(STAGE_KEY) for record in records if isinstance(record, ConfigRecord)}
    return {"metrics": names, "masked": COLLECT in stages}


def policy_in_force(context: Context) -> dict[str, Any]:
    """The SHA-256 of the hospital's policy file as the run starts (its identity query), for the line of its reply:
    its log says under which policy each run was answered, even one it refused before any policy decision."""
    import hashlib

    from .node_config import load_node_config

    try:
        policy_file = load_node_config(context.node_config).policy_file
        return {"policy-sha256": hashlib.sha256(Path(policy_file).read_bytes()).hexdigest()} if policy_file else {}
    except Exception:  # a node config or policy that cannot be read: the query's answer already says why
        return {}


def uses_worker(context: Context) -> bool:
    """Deployment, unless the node config says ``warm-worker=false``: Flower runs each message in a fresh
    ``flwr-clientapp`` process, so the work goes to the hospital's warm worker. Simulation keeps its
    ClientApp processes alive, so the work stays in them."""
    from .node_config import WARM_WORKER_BY_DEFAULT

    warm = context.node_config.get("warm-worker", WARM_WORKER_BY_DEFAULT)
    return Path(sys.argv[0]).name == "flwr-clientapp" and warm is True


def seconds_before_handler() -> float | None:
    """In a deployment, what the message cost before our handler ran: since the ``flwr-clientapp`` process
    started (Flower's SuperExec starts one per message), or since ``fedmed-supernode``'s executor acquired
    the task (``deploy/fedmed_supernode.py``); None in simulation."""
    if Path(sys.argv[0]).name == "flwr-clientapp":
        return seconds_since_process_start()
    acquired = os.environ.get("FEDMED_TASK_ACQUIRED")  # set by the executor while it runs a task
    return max(0.0, time.time() - float(acquired)) if acquired else None


def seconds_since_process_start() -> float:
    """How long ago this process started (Linux; 0 elsewhere)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
