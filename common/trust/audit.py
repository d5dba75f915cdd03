"""An append-only audit log, one JSON object a line, each line chained to the one before it by SHA-256.

Every line holds ``seq`` (its line number, from 1), ``time`` (UTC), ``prev`` (the previous line's ``hash``; 64 zeros
on the first line), what happened (``event`` and its fields) and ``hash``: the SHA-256 of the line's canonical JSON
without ``hash`` (keys sorted, no spaces, ASCII). A line is written in one ``write`` under an exclusive lock on the
file, after the writer has checked the file's last line, so writers in several processes (a hospital's warm worker and
its ClientApp, a new process after a restart) extend one chain and never interleave. :func:`verify` names every line
that was edited, inserted, removed, moved or cut short; whole lines removed from the end leave a shorter valid chain,
which only a hash kept elsewhere shows (``head``; each end of a federation records the other's, see docs/privacy.md).

Plain standard library (``hashlib``, ``json``, ``fcntl``): no Flower, no torch. :func:`message_digest` reads a Flower
message when given one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

GENESIS = "0" * 64  #: ``prev`` of a log's first line
SERVER_HEAD_KEY = "server-audit-head"  #: message config: the server's audit head when it built the message
#: a query's ``query`` value at the end of a run: it carries the server's last audit head for the hospitals to record
RUN_ENDED_QUERY = "run-ended"
AUDIT_HEAD_MARK = "[audit-head "  #: an error reply's reason ends with "[audit-head <hash>]" (no records in errors)
RESERVED = ("seq", "time", "prev", "hash")  #: fields every line has; an event's own fields may not use them
_RESERVED_KEYS = frozenset(RESERVED)
MAX_TEXT = 2000  #: characters kept of any text field (a refusal's reason, an error)
_TAIL = 1 << 12  #: bytes read at a time from the end of the file to find the last line


class AuditError(RuntimeError):
    """The log cannot be extended: its last line is damaged, or the file cannot be written."""


def canonical(record: dict[str, Any]) -> str:
    """The one text form a line may have: sorted keys, no spaces, ASCII, no NaN (``json.dumps`` with those
    options, its C encoder made once: a log is read a line at a time)."""
    return "".join(_ENCODE(record, 0))


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
_ENCODE = (json.encoder.c_make_encoder(None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",",
                                       True, False, False)  # lines are trees: no check for cycles
           if json.encoder.c_make_encoder is not None else _ENCODER.iterencode)


def line_hash(record: dict[str, Any]) -> str:
    """SHA-256 of the line's canonical JSON without its ``hash`` field."""
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k != "hash"}).encode()).hexdigest()


def _clean(value: Any) -> Any:
    """A value as a line holds it: JSON types only, long texts cut, NaN/Inf as None."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "..."
    if isinstance(value, (bool, int)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item"):  # a NumPy scalar
        return _clean(value.item())
    return _clean(str(value))


class AuditLog:
    """An audit log file; :meth:`append` adds one line. Holds no state between calls: every append reads the
    file's last line under the lock, so any number of processes may append to the same file."""

    def __init__(self, path: str | Path, writer: str = ""):
        self.path = Path(path)
        self.writer = writer

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        try:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o640)
            except FileNotFoundError:  # its folder first
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o640)
        except OSError as error:
            raise AuditError(f"audit log {self.path} cannot be opened for writing: {error.strerror or error}") \
                from None
        try:
            _lock(fd)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one line for ``event`` with ``fields``; returns the line as written (with its ``hash``)."""
        return self.append_many([(event, fields)])[0]

    def append_many(self, events: list[tuple[str, dict[str, Any]]], sync: bool = True) -> list[dict[str, Any]]:
        """Write one line per (event, fields), in order, under one lock and with one ``fsync`` (a stage's messages
        to every hospital, say): the same chain as appending them one by one; returns the lines as written.
        ``sync=False``: written (every reader and writer sees them) but made durable by the log's next synced
        append, as a hospital's line for a message it received is by the line for its reply, before the reply
        leaves."""
        for _, fields in events:
            clash = sorted(set(fields) & set(RESERVED))
            if clash:
                raise ValueError(f"audit event fields may not be named {', '.join(clash)}")
        if not events:
            return []
        with self._locked() as fd:
            last = last_line(fd, self.path)
            seq, prev = (last["seq"], last["hash"]) if last else (0, GENESIS)
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            records, chunks = [], []
            for event, fields in events:
                seq += 1
                record: dict[str, Any] = {"seq": seq, "time": now, "prev": prev, "event": event}
                if self.writer:
                    record["writer"] = self.writer
                record.update({k: _clean(v) for k, v in fields.items() if v is not None})
                record["hash"] = prev = line_hash(record)
                records.append(record)
                chunks.append(canonical(record) + "\n")
            data = "".join(chunks).encode()
            status = os.fstat(fd)
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(f"wrote {written} of {len(data)} bytes")
                if sync:
                    os.fsync(fd)
            except OSError as error:
                _LAST.clear()
                raise AuditError(f"audit log {self.path}: lines {records[0]['seq']}-{seq} not written ({error})") \
                    from None
            key, start, last = (status.st_dev, status.st_ino), status.st_size, chunks[-1].encode()
            _LAST[key] = (start + len(data), last, dict(records[-1]))
            own = _OWN.setdefault(key, {})
            own[start] = (start + len(data), [dict(r) for r in records], last)
            while len(own) > _OWN_KEPT:
                del own[next(iter(own))]
        return records

    def head(self) -> str:
        """The hash of the last line (64 zeros for an empty or absent log); the last line is checked."""
        if not self.path.exists():
            return GENESIS
        with self._locked() as fd:
            last = last_line(fd, self.path)
        return last["hash"] if last else GENESIS


def _lock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: one writer per file is the operator's to ensure
        return
    fcntl.flock(fd, fcntl.LOCK_EX)


#: (device, inode) of a log -> (its size, its last line's text, that line) as this process last wrote or checked it
_LAST: dict[tuple[int, int], tuple[int, bytes, dict[str, Any]]] = {}


#: (device, inode) of a log -> start offset -> (end offset, the lines, the last line's text) of this process's own
#: recent appends: a FollowedLog reads lines this process wrote without checking them again
_OWN: dict[tuple[int, int], dict[int, tuple[int, list[dict[str, Any]], bytes]]] = {}
_OWN_KEPT = 256  #: appends remembered per log


def last_line(fd: int, path: Path | str = "audit log") -> dict[str, Any] | None:
    """The file's last line, checked (canonical form, hash); None for an empty file. AuditError when it is cut
    short or does not match its hash: the chain is not extended past a damaged line. A line this process wrote or
    checked is not parsed again while the file ends with the same bytes (same size, same line)."""
    status = os.fstat(fd)
    size = status.st_size
    if size == 0:
        return None
    known = _LAST.get((status.st_dev, status.st_ino))
    if known is not None and known[0] == size and os.pread(fd, len(known[1]), size - len(known[1])) == known[1]:
        return dict(known[2])
    start, tail = size, b""
    while start > 0:
        step = min(_TAIL, start)
        start -= step
        tail = os.pread(fd, step, start) + tail
        if tail.count(b"\n") >= 2 or start == 0:
            break
    if not tail.endswith(b"\n"):
        raise AuditError(f"audit log {path}: its last line is cut short (no newline at its end): a write was "
                         "interrupted or the file was edited. Check it with `fedmed audit verify`; move it aside to "
                         "start a new chain (keep it for the audit)")
    text = tail[:-1].rsplit(b"\n", 1)[-1]
    problem = line_problem(text)
    if problem:
        raise AuditError(f"audit log {path}: its last line {problem}. Check it with `fedmed audit verify`; move it "
                         "aside to start a new chain (keep it for the audit)")
    record = json.loads(text)
    _LAST[status.st_dev, status.st_ino] = (size, text + b"\n", dict(record))
    return dict(record)


def line_problem(text: bytes) -> str | None:
    """What is wrong with one line on its own (not JSON, not canonical, hash mismatch), or None."""
    return _parsed(text)[0]


def _parsed(text: bytes) -> tuple[str | None, dict[str, Any] | None]:
    """(what is wrong with the line on its own, or None; the line read, when nothing is): one parse for both."""
    try:
        decoded = text.decode("utf-8")
        record = json.loads(decoded)
    except (UnicodeDecodeError, ValueError):
        return "is not a JSON object (edited, or cut short)", None
    if not isinstance(record, dict) or not _RESERVED_KEYS <= record.keys():
        return f"is not an audit line (it lacks one of {', '.join(RESERVED)})", None
    if not isinstance(record["seq"], int) or not isinstance(record["hash"], str):
        return "has a seq that is not a number or a hash that is not text", None
    try:
        written = canonical(record)
    except ValueError:
        written = None
    if written == decoded and hashlib.sha256(_without_hash(text, record["hash"])).hexdigest() == record["hash"]:
        return None, record  # canonical, and its text without its hash hashes to it: one JSON dump, not two
    if record["hash"] != line_hash(record):
        return "does not match its hash: its content was edited", None
    if written is None:
        return "holds a value the log never writes (NaN or Infinity)", None
    return "is not written as the log writes lines (its text was edited; the hash still matches its content)", None


def _without_hash(text: bytes, digest: str) -> bytes:
    """A canonical line's text without its ``hash`` member: the canonical text that :func:`line_hash` hashes. The
    first ``"hash":"<digest>"`` is the line's own: one inside a value before it would make the digest a hash of a
    text holding the digest itself."""
    member = b'"hash":"' + digest.encode("ascii", "replace") + b'"'  # a digest that needs escaping: no match
    at = text.find(member)
    if at < 0:
        return text
    before, after = text[:at], text[at + len(member):]
    return before[:-1] + after if before.endswith(b",") else before + after[1:] if after.startswith(b",") else \
        before + after


@dataclass
class Verification:
    """What :func:`verify` found: how many lines, the last line's hash, and every problem by line number."""

    path: Path
    lines: int = 0
    head: str = GENESIS
    problems: list[tuple[int, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def report(self) -> str:
        if self.ok:
            return f"{self.path}: {self.lines} lines, chain intact; last hash {self.head}"
        return "\n".join([f"{self.path}: {len(self.problems)} problem(s) in {self.lines} lines"]
                         + [f"  line {n}: {what}" for n, what in self.problems])


def verify(path: str | Path, head: str | None = None) -> Verification:
    """Check the whole chain: each line on its own (JSON, canonical, hash), its ``seq`` (one more than the line
    before it's, 1 on the first) and its ``prev`` (the hash of the line before it), and that the file ends with a
    newline. ``head``: a hash kept elsewhere (the other end's log, a note) that must be the hash of one of the
    lines, the last one when the log has not grown since; a log cut back past it lacks it."""
    result = Verification(Path(path))
    data = Path(path).read_bytes()
    if not data:
        if head and head != GENESIS:
            result.problems.append((0, f"the log is empty, but hash {head} was recorded for it"))
        return result
    records = _check_chain(data, 1, None, result)
    if head and head not in {record["hash"] for record in records}:
        result.problems.append((result.lines, f"the recorded hash {head} is no line's hash: lines were removed from "
                                              "the end, or the log was rewritten"))
    return result


def _check_chain(data: bytes, first: int, previous: dict[str, Any] | None, result: Verification) -> list[dict]:
    """The lines of ``data`` (lines ``first``.. of a log; ``previous``: the line before them, None at the start),
    each checked on its own and against the one before it; problems and the count and head go into ``result``.
    Returns the lines that are sound on their own."""
    texts = data.split(b"\n")
    cut = texts[-1] != b""
    texts = texts if cut else texts[:-1]
    result.lines = first - 1 + len(texts)
    records, problems, parsed = [], result.problems, _parsed
    for number, text in enumerate(texts[:-1] if cut else texts, start=first):
        problem, record = parsed(text)
        if problem:
            problems.append((number, problem))
            previous = None
            continue
        records.append(record)
        if number == 1:
            expected_seq, expected = 1, GENESIS
        elif previous is not None:
            expected_seq, expected = previous["seq"] + 1, previous["hash"]
        else:
            previous = record
            continue
        if record["seq"] != expected_seq:
            problems.append((number, f"holds seq {record['seq']}, not {expected_seq}: a line before it was removed "
                                     "or inserted, or lines were reordered"))
        if record["prev"] != expected:
            before = "the start of the log" if number == 1 else f"line {number - 1}"
            problems.append((number, f"does not follow {before} (its prev is not {before}'s hash): a line was "
                                     "removed, inserted or moved here"))
        previous = record
    if records:
        result.head = records[-1]["hash"]
    if cut:
        problems.append((result.lines, "is cut short: the file does not end with a newline (a write was "
                                       "interrupted, or the end of the file was removed)"))
    return records


def check_chain(data: bytes, first: int, previous: dict[str, Any] | None, result: Verification) -> list[dict]:
    """:func:`verify`'s check of the lines ``first``.. of a log (``previous``: the line before them), for a reader
    that verifies a long log a piece at a time (``fedmed console``): problems and the count and head go into
    ``result``; returns the lines that are sound on their own."""
    return _check_chain(data, first, previous, result)


class FollowedLog:
    """A log that a reader checks often (a hospital's replay memory and privacy ledger, at every secure stage and
    training): verified whole the first time, then only in the lines added since, each checked on its own and
    chained to the last line verified, so a check costs the new lines and not the log's length. A file replaced,
    cut back, or changed in its last verified line is verified whole again; an edit further back is for
    :func:`verify` to find (``fedmed audit verify``, and every new process's first read)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.inode = (-1, -1)  #: the file's (device, inode)
        self.offset = 0  #: bytes verified
        self.last = b""  #: the last verified line's text and newline
        self.result = Verification(self.path)

    def read(self) -> tuple[Verification, list[dict[str, Any]], bool]:
        """(what verifying found, the sound lines not returned before, whether they start at the log's first
        line). After a problem the next read verifies the whole log again."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self.__init__(self.path)
            return self.result, [], True
        try:
            with contextlib.suppress(ImportError):
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_SH)  # no line half written while it reads
            status = os.fstat(fd)
            inode = (status.st_dev, status.st_ino)
            whole = not (inode == self.inode and status.st_size >= self.offset and self.last
                         and os.pread(fd, len(self.last), self.offset - len(self.last)) == self.last)
            if whole:
                self.__init__(self.path)
            own = None if whole else self._own_lines(inode, status.st_size)
            if own is not None and os.pread(fd, len(own[1]), status.st_size - len(own[1])) != own[1]:
                own = None  # the file does not end with the line this process wrote last there
            data = b"" if own is not None else os.pread(fd, status.st_size - self.offset, self.offset)
        finally:
            os.close(fd)
        if own is not None:  # every new line is one this process wrote, after checking the line before it
            records, self.last = own
            head = records[-1]["hash"] if records else self.result.head
            self.offset, self.result = status.st_size, Verification(self.path, self.result.lines + len(records), head)
            return self.result, records, False
        if not data:
            return self.result, [], whole
        previous = json.loads(self.last) if self.last else None
        result = Verification(self.path, self.result.lines, self.result.head)
        records = _check_chain(data, self.result.lines + 1, previous, result)
        if result.ok:
            self.inode, self.offset, self.result = inode, self.offset + len(data), result
            self.last = data[data.rstrip(b"\n").rfind(b"\n") + 1:]
        else:
            self.__init__(self.path)
        return result, records, whole

    def _own_lines(self, inode: tuple[int, int], size: int) -> tuple[list[dict[str, Any]], bytes] | None:
        """The lines from the verified offset to ``size`` and the last one's text, when this process's own appends
        wrote all of them one after the other; None otherwise."""
        own, at, records, last = _OWN.get(inode, {}), self.offset, [], self.last
        while at < size and at in own:
            end, lines, last = own[at]
            records += [dict(line) for line in lines]
            at = end
        return (records, last) if at == size else None


_FOLLOWED: dict[tuple[Path, str], tuple[FollowedLog, list[dict[str, Any]]]] = {}


def verified_events(path: str | Path, event: str) -> tuple[Verification, list[dict[str, Any]]]:
    """The lines of ``event`` in the log at ``path`` and what verifying the log found (the lines mean nothing
    unless it is ok). Read through a :class:`FollowedLog` kept for the process: each call verifies only the lines
    added since the last. The list is the process's own, extended in place while the log only grows (a new list
    when it was read whole again): read it, do not change it."""
    key = (Path(path).absolute(), event)
    follower, lines = _FOLLOWED.get(key) or (FollowedLog(path), [])
    result, records, whole = follower.read()
    if not result.ok:
        _FOLLOWED.pop(key, None)
        return result, []
    if whole:
        lines = []
    lines.extend(record for record in records if record.get("event") == event)
    _FOLLOWED[key] = (follower, lines)
    return result, lines


def records_of(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each line of a log that is a JSON object, with its line number (a damaged line is skipped: verify names it)."""
    for number, text in enumerate(Path(path).read_bytes().split(b"\n"), start=1):
        try:
            record = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict):
            yield number, record


def cross_check(log: str | Path, other: str | Path, name: str) -> list[tuple[int, str]]:
    """The heads of ``log`` that ``other`` recorded (``peer-audit-head`` on the lines whose ``peer`` is ``name``)
    must each be the hash of a line of ``log``, and some line of ``other`` must be about ``name``: problems as
    (line of ``other``, what, naming the run). Only ``other``'s lines of the runs ``log`` names are checked: a
    server's log holds one run, a hospital's every run it took part in, and one run's log vouches for no other's."""
    hashes, runs = set(), set()
    for _, record in records_of(log):
        if isinstance(record.get("hash"), str):
            hashes.add(record["hash"])
        if isinstance(record.get("run"), str):
            runs.add(record["run"])
    about = [(number, record) for number, record in records_of(other) if record.get("peer") == name]
    if not about:
        peers = sorted({r["peer"] for _, r in records_of(other) if isinstance(r.get("peer"), str)})
        return [(0, f"no line of {other} is about {name!r} (it names {', '.join(peers[:10]) or 'no peer'}): a "
                    "misspelt name proves nothing")]
    mine = [(n, r) for n, r in about if not runs or not isinstance(r.get("run"), str) or r["run"] in runs]
    if not mine:
        named = sorted({str(r.get("run")) for _, r in about})
        return [(about[0][0], f"records {name} only in run(s) {', '.join(named[:10])}, which {log} never names: "
                              "lines were removed from its end or it was rewritten")]
    return [(number, f"run {record.get('run')!r}: records {name}'s audit head {recorded}, which is no line of {log}: "
                     "lines were removed from its end or it was rewritten")
            for number, record in mine
            if (recorded := record.get("peer-audit-head")) and recorded != GENESIS and recorded not in hashes]


def head_in_reason(reason: str) -> str | None:
    """The audit head a hospital put at the end of an error reply's reason, or None."""
    mark = reason.rfind(AUDIT_HEAD_MARK)
    head = reason[mark + len(AUDIT_HEAD_MARK):].rstrip("]") if mark >= 0 else ""
    return head if len(head) == 64 and all(c in "0123456789abcdef" for c in head) else None


def message_digest(message: Any, nbytes: int | None = None) -> dict[str, Any]:
    """A Flower message as the audit log records it: ``sha256``, Flower's object id of the content (the SHA-256 of
    its serialised form, which names each of its arrays and records by their own SHA-256, so it covers every byte;
    the same at both ends), ``bytes``, the whole message serialised as metrics.jsonl's traffic counts it
    (:func:`measure_message`; ``nbytes`` is ignored: both come from one serialisation), and ``error`` for an error
    reply."""
    size, content_id = measure_message(message)
    if message.has_error():
        return {"error": str(message.error.reason), "bytes": size}
    return {"sha256": content_id, "bytes": size}


def measure_message(message: Any) -> tuple[int, str | None]:
    """(bytes of the whole serialised message, Flower's object id of its content or None for an error reply), from
    one serialisation of each of its objects, children first: Flower's own ``object_id`` serialises a record again
    inside every parent that names it (asking a parent for its ``children`` computes their ids), and a
    ConfigRecord, which it never caches, every time it is asked."""
    from flwr.app import ArrayRecord, Message, RecordDict
    from flwr.app.message.array import Array
    from flwr.supercore.inflatable import inflatable_object as flower

    with flower.no_object_id_recompute():  # each object's id, once computed here, is reused by its parents
        computed = flower._get_computed_object_ids()
        total = 0

        def parts(obj: Any) -> list[Any]:
            """An object's children, without computing their ids (which would serialise them once more)."""
            if isinstance(obj, Message):
                return [obj.content] if obj.has_content() else []
            if isinstance(obj, (RecordDict, ArrayRecord)):
                return list(obj.values())
            if isinstance(obj, Array):
                return [chunk for _, chunk in obj.slice_array()]  # ids computed as the array is sliced
            return list((obj.children or {}).values())

        def serialise(obj: Any) -> None:
            nonlocal total
            for child in parts(obj):
                serialise(child)
            data = obj.deflate()  # its children's ids come from the set below
            total += len(data)
            known = obj.__dict__.get("_object_id")
            if known is None or known not in computed:
                obj.__dict__["_object_id"] = known = flower.get_object_id(data)
                computed.add(known)

        serialise(message)
        return int(total), None if message.has_error() else message.content.object_id
