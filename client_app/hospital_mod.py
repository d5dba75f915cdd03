"""fedmed's hospital step in a Flower ClientApp of your own: ``app = HospitalClientApp()`` where Flower's quickstart
has ``app = ClientApp()``.

A Flower user keeps their ClientApp, network and train loop. fedmed's mod answers what only fedmed can answer: the
server's question which hospital this is, and the messages of the methods whose hospitals run fedmed's own local
step (FedProIn, FedProto, MOON, QFedPolyp, FedMEPD, and any method under secure aggregation), which it hands to the
hospital-side API (``client_app/api.py``) over the network and data the job names (``model`` and ``dataset`` by
import path: your network's class and a loader of yours, docs/own-clientapp.md). Everything else reaches your own
handlers unchanged: the messages of Flower's strategies, and those of fedmed's FedAvg, FedProx and FedBN, which our
strategies send in Flower's own format to a hospital that trains itself (the mod says so when asked who it is).

Flower wraps mods around registered handlers only, and a quickstart ClientApp registers no query handler, so the
server's identity query would never reach a mod: :class:`HospitalClientApp` is Flower's ClientApp with the mod
installed and fedmed's query handler registered. A ClientApp that registers its own query handler may install the
mod alone, ``ClientApp(mods=[hospital_mod])``.
"""

from __future__ import annotations

from typing import Any, Callable

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from common.methods.base import TRAINS_ITSELF
from common.trust.identity import IDENTITY_QUERY, NONCE_KEY, SIGNATURE_KEY, sign_identity

from .api import Hospital


def hospital_mod(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """A Flower mod: fedmed's messages to fedmed's hospital-side API, the rest to the ClientApp's own handlers."""
    config = fedmed_config(message)
    if config is None:  # Flower's own format: a Flower strategy's, or ours to a hospital that trains itself
        return call_next(message, context)
    if message.metadata.message_type == MessageType.QUERY and config.get("query") == IDENTITY_QUERY \
            and trains_itself(config):
        return identity_of_own_training(message, context, config)
    return Hospital(context).answer(message)


def fedmed_config(message: Message) -> ConfigRecord | None:
    """The ConfigRecord of a message in fedmed's format (it names its own records), or None."""
    for name, record in message.content.items():
        if isinstance(record, ConfigRecord) and record.get("fedmed.configrecord-key") == name:
            return record
    return None


def trains_itself(config: ConfigRecord) -> bool:
    """Whether the job's method takes a ClientApp's own training (Flower's FedAvg contract), so that this app's own
    train handler answers its rounds."""
    from common.methods.registry import method_spec

    try:
        spec = method_spec(str(config.get("strategy", "")))
    except KeyError:
        return False
    return spec.flower_contract and not config.get("secure-aggregation.enabled")


def identity_of_own_training(message: Message, context: Context, config: ConfigRecord) -> Message:
    """Who this hospital is, for a method its own train handler serves: its name (node config ``hospital``, in
    simulation ``hospital-<partition>``), that it trains the model itself, and its signature of the server's nonce
    where the node config holds an ``identity-key``. Its sample count is its replies' (the server bounds it by
    ``screening.max-samples``)."""
    from .node_config import load_node_config

    node = load_node_config(context.node_config)
    identity: dict[str, Any] = {"name": node.name, f"property.{TRAINS_ITSELF}": True}
    if node.identity_key and NONCE_KEY in config:
        identity[SIGNATURE_KEY] = sign_identity(node.identity_key, str(config.get("run-name", "")),
                                                str(config[NONCE_KEY]), node.name)
    return Message(RecordDict({"hospital": ConfigRecord(identity)}), reply_to=message)


def fedmed_query(message: Message, context: Context) -> Message:
    """The query handler :class:`HospitalClientApp` registers: fedmed's identity query, answered by the mod around
    it; any other query is not this app's (Flower's own error for an unregistered query)."""
    if fedmed_config(message) is None:
        raise ValueError("No query function registered with name 'default'")
    return Hospital(context).answer(message)


class HospitalClientApp(ClientApp):
    """Flower's ClientApp with fedmed's hospital mod (around every handler, before ``mods`` of your own) and fedmed's
    query handler: register ``@app.train()`` and ``@app.evaluate()`` as with ``ClientApp``."""

    def __init__(self, mods: list[Mod] | None = None, **kwargs: Any):
        super().__init__(mods=[hospital_mod, *(mods or [])], **kwargs)
        self.query()(fedmed_query)
