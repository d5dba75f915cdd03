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
server's identity query would never reach a mod: :class:`HospitalClientApp` is Flower's ClientApp with fedmed's
query handler registered and the mod installed innermost on every handler, so that the app's own mods (Flower's
order: the app's, then the handler's) see every message, fedmed's included, as they would see Flower's. A ClientApp
that registers its own query handler may install the mod alone, last of its mods: ``ClientApp(mods=[*mine,
hospital_mod])``.
"""

from __future__ import annotations

from typing import Any, Callable

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import DEFAULT_ACTION
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
    if message.metadata.message_type == MessageType.TRAIN and trains_itself(config):  # a secure round of FedAvg's
        return Hospital(context, own_train=lambda m: call_next(m, context)).answer(message)  # family: it masks
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
    return spec.flower_contract  # under secure aggregation too: its train handler trains, fedmed's mod masks


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


TRAIN_HANDLER = "the train handler"


def _flowers_mods_that_cannot_serve_fedmed() -> dict[Mod, tuple[str, str | None]]:
    """Flower's own client-side mods that fail on fedmed's messages where a ClientApp installs them: why, and where
    they do serve (None: nowhere). Flower's SecAgg/SecAgg+ mods speak the protocol of Flower's legacy
    ``SecAggPlusWorkflow``, which no Message-API strategy (Flower's or ours) drives: they fail on every train message
    of ours. Flower's clipping mods refuse every message that is not a train reply to clip (the identity query,
    evaluate): on the train handler, as Flower's docs install them, they clip; on the whole app they refuse the
    identity query."""
    from flwr.client.mod import secagg_mod, secaggplus_mod
    from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod

    secure = ("speaks the protocol of Flower's legacy SecAggPlusWorkflow, which no Message-API strategy drives; "
              "fedmed's strategies run SecAgg+ themselves with fedmed's mod: drop it and set "
              "secure-aggregation.enabled=true in the run config (docs/secure-aggregation.md)", None)
    clipping = ("clips train replies and refuses every other message (the server's identity query, evaluate): "
                "install it on the train handler, @app.train(mods=[{name}]), as Flower's docs do", TRAIN_HANDLER)
    return {secaggplus_mod: secure, secagg_mod: secure, fixedclipping_mod: clipping, adaptiveclipping_mod: clipping}


def refuse_unfit_mods(mods: list[Mod], where: str) -> None:
    """ValueError, when the app is built (before round 1), for a Flower mod that cannot serve fedmed's strategies
    where it is installed (``where``: the whole app, or a handler)."""
    unfit = _flowers_mods_that_cannot_serve_fedmed()
    for mod in mods:
        reason, serves_on = unfit.get(mod, (None, None))
        if reason is not None and where != serves_on:
            name = getattr(mod, "__name__", repr(mod))
            raise ValueError(f"HospitalClientApp: Flower's {name} on {where} {reason.format(name=name)}")


class HospitalClientApp(ClientApp):
    """Flower's ClientApp with fedmed's query handler and fedmed's hospital mod on every handler, innermost: the
    ``mods`` of your own (the app's, then a handler's) see every message, fedmed's included, in Flower's order, and
    fedmed's mod takes the place of your handler for the messages of fedmed's hospital step. Register
    ``@app.train()`` and ``@app.evaluate()`` as with ``ClientApp``."""

    def __init__(self, mods: list[Mod] | None = None, **kwargs: Any):
        refuse_unfit_mods(list(mods or []), "app")
        super().__init__(mods=list(mods or []), **kwargs)
        super().query(mods=[hospital_mod])(fedmed_query)

    def train(self, action: str = DEFAULT_ACTION, *, mods: list[Mod] | None = None):
        refuse_unfit_mods(list(mods or []), TRAIN_HANDLER)
        return super().train(action, mods=[*(mods or []), hospital_mod])

    def evaluate(self, action: str = DEFAULT_ACTION, *, mods: list[Mod] | None = None):
        refuse_unfit_mods(list(mods or []), "the evaluate handler")
        return super().evaluate(action, mods=[*(mods or []), hospital_mod])
