"""A Flower ``Grid`` without processes, for unit tests of the strategies.

Each node is a function from a message to its reply (``None``: the node never answers, as when it
is killed mid-round). ``hospital_node`` answers with fedmed's real ClientApp handlers, in this
process, on its partition of the job's data set, as inside Flower's simulation engine (a node config of
``partition-id``/``num-partitions`` only is a virtual hospital; any other gets a deployed hospital's gate).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any
from uuid import uuid4

from flwr.app import Context, Message, MessageType, RecordDict

from benchmarks.memory.grid import LocalGrid

NodeHandler = Callable[[Message], "Message | None"]


class FakeGrid(LocalGrid):
    def __init__(self, nodes: Mapping[int, NodeHandler]):
        super().__init__()
        self.nodes: dict[int, NodeHandler] = dict(nodes)
        self.sent: list[Message] = []
        self.replies: list[Message] = []  # every reply the nodes gave, in order
        self._replies: dict[str, Message] = {}

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())
            self.sent.append(message)
            handler = self.nodes.get(message.metadata.dst_node_id)
            reply = handler(message) if handler is not None else None
            if reply is not None:
                self._replies[message.metadata.message_id] = reply
                self.replies.append(reply)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(mid) for mid in list(message_ids) if mid in self._replies]

    def sent_of_type(self, message_type: str) -> list[Message]:
        return [m for m in self.sent if m.metadata.message_type == message_type]


def hospital_node(run_config: Mapping[str, Any], node_config: Mapping[str, Any], node_id: int) -> NodeHandler:
    """A hospital answering with fedmed's ClientApp handlers (query, train, evaluate)."""
    from client_app import app as client
    from client_app.node_config import every_hospital_in_this_process

    context = Context(run_id=1, node_id=node_id, node_config=dict(node_config), state=RecordDict(),
                      run_config=dict(run_config))
    handlers = {MessageType.QUERY: client.query, MessageType.TRAIN: client.train, MessageType.EVALUATE: client.evaluate}

    def answer(message: Message) -> Message:
        with every_hospital_in_this_process():  # one operator runs them all, as Flower's simulation engine does
            return handlers[message.metadata.message_type](message, context)

    return answer


def simulated_hospitals(run_config: Mapping[str, Any], count: int, first_node_id: int = 101,
                        **node_config: Any) -> dict[int, NodeHandler]:
    """``count`` hospitals on partitions 0..count-1 of the job's data, as Flower's simulation makes them."""
    nodes = {}
    for pid in range(count):
        node_id = first_node_id + pid
        node = {"partition-id": pid, "num-partitions": count, **node_config}
        nodes[node_id] = hospital_node(run_config, node, node_id)
    return nodes


def flower_clientapp_node(app: Any, run_config: Mapping[str, Any], node_config: Mapping[str, Any],
                          node_id: int) -> NodeHandler:
    """A node running a Flower ClientApp (``app(message, context)``) as Flower's runtime does: an exception the app
    raises (e.g. Flower's "No query function registered" for a message type it has no handler for) becomes an error
    reply, its reason as ``flwr/supernode/runtime/run_clientapp.py`` writes it."""
    from flwr.app import Error

    from client_app.node_config import every_hospital_in_this_process

    context = Context(run_id=1, node_id=node_id, node_config=dict(node_config), state=RecordDict(),
                      run_config=dict(run_config))

    def answer(message: Message) -> Message:
        try:
            with every_hospital_in_this_process():  # one operator runs them all, as Flower's simulation engine does
                return app(message, context)
        except Exception as error:
            reason = str(type(error)) + ":<'" + str(error) + "'>"
            return Message(Error(code=2, reason=reason), reply_to=message)

    return answer
