"""A Flower ``Grid`` of synthetic hospitals in this process, for measuring the ServerApp's own memory.

Each hospital answers a training message with random weights in the message's own flat layout (the same names and
shapes, positive values so BatchNorm's variances pass screening), built when the server pulls it, one float32
segment at a time: the grid keeps nothing of a message but its id, round and layout text, so what the process
holds is the ServerApp's, plus the one reply being pulled (as Flower's gRPC grid holds a reply it pulls whole).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from uuid import uuid4

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from common.engine.wire import CONFIG_RECORD, FLAT_ARRAY, FLAT_LAYOUT, METRICS_RECORD, MODEL_RECORD

SAMPLES = 10  #: training samples every synthetic hospital declares and reports


@dataclass
class Asked:
    """What the grid keeps of a message until its reply is pulled."""

    stub: Message  #: the message's metadata without its content
    round: int
    layout: str | None  #: the flat layout of its model, or None for a query


class LocalGrid(Grid):
    """What a Grid whose nodes answer in this process needs besides pushing and pulling (tests' FakeGrid too)."""

    def __init__(self):
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as inside a ServerApp
        self._run = None

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


class SyntheticGrid(LocalGrid):
    def __init__(self, hospitals: int, seed: int = 0):
        super().__init__()
        self.names = {node: f"hospital-{node - 1:04d}" for node in range(1, hospitals + 1)}
        self.seed = seed
        self.asked: dict[str, Asked] = {}

    def get_node_ids(self) -> Iterable[int]:
        return list(self.names)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            mid = str(uuid4())
            config = message.content.get(CONFIG_RECORD, {})  # (.config_records would keep the message in a cycle)
            stub = Message(RecordDict(), message.metadata.dst_node_id, message.metadata.message_type,
                           group_id=message.metadata.group_id)
            stub.metadata.__dict__["_message_id"] = mid
            layout = config.get(FLAT_LAYOUT + MODEL_RECORD) if message.metadata.message_type == MessageType.TRAIN \
                else None
            self.asked[mid] = Asked(stub, int(config.get("server-round", 0)), layout)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.reply(self.asked.pop(mid)) for mid in list(message_ids) if mid in self.asked]

    def reply(self, asked: Asked) -> Message:
        node = asked.stub.metadata.dst_node_id
        if asked.layout is None:  # which hospital this is
            return Message(RecordDict({"hospital": ConfigRecord({"name": self.names[node], "num-examples": SAMPLES})}),
                           reply_to=asked.stub)
        rng = np.random.default_rng([self.seed, node, asked.round])
        sizes: dict[str, int] = {}
        for _, key, shape in json.loads(asked.layout):
            sizes[key] = sizes.get(key, 0) + int(np.prod(shape, dtype=np.int64))
        arrays = {}
        for key, size in sizes.items():
            dtype = np.dtype(key.rsplit(".", 1)[0])
            values = (rng.random(size, dtype=np.float32).astype(dtype) + dtype.type(0.5) if dtype.kind == "f"
                      else np.zeros(size, dtype=dtype))
            arrays[FLAT_ARRAY + key] = Array(values)
            del values
        content = RecordDict({MODEL_RECORD: ArrayRecord(arrays),
                              CONFIG_RECORD: ConfigRecord({FLAT_LAYOUT + MODEL_RECORD: asked.layout, "device": "cpu"}),
                              METRICS_RECORD: MetricRecord({"num-examples": SAMPLES, "server-round": asked.round})})
        return Message(content, reply_to=asked.stub)
