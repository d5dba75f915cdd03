"""The server's audit trail: a line per message sent or received, the run's outcome, and the run's end told to
every hospital (``common/trust/audit.py`` is the log itself)."""

from __future__ import annotations

import logging
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from common.methods.base import FLOWER_ONLY
from common.trust.audit import RUN_ENDED_QUERY, AuditLog, head_in_reason, message_digest

from .grid_messages import messages_in_flight, send_and_receive

log = logging.getLogger("fedmed")


class AuditTrail:
    # --- the audit log ------------------------------------------------------------------------------
    def audit_log(self) -> AuditLog | None:
        """The server's audit log (run config ``audit-log``; default: audit.jsonl in the run's results folder), None
        for 'none'. It holds no state: every line is appended after the file's last line, checked."""
        path = self.job.audit_log.strip()
        if path.lower() == "none":
            return None
        return AuditLog(path or self.job.run_dir / "audit.jsonl", "server")

    def audit_message(self, direction: str, message: Message, server_round: int, hospital: str | None = None,
                      node: int | None = None, cross_site: bool = False, digest: dict | None = None) -> None:
        """A line of the audit log for a message sent or received: run, round, method, kind, bytes and SHA-256 of
        the content, the hospital and its node, and the hospital's own audit head where its reply carries one.
        An AuditError (a damaged log, a full disk) stops the run: nothing is exchanged unlogged."""
        audit = self.audit_log()
        if audit is not None:
            audit.append_many([self.audit_line(direction, message, server_round, hospital, node, cross_site, digest)])

    def audit_messages(self, lines: list[tuple]) -> None:
        """Lines of :meth:`audit_message` (each its arguments as a tuple) under one lock and one ``fsync``: a key
        stage's messages to every hospital, or their replies (the same chain, written at once)."""
        audit = self.audit_log()
        if audit is not None:
            audit.append_many([self.audit_line(*line) for line in lines])

    def audit_line(self, direction: str, message: Message, server_round: int, hospital: str | None = None,
                   node: int | None = None, cross_site: bool = False,
                   digest: dict | None = None) -> tuple[str, dict[str, Any]]:
        """The audit event and fields that record a message sent or received (``digest``: its
        ``common.trust.audit.message_digest``, where the caller measured it already)."""
        received = direction == "received"
        head = None
        if received and message.has_error():  # a refusal: the hospital put its head at the end of the reason
            head = head_in_reason(str(message.error.reason))
        elif received:
            heads = [record.get("audit-head") for record in message.content.values()  # not .config_records, whose
                     if isinstance(record, ConfigRecord)]  # view holds the message in a cycle until Python's collector
            head = next((h for h in heads if isinstance(h, str)), None)
        return "message", {"direction": direction, "kind": message.metadata.message_type.split(".")[0],
                           "run": self.job.run_name, "round": server_round, "method": self.job.strategy,
                           "peer": hospital, "peer-node": message.metadata.src_node_id if received
                           else node or message.metadata.dst_node_id,
                           "flower-run": message.metadata.run_id if received else None, "peer-audit-head": head,
                           "cross-site": cross_site or None, **(digest or message_digest(message))}


    def record_nothing_aggregated(self, reason: str) -> None:
        """The run aggregated nobody: why, logged, kept as ``nothing_aggregated`` and written to the audit log."""
        self.nothing_aggregated = reason
        log.error("%s: %s; the Result holds no arrays, as Flower's", self.job.run_name, reason)
        audit = self.audit_log()
        if audit is not None:
            audit.append("run", run=self.job.run_name, method=self.job.strategy, outcome="nothing aggregated",
                         reason=reason)

    def announce_end(self, grid: Grid, timeout: float) -> None:
        """Tell every hospital of the run that it ended, twice. The first closing query and its replies are logged
        as every message is (so each hospital's log is anchored at the server up to its receipt); then the server
        writes its final line (``run-ended``, naming the hospitals told) and sends the second, which carries that
        line's head and is not logged, nor are its replies: the last line a hospital records is the server's final
        line, so a tail the server's operator cut off and rechained fails ``fedmed audit verify --peer``.
        Hospitals that do not answer within a few seconds are not waited for."""
        audit = self.audit_log()
        if audit is None or not self.hospitals:
            return
        told = {node: hospital for node, hospital in sorted(self.hospitals.items())
                if not hospital.properties.get(FLOWER_ONLY)}  # no audit log there, and no query handler to answer
        if not told:
            return
        rnd, wait = self.engine.next_round - 1, min(timeout, 30.0)

        def closing() -> list[Message]:
            return [Message(RecordDict({self.records.config: ConfigRecord({"query": RUN_ENDED_QUERY,
                                                                           **self.hospital_config(rnd)})}),
                            message_type=MessageType.QUERY, dst_node_id=node) for node in told]

        messages = closing()
        for message in messages:
            self.audit_message("sent", message, rnd, told[message.metadata.dst_node_id].name,
                               message.metadata.dst_node_id)
        for reply in send_and_receive(grid, messages, wait, messages_in_flight(self.job, grid, True)):
            hospital = self.hospitals.get(reply.metadata.src_node_id)
            self.audit_message("received", reply, rnd, hospital.name if hospital else None)
        audit.append("run-ended", run=self.job.run_name, round=rnd, method=self.job.strategy,
                     hospitals=[hospital.name for hospital in told.values()])  # the server's final line
        for _ in send_and_receive(grid, closing(), wait, messages_in_flight(self.job, grid, True)):
            pass  # each hospital's log records the final head; nothing more is written here
