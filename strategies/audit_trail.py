"""The server's audit trail: a line per message sent or received, the run's outcome, and the run's end told to
every hospital (``common/trust/audit.py`` is the log itself)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from common.config import JobConfig
from common.trust.audit import RUN_ENDED_QUERY, AuditLog, head_in_reason, message_digest

from .grid_messages import send_and_receive


class AuditTrail:
    """What the server writes to its audit log for one run: built from the log's path (run config ``audit-log``:
    empty for ``<run folder>/audit.jsonl``, 'none' for no log), the run's name and its method. It holds no state of
    the log: every line is appended after the file's last line, checked. ``HospitalStrategy.audit``."""

    def __init__(self, path: str | Path, run_dir: Path, run: str, method: str):
        self.path = None if str(path).strip().lower() == "none" else Path(str(path).strip() or run_dir / "audit.jsonl")
        self.run, self.method = run, method

    @classmethod
    def of(cls, job: JobConfig) -> AuditTrail:
        """The audit trail of ``job`` (built again when its run name changes: the log lives in the run folder)."""
        return cls(job.audit_log, job.run_dir, job.run_name, job.strategy)

    def log(self) -> AuditLog | None:
        """The server's audit log, None for 'none'."""
        return None if self.path is None else AuditLog(self.path, "server")

    def message(self, direction: str, message: Message, server_round: int, hospital: str | None = None,
                node: int | None = None, cross_site: bool = False, digest: dict | None = None) -> None:
        """A line of the audit log for a message sent or received: run, round, method, kind, bytes and SHA-256 of
        the content, the hospital and its node, and the hospital's own audit head where its reply carries one.
        An AuditError (a damaged log, a full disk) stops the run: nothing is exchanged unlogged."""
        self.messages([(direction, message, server_round, hospital, node, cross_site, digest)])

    def messages(self, lines: list[tuple]) -> None:
        """Lines of :meth:`message` (each its arguments as a tuple) under one lock and one ``fsync``: a key stage's
        messages to every hospital, or their replies (the same chain, written at once)."""
        audit = self.log()
        if audit is not None:
            audit.append_many([self.line(*line) for line in lines])

    def line(self, direction: str, message: Message, server_round: int, hospital: str | None = None,
             node: int | None = None, cross_site: bool = False, digest: dict | None = None) -> tuple[str, dict]:
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
                           "run": self.run, "round": server_round, "method": self.method,
                           "peer": hospital, "peer-node": message.metadata.src_node_id if received
                           else node or message.metadata.dst_node_id,
                           "flower-run": message.metadata.run_id if received else None, "peer-audit-head": head,
                           "cross-site": cross_site or None, **(digest or message_digest(message))}

    def nothing_aggregated(self, reason: str) -> None:
        """The run's outcome when it aggregated nobody, with the reason."""
        audit = self.log()
        if audit is not None:
            audit.append("run", run=self.run, method=self.method, outcome="nothing aggregated", reason=reason)

    def announce_end(self, grid: Grid, told: Mapping[int, str], server_round: int,
                     closing: Callable[[], dict[str, Any]], config_key: str, wait: float, in_flight: int) -> None:
        """Tell the hospitals ``told`` (node -> name) that the run ended, twice, in a query whose ConfigRecord
        ``config_key`` holds ``closing()`` (the round config, which carries the log's head). The first query and its
        replies are logged as every message is (so each hospital's log is anchored at the server up to its receipt);
        then the server writes its final line (``run-ended``, naming the hospitals told) and sends the second, which
        carries that line's head and is not logged, nor are its replies: the last line a hospital records is the
        server's final line, so a tail the server's operator cut off and rechained fails ``fedmed audit verify
        --peer``. Hospitals that do not answer within ``wait`` seconds are not waited for."""
        audit = self.log()
        if audit is None or not told:
            return

        def queries() -> list[Message]:
            return [Message(RecordDict({config_key: ConfigRecord({"query": RUN_ENDED_QUERY, **closing()})}),
                            message_type=MessageType.QUERY, dst_node_id=node) for node in told]

        messages = queries()
        self.messages([("sent", message, server_round, told[message.metadata.dst_node_id],
                        message.metadata.dst_node_id) for message in messages])
        for reply in send_and_receive(grid, messages, wait, in_flight):
            self.message("received", reply, server_round, told.get(reply.metadata.src_node_id))
        audit.append("run-ended", run=self.run, round=server_round, method=self.method,
                     hospitals=list(told.values()))  # the server's final line
        for _ in send_and_receive(grid, queries(), wait, in_flight):
            pass  # each hospital's log records the final head; nothing more is written here
