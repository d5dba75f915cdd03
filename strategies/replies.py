"""A round's replies as the strategy takes them: decoded by hospital (fedmed's records or Flower's contract), held
to size limits, each logged as received; the round engine keeps the accepted ones in memory or on disk
(``common/engine/reply_store.py``) until the round closes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, Message, RecordDict

from common.engine.round_engine import RoundReply
from common.engine.screening import cut
from common.engine.wire import MalformedPayload, RecordKeys, from_flower_reply, from_recorddict
from common.methods.base import TRAINS_ITSELF, HospitalInfo
from common.payload import Payload
from common.trust.audit import message_digest

from .audit_trail import AuditTrail

log = logging.getLogger("fedmed")

#: Bytes of replies a streamed round pulls from the SuperLink at once (:func:`pull_at_once`).
PULL_BYTES = 64 * 2**20


def pull_at_once(bytes_down: Mapping[str, int]) -> int:
    """Most replies pulled from the SuperLink at once in a streamed round: as many as fit in :data:`PULL_BYTES` at
    the size of the round's largest message to a hospital (``bytes_down``; at least one), since Flower holds every
    reply of a pull whole in memory until the pull returns."""
    largest = max(bytes_down.values(), default=0)
    return max(1, PULL_BYTES // largest) if largest else 0


@dataclass(frozen=True)
class ReplyLimits:
    """The most a reply may hold: ``bytes`` of arrays once decoded, ``tensors`` counted before any is decoded."""

    bytes: int
    tensors: int

    @classmethod
    def of(cls, max_reply_mb: float, global_arrays: Mapping[str, Any]) -> ReplyLimits:
        """``screening.max-reply-mb``, or 4x the method's whole state plus 64 MB; twice its tensors and 64 (a
        hospital sends back at most its part of the global model and a few extras)."""
        state = sum(a.nbytes for a in global_arrays.values())
        return cls(int(max_reply_mb * 1e6) if max_reply_mb > 0 else 4 * state + 64_000_000,
                   2 * len(global_arrays) + 64)


class ReplyIntake:
    """How a strategy takes its hospitals' replies: from the nodes it knows (``hospitals``, node -> identity, read
    as they are now), within ``limits``, in the record names ``records``, each logged on ``audit``. A hospital that
    trains the model itself replies in Flower's contract, its tensors sorted into the method's array groups by
    ``flower_reply_arrays``, except in training rounds whose messages are fedmed's (``masks_own_training``: a secure
    round, whose mod masks what the app's train handler returns). ``kept``: the contents of the last round's
    accepted replies by hospital, for ``train_metrics_aggr_fn``. ``HospitalStrategy.reply_intake()``."""

    def __init__(self, hospitals: Mapping[int, HospitalInfo], audit: AuditTrail, records: RecordKeys,
                 limits: ReplyLimits, flower_reply_arrays: Callable[[dict], dict], masks_own_training: bool = False):
        self.hospitals, self.audit, self.records, self.limits = hospitals, audit, records, limits
        self.flower_reply_arrays, self.masks_own_training = flower_reply_arrays, masks_own_training
        self.kept: dict[str, RecordDict] = {}

    def round_replies(self, server_round: int, replies: Iterable[Message], chosen: Iterable[str],
                      keep_arrays: bool = True) -> Iterator[RoundReply]:
        """Replies by hospital, each decoded when asked for (so the round engine screens one while the next is on its
        way, and none is held here after): from nodes not ``chosen`` (hospital names) ignored, errors and
        undecodable ones with their reason. The replies' contents are kept in ``kept``, without their arrays unless
        ``keep_arrays``."""
        self.kept, chosen = {}, set(chosen)
        for message in replies:
            reply = self.round_reply(server_round, message, chosen, keep_arrays)
            del message
            if reply is not None:
                yield reply
                del reply  # not held while the next one is pulled and decoded

    def round_reply(self, server_round: int, message: Message, chosen: set[str],
                    keep_arrays: bool) -> RoundReply | None:
        """One reply of :meth:`round_replies`, decoded (None: not from a chosen hospital)."""
        hospital = self.hospitals.get(message.metadata.src_node_id)
        digest = message_digest(message)  # one serialisation: the audit line and the traffic count share it
        self.audit.message("received", message, server_round, hospital.name if hospital else None, digest=digest)
        if hospital is None and message.has_error():  # the SuperLink's own: the message never reached a reply
            log.warning("round %d: a training message was not answered: %s", server_round, message.error.reason)
            return None
        if hospital is None or hospital.name not in chosen:
            log.warning("round %d: reply from node %d, which was not asked to train, ignored", server_round,
                        message.metadata.src_node_id)
            return None
        if message.has_error():
            return RoundReply(hospital, None, cut(message.error.reason), 0)
        up = digest["bytes"]
        try:  # streamed (not keep_arrays): views into the message, which is released once the reply is screened
            payload = self.decode(hospital, message.content, copy=keep_arrays)
        except MalformedPayload as error:
            return RoundReply(hospital, None, f"malformed reply: {error}", up)
        self.kept[hospital.name] = message.content if keep_arrays else RecordDict(
            {name: record for name, record in message.content.items() if not isinstance(record, ArrayRecord)})
        return RoundReply(hospital, payload, None, up)

    def decode(self, hospital: HospitalInfo, content: RecordDict, copy: bool = True,
               training: bool = True) -> Payload:
        """A reply's payload: fedmed's records, or for a hospital that trains the model itself Flower's contract (one
        ArrayRecord, one MetricRecord, any names), its model's tensors sorted into the method's array groups
        (``ServerMethod.flower_reply_arrays``). MalformedPayload says what does not fit."""
        limit, tensors = self.limits.bytes, self.limits.tensors
        if not hospital.properties.get(TRAINS_ITSELF) or (training and self.masks_own_training):
            return from_recorddict(content, limit, self.records, tensors, copy=copy)
        payload = from_flower_reply(content, limit, tensors, copy, with_arrays=training)
        if training:
            payload.arrays = self.flower_reply_arrays(payload.arrays["model"])
        return payload
