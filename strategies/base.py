"""``MethodStrategy``: a Flower strategy that carries a :class:`~common.federation.Federation`'s payloads.

It adds to Flower's round loop what hospitals need: identities (a query at the start, and for
nodes that join later) so that sampling is by hospital, not by node id; per-hospital byte counts
measured on the serialised messages; a round timeout after which missing hospitals are recorded
and the round goes on; refused replies logged with their reason; a callback after each round for
checkpoints and results; and resuming from any round. Hospitals evaluate the model they receive
inside their training reply, so there is no separate evaluation round trip.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from common.federation import Federation, RoundReply
from common.methods.base import HospitalInfo
from common.wire import MalformedPayload, from_recorddict, message_nbytes, to_recorddict

log = logging.getLogger("fedmed")

RoundCallback = Callable[[Federation, dict[str, Any]], None]


def numeric_metrics(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Flatten a round record's numeric leaves for a Flower MetricRecord."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(numeric_metrics(value, f"{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def send_and_receive(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """Push messages and collect replies until all are in or ``timeout`` passes."""
    return collect_replies(grid, {mid for mid in grid.push_messages(messages) if mid}, timeout)


def collect_replies(grid: Grid, pending: set[str], timeout: float, enough: int | None = None) -> list[Message]:
    """Replies to the ``pending`` message ids until all (or ``enough``) are in or ``timeout`` passes.

    Flower's ``Grid.send_and_receive`` sleeps 3 s between polls, which adds 1.5 s on average to
    every round trip; here the first polls come every 0.25 s, slowing to 2 s for long trainings.
    ``pending`` loses the ids that were answered.
    """
    replies: list[Message] = []
    started = time.time()
    while pending and time.time() - started < timeout and (enough is None or len(replies) < enough):
        arrived = list(grid.pull_messages(set(pending)))
        replies.extend(arrived)
        pending -= {m.metadata.reply_to_message_id for m in arrived}
        if pending:
            time.sleep(min(2.0, 0.25 + (time.time() - started) / 60))
    return replies


class MethodStrategy(Strategy):
    """Runs a federated method through Flower. Subclasses only name the method (see ``strategies/``)."""

    method_name: str = ""
    RETRY_FAILED_NODES_AFTER = 600.0  # seconds before a node whose identity query failed is asked again
    QUERY_PATIENCE = 45.0  # seconds before an identity query without reply is sent again

    def __init__(self, federation: Federation, on_round_end: RoundCallback | None = None,
                 wait_for_hospitals: float = 600.0):
        self.federation = federation
        self.cfg = federation.cfg
        self.on_round_end = on_round_end
        self.wait_for_hospitals = wait_for_hospitals
        self.hospitals: dict[int, HospitalInfo] = {}  # node id -> identity
        self.unusable: dict[int, float] = {}  # node id -> when its identity query failed (retried after a while)
        self._bytes_down: dict[str, int] = {}
        self._chosen: list[HospitalInfo] = []
        self._round_started = 0.0

    # --- hospitals --------------------------------------------------------------------------------
    def discover(self, grid: Grid) -> None:
        """Learn the identity of every connected node not seen before (one query message each)."""
        deadline = time.time() + self.wait_for_hospitals
        while True:
            nodes = list(grid.get_node_ids())
            if self.hospitals or len(nodes) >= self.cfg.min_available_hospitals or time.time() > deadline:
                break  # the minimum gates the start of the run; later rounds go on with whoever is connected
            log.info("waiting for hospitals: %d connected, %d needed", len(nodes), self.cfg.min_available_hospitals)
            time.sleep(2.0)
        connected = set(nodes)
        for node in list(self.hospitals):
            if node not in connected:
                log.info("hospital %s (node %d) disconnected", self.hospitals.pop(node).name, node)
        retry_after = time.time() - self.RETRY_FAILED_NODES_AFTER
        new = [node for node in nodes if node not in self.hospitals and self.unusable.get(node, 0.0) < retry_after]
        give_up = time.time() + self.cfg.round_timeout
        asked: set[str] = set()  # every query still unanswered: a late reply to an earlier one counts too
        while new and time.time() < give_up:
            asked |= {mid for mid in grid.push_messages(self.identity_queries(new)) if mid}
            for reply in collect_replies(grid, asked, min(self.QUERY_PATIENCE, give_up - time.time()), len(new)):
                node = reply.metadata.src_node_id
                if node in new:
                    new.remove(node)
                    self.learn_identity(node, reply)
            if new:  # a reply lost on the way (e.g. to a run stopped meanwhile) is not waited for forever
                log.info("asking node(s) %s again which hospital they are", ", ".join(map(str, new)))

    @staticmethod
    def identity_queries(nodes: list[int]) -> list[Message]:
        return [Message(RecordDict({"config": ConfigRecord({"query": "hospital-info"})}),
                        message_type=MessageType.QUERY, dst_node_id=node) for node in nodes]

    def learn_identity(self, node: int, reply: Message) -> None:
        if reply.has_error():
            log.warning("node %d did not say which hospital it is: %s", node, reply.error.reason)
            self.unusable[node] = time.time()
            return
        info = reply.content.config_records["hospital"]
        properties = {k.removeprefix("property."): v for k, v in info.items() if k.startswith("property.")}
        hospital = HospitalInfo(str(info["name"]), int(info["num-examples"]), properties)
        for old_node, old in list(self.hospitals.items()):
            if old.name == hospital.name:  # a restarted SuperNode comes back under a new node id
                log.info("hospital %s is back as node %d (was %d)", hospital.name, node, old_node)
                del self.hospitals[old_node]
        self.hospitals[node] = hospital
        log.info("hospital %s on node %d: %d training samples %s", hospital.name, node, hospital.num_examples,
                 properties or "")

    # --- Flower's strategy interface -------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.discover(grid)
        self._round_started = time.time()
        self._chosen = self.federation.select(server_round, list(self.hospitals.values()))
        node_of = {info.name: node for node, info in self.hospitals.items()}
        messages = []
        self._bytes_down = {}
        for info in self._chosen:
            payload = self.federation.downlink(server_round, info)
            message = Message(to_recorddict(payload), message_type=MessageType.TRAIN, dst_node_id=node_of[info.name])
            self._bytes_down[info.name] = message_nbytes(message)
            messages.append(message)
        log.info("round %d: training on %s", server_round, ", ".join(h.name for h in self._chosen))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        round_replies = []
        for message in replies:
            hospital = self.hospitals.get(message.metadata.src_node_id)
            if hospital is None:
                log.warning("round %d: reply from unknown node %d ignored", server_round, message.metadata.src_node_id)
                continue
            if message.has_error():
                round_replies.append(RoundReply(hospital, None, message.error.reason, 0))
                continue
            up = message_nbytes(message)
            try:
                round_replies.append(RoundReply(hospital, from_recorddict(message.content), None, up))
            except MalformedPayload as error:
                round_replies.append(RoundReply(hospital, None, f"malformed reply: {error}", up))
        record = self.federation.complete_round(server_round, self._chosen, round_replies, self._round_started,
                                                self._bytes_down)
        if self.on_round_end is not None:
            self.on_round_end(self.federation, record)
        global_arrays = ArrayRecord({k: Array(v) for k, v in self.federation.method.global_arrays.items()})
        return global_arrays, MetricRecord(numeric_metrics({k: record[k] for k in ("train", "test", "bytes_up", "bytes_down") if k in record}))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return []  # hospitals evaluate the received model inside their training reply

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info("%s: %s, %d rounds, fraction-train %.2f, min %d hospitals per round, timeout %.0fs",
                 type(self).__name__, self.cfg.strategy, self.cfg.num_server_rounds, self.cfg.fraction_train,
                 self.cfg.min_train_hospitals, self.cfg.round_timeout)

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn: Any = None) -> Result:
        """Run from the federation's next round (1, or the round after a checkpoint) to the last."""
        num_rounds = num_rounds or self.cfg.num_server_rounds
        timeout = timeout or self.cfg.round_timeout
        self.summary()
        result = Result()
        for rnd in range(self.federation.next_round, num_rounds + 1):
            messages = self.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid)
            replies = send_and_receive(grid, messages, timeout) if messages else []
            arrays, metrics = self.aggregate_train(rnd, replies)
            result.arrays = arrays
            if metrics is not None:
                result.train_metrics_clientapp[rnd] = metrics
        return result

