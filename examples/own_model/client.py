"""A hospital's own ClientApp: its own mod (here, an audit of every reply it sends) around fedmed's hospital-side
API, which trains the method the server asks for on this hospital's network and data."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from client_app.api import Hospital


def audit_mod(message: Message, context: Context, call_next) -> Message:
    """Append one line per reply to this hospital's audit file (node config ``audit-file``)."""
    reply = call_next(message, context)
    target = context.node_config.get("audit-file") or context.run_config.get("audit-file")
    if target:
        entry = {"time": time.time(), "kind": message.metadata.message_type, "error": reply.has_error(),
                 "node": context.node_id}
        with Path(str(target)).open("a") as log:
            log.write(json.dumps(entry) + "\n")
    return reply


app = ClientApp(mods=[audit_mod])


@app.query()
def query(message: Message, context: Context) -> Message:
    return Hospital(context).answer(message)


@app.train()
def train(message: Message, context: Context) -> Message:
    return Hospital(context).answer(message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    return Hospital(context).answer(message)
