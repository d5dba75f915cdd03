"""The ClientApp: answers the server's identity query and trains (and evaluates) on the hospital's data.

Each handler turns the message into a :class:`~common.payload.Payload`, has the method's hospital
half answer it (``client_app/hospital.py``: here, or in the hospital's warm worker in a deployment,
``client_app/worker.py``), and turns the reply back into a message. Any failure becomes an error reply whose
reason names the hospital and the file or key at fault, so the server can log it and go on.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from common.payload import Payload
from common.wire import LAYOUTS, RecordKeys, from_recorddict, to_recorddict

log = logging.getLogger("fedmed")
app = ClientApp()

HOSPITAL_ERROR = 1  # Error.code for failures inside our handlers


def _guarded(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    def run(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        except Exception as error:  # reported to the server, which logs it and carries on
            who = context.node_config.get("hospital") or f"partition {context.node_config.get('partition-id', '?')}"
            what = "" if type(error).__name__ == "WorkerFailed" else f"{type(error).__name__}: "  # already says
            reason = f"hospital {who}: {what}{error}"
            log.error("%s\n%s", reason, traceback.format_exc())
            return Message(Error(code=HOSPITAL_ERROR, reason=reason), reply_to=message)

    run.__name__ = handler.__name__
    return run


def uses_worker(context: Context) -> bool:
    """Deployment, unless the node config says ``warm-worker=false``: Flower runs each message in a fresh
    ``flwr-clientapp`` process, so the work goes to the hospital's warm worker. Simulation keeps its
    ClientApp processes alive, so the work stays in them."""
    from .node_config import WARM_WORKER_BY_DEFAULT

    warm = context.node_config.get("warm-worker", WARM_WORKER_BY_DEFAULT)
    return Path(sys.argv[0]).name == "flwr-clientapp" and warm is True


def answer(kind: str, payload: Payload, context: Context) -> Payload:
    if uses_worker(context):
        from .worker import ask_worker

        return ask_worker(kind, payload, context.run_config, context.node_config)
    from . import hospital  # torch and the data loaders

    return hospital.answer(kind, payload, context.run_config, context.node_config)


@app.query()
@_guarded
def query(message: Message, context: Context) -> Message:
    identity = answer("query", from_recorddict(message.content), context)
    return Message(RecordDict({"hospital": ConfigRecord(identity.config)}), reply_to=message)


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


@app.train()
@_guarded
def train(message: Message, context: Context) -> Message:
    started = seconds_before_handler()
    payload = from_recorddict(message.content)
    reply = answer("train", payload, context)
    if started is not None:  # the round's overhead, attributed (benchmarks/overhead)
        reply.metrics["clientapp-start-seconds"] = round(started, 3)
    layout = payload.config.get("message-arrays")  # the layout and record names the server chose, both ways
    return Message(to_recorddict(reply, layout if layout in LAYOUTS else "per-tensor", RecordKeys.of(message.content)),
                   reply_to=message)


@app.evaluate()
@_guarded
def evaluate(message: Message, context: Context) -> Message:
    """Flower's evaluate phase, for strategies that use one: metrics of the received model on local validation data."""
    metrics = answer("evaluate", from_recorddict(message.content), context).metrics
    return Message(to_recorddict(Payload(metrics=metrics), keys=RecordKeys.of(message.content)), reply_to=message)
