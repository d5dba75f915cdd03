"""The ClientApp: answers the server's identity query and trains (and evaluates) on the hospital's data.

Each handler turns the message into a :class:`~common.methods.base.Payload`, calls the method's
hospital half, and turns the reply back into a message. Any failure becomes an error reply whose
reason names the hospital and the file or key at fault, so the server can log it and go on.
"""

from __future__ import annotations

import logging
import traceback
from collections import OrderedDict
from typing import Callable

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from common.config import JobConfig, load_job_config
from common.methods.base import HospitalMethod, Payload
from common.methods.registry import hospital_class
from common.site import HospitalStateStore, Site, build_site
from common.wire import from_recorddict, to_recorddict

from .node_config import NodeConfig, load_node_config

log = logging.getLogger("fedmed")
app = ClientApp()

HOSPITAL_ERROR = 1  # Error.code for failures inside our handlers
_SITES: "OrderedDict[tuple, Site]" = OrderedDict()  # loaded data, reused while this process lives
_MAX_SITES = 32


def hospital_site(cfg: JobConfig, node: NodeConfig, run_name: str = "") -> Site:
    """This hospital's site; its data is loaded once per process, its state folder is the run's."""
    key = (cfg.model_dump_json(exclude={"run_name", "resume_from", "num_server_rounds"}), node.model_dump_json())
    if key not in _SITES:
        _SITES[key] = build_site(cfg, node.name, partition_id=node.partition_id, num_partitions=node.num_partitions,
                                 data_dir=node.data_dir or None, device=node.device, properties=node.properties())
        while len(_SITES) > _MAX_SITES:
            _SITES.popitem(last=False)
    _SITES.move_to_end(key)
    site = _SITES[key]
    site.state = HospitalStateStore(node.state_folder(cfg, run_name) if run_name else None)
    return site


def _guarded(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    def run(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        except Exception as error:  # reported to the server, which logs it and carries on
            who = context.node_config.get("hospital") or f"partition {context.node_config.get('partition-id', '?')}"
            reason = f"hospital {who}: {type(error).__name__}: {error}"
            log.error("%s\n%s", reason, traceback.format_exc())
            return Message(Error(code=HOSPITAL_ERROR, reason=reason), reply_to=message)

    run.__name__ = handler.__name__
    return run


def hospital_method(context: Context, payload: Payload | None = None) -> HospitalMethod:
    """The job's hospital half, on this node's site (its state folder is the run's, named in the payload)."""
    cfg = load_job_config(context.run_config)
    node = load_node_config(context.node_config)
    run_name = str(payload.config.get("run-name", "")) if payload is not None else ""
    return hospital_class(cfg.strategy)(cfg, hospital_site(cfg, node, run_name))


@app.query()
@_guarded
def query(message: Message, context: Context) -> Message:
    info = hospital_method(context).info()
    record = {"name": info.name, "num-examples": info.num_examples,
              **{f"property.{k}": v for k, v in info.properties.items()}}
    return Message(RecordDict({"hospital": ConfigRecord(record)}), reply_to=message)


@app.train()
@_guarded
def train(message: Message, context: Context) -> Message:
    payload = from_recorddict(message.content)
    reply = hospital_method(context, payload).timed_train(int(payload.config["server-round"]), payload)
    return Message(to_recorddict(reply), reply_to=message)


@app.evaluate()
@_guarded
def evaluate(message: Message, context: Context) -> Message:
    """Flower's evaluate phase, for strategies that use one: metrics of the received model on local validation data."""
    payload = from_recorddict(message.content)
    metrics = hospital_method(context, payload).evaluate(int(payload.config.get("server-round", 0)), payload)
    return Message(RecordDict({"metrics": MetricRecord({k: float(v) for k, v in metrics.items()})}), reply_to=message)
