"""A round's replies as the strategy takes them: decoded by hospital (fedmed's records or Flower's contract), held
to size limits, kept in memory or on disk (``common/engine/reply_store.py``) until the round closes."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from flwr.app import ArrayRecord, Message, MessageType, RecordDict

from common.engine.round_engine import RoundReply
from common.engine.screening import cut
from common.engine.wire import MalformedPayload, from_flower_reply, from_recorddict
from common.methods.base import TRAINS_ITSELF, HospitalInfo
from common.payload import Payload
from common.trust.audit import message_digest

log = logging.getLogger("fedmed")

#: Bytes of replies a streamed round pulls from the SuperLink at once (:meth:`HospitalStrategy.pull_at_once`).
PULL_BYTES = 64 * 2**20


class ReplyIntake:
    def round_replies(self, server_round: int, replies: Iterable[Message],
                      keep_arrays: bool = True) -> Iterator[RoundReply]:
        """Replies by hospital, each decoded when asked for (so the round engine screens one while the next is on its
        way, and none is held here after): from unknown nodes ignored, errors and undecodable ones with their
        reason. The replies' contents are kept for ``train_metrics_aggr_fn``, without their arrays unless
        ``keep_arrays``."""
        chosen, limit, tensors = {h.name for h in self._chosen}, self.reply_limit(), self.reply_tensor_limit()
        for message in replies:
            reply = self.round_reply(server_round, message, chosen, limit, tensors, keep_arrays)
            del message
            if reply is not None:
                yield reply
                del reply  # not held while the next one is pulled and decoded

    def round_reply(self, server_round: int, message: Message, chosen: set[str], limit: int, tensors: int,
                    keep_arrays: bool) -> RoundReply | None:
        """One reply of :meth:`round_replies`, decoded (None: not from a chosen hospital)."""
        hospital = self.hospitals.get(message.metadata.src_node_id)
        digest = message_digest(message)  # one serialisation: the audit line and the traffic count share it
        self.audit_message("received", message, server_round, hospital.name if hospital else None, digest=digest)
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
            payload = self.decode_reply(hospital, message.content, limit, tensors, copy=keep_arrays)
        except MalformedPayload as error:
            return RoundReply(hospital, None, f"malformed reply: {error}", up)
        self._replies[hospital.name] = message.content if keep_arrays else RecordDict(
            {name: record for name, record in message.content.items() if not isinstance(record, ArrayRecord)})
        return RoundReply(hospital, payload, None, up)

    def decode_reply(self, hospital: HospitalInfo, content: RecordDict, limit: int, tensors: int,
                     copy: bool = True, training: bool = True) -> Payload:
        """A reply's payload: fedmed's records, or for a hospital that trains the model itself Flower's contract (one
        ArrayRecord, one MetricRecord, any names), its model's tensors sorted into the method's array groups
        (``ServerMethod.flower_reply_arrays``). MalformedPayload says what does not fit."""
        if not hospital.properties.get(TRAINS_ITSELF) or self.masks_own_training(MessageType.TRAIN if training
                                                                                 else MessageType.EVALUATE):
            return from_recorddict(content, limit, self.records, tensors, copy=copy)
        payload = from_flower_reply(content, limit, tensors, copy, with_arrays=training)
        if training:
            payload.arrays = self.engine.method.flower_reply_arrays(payload.arrays["model"])
        return payload

    def reply_folder(self) -> Path | None:
        """Where a round's accepted replies wait, on disk, for the round to close (``<run>/.round-<n>``, removed
        then): the run folder in our own round loop (:meth:`start`) with ``reply-store='disk'``, so the ServerApp
        holds one reply at a time whatever the number of hospitals. None (every reply in memory) under Flower's
        own loop, whose ``Grid.send_and_receive`` has every reply in memory already, and with secure aggregation,
        whose masked vectors are summed as they come."""
        if not self._in_own_loop or self.job.reply_store != "disk" or not self.workflow.stores_replies:
            return None
        return self.job.run_dir

    def pull_at_once(self) -> int:
        """Most replies pulled from the SuperLink at once in a streamed round: as many as fit in
        :data:`PULL_BYTES` at the size of this round's largest message to a hospital (at least one), since Flower
        holds every reply of a pull whole in memory until the pull returns."""
        largest = max(self._bytes_down.values(), default=0)
        return max(1, PULL_BYTES // largest) if largest else 0

    def reply_limit(self) -> int:
        """The most bytes a reply's arrays may take once decoded: ``screening.max-reply-mb``, or 4x the method's
        whole state plus 64 MB (a hospital sends back at most its part of the global model and a few extras)."""
        if self.job.screening.max_reply_mb > 0:
            return int(self.job.screening.max_reply_mb * 1e6)
        state = sum(a.nbytes for a in self.engine.method.global_arrays.values())
        return 4 * state + 64_000_000

    def reply_tensor_limit(self) -> int:
        """The most tensors a reply may hold, counted before any is decoded: twice the method's whole state (a
        hospital sends back at most its part of the global model and a few extras) and 64."""
        return 2 * len(self.engine.method.global_arrays) + 64
