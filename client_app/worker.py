"""A hospital's warm worker: one long-lived process that keeps torch imported and the data loaded.

In a deployment Flower starts a fresh ClientApp process for every message. Importing torch and
loading the hospital's data set there would cost seconds per round (minutes for large volumes),
so that process stays light: it hands the message to this worker over a private Unix socket and
returns the worker's answer. The first message starts the worker; it exits when the SuperNode's
SuperExec (the ClientApp's parent) is gone or after ``IDLE_EXIT`` seconds without a message.
A failure inside the worker comes back as the reason of an error reply, like one in-process. Every
request carries an id that the reply must echo, so a reply can only ever answer the message it was
computed for (a stale answer, e.g. to a message of a run stopped meanwhile, is refused, not passed on).

    python -m client_app.worker SOCKET WATCHED_PID     # started by ask_worker, not by hand
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Mapping

from common.payload import Payload, payload_from_bytes, payload_to_bytes

APP_DIR = Path(__file__).resolve().parent.parent  # the installed app: the worker runs the same code
IDLE_EXIT = 1800.0  # seconds without a message before the worker exits
START_TIMEOUT = 180.0  # seconds for a new worker to import torch and listen
POLL = 2.0  # seconds between checks of the watched process while idle
_LENGTH = struct.Struct("!Q")
log = logging.getLogger("fedmed")


class WorkerFailed(RuntimeError):
    """The worker could not be started or reached, or died while answering."""


def socket_path(node_config: Mapping[str, Any]) -> Path:
    """One socket per app version and node config, in a folder only this user can enter.

    Unix socket paths are limited to about 100 characters, hence the hash instead of the state folder.
    """
    folder = Path(tempfile.gettempdir()) / f"fedmed-workers-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise WorkerFailed(f"{folder} is not private to this user; remove it")
    key = json.dumps([str(APP_DIR), sorted(dict(node_config).items())], default=str)
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.sock"


def _send(connection: socket.socket, data: bytes) -> None:
    connection.sendall(_LENGTH.pack(len(data)) + data)


def _receive(connection: socket.socket) -> bytes:
    def exactly(size: int) -> bytes:
        chunks, left = [], size
        while left:
            chunk = connection.recv(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError("connection closed mid-message")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    (size,) = _LENGTH.unpack(exactly(_LENGTH.size))
    return exactly(size)


# --- the ClientApp's side --------------------------------------------------------------------------
def ask_worker(kind: str, payload: Payload, run_config: Mapping[str, Any], node_config: Mapping[str, Any],
               watch_pid: int | None = None) -> Payload:
    """The worker's answer to one message (``client_app.hospital.answer`` run there).

    A worker started here lives as long as ``watch_pid`` (default: this process's parent, the SuperExec).
    """
    path = socket_path(node_config)
    request_id = uuid.uuid4().hex  # echoed by the worker: a reply to any other request is refused
    request = payload_to_bytes(payload, {"kind": kind, "run-config": dict(run_config),
                                         "node-config": dict(node_config), "request": request_id})
    connection = _connect(path) or _start(path, node_config, watch_pid or os.getppid())
    with connection:
        connection.settimeout(None)  # training takes as long as it takes; the server has the round timeout
        try:
            _send(connection, request)
            reply, header = payload_from_bytes(_receive(connection))
        except (OSError, ConnectionError) as error:
            raise WorkerFailed(f"the hospital's worker stopped while answering ({error}); "
                               f"see {_log_path(path, node_config)}") from None
    if header.get("request") != request_id:
        raise WorkerFailed(f"the hospital's worker answered request {header.get('request')!r}, not this "
                           f"{kind} message's {request_id!r}; reply refused, see {_log_path(path, node_config)}")
    if header.get("error"):
        raise WorkerFailed(header["error"])
    return reply


def _connect(path: Path) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(path))
        return connection
    except OSError:
        connection.close()
        return None


def _log_path(path: Path, node_config: Mapping[str, Any]) -> Path:
    state_dir = node_config.get("state-dir")
    return Path(state_dir) / "worker.log" if state_dir else path.with_suffix(".log")


def _start(path: Path, node_config: Mapping[str, Any], watch_pid: int) -> socket.socket:
    path.unlink(missing_ok=True)  # a socket left by a worker that was killed
    log_path = _log_path(path, node_config)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "client_app.worker", str(path), str(watch_pid)],
                                   cwd=APP_DIR, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + START_TIMEOUT
    while time.time() < deadline:
        connection = _connect(path)
        if connection is not None:
            return connection
        if process.poll() is not None:
            raise WorkerFailed(f"the hospital's worker exited with {process.returncode} at start; see {log_path}")
        time.sleep(0.1)
    process.kill()
    raise WorkerFailed(f"the hospital's worker did not start within {START_TIMEOUT:.0f}s; see {log_path}")


# --- the worker ------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve(path: Path, watched_pid: int) -> None:
    """Answer messages one at a time until the watched process is gone or nothing came for IDLE_EXIT s."""
    from common.trust.sandbox import keep_writable

    from .hospital import answer  # torch, the methods and the data loaders: imported once, here

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    keep_writable(path)  # its own socket, removed at the end even once the process is closed
    listener.listen()
    listener.settimeout(POLL)
    log.info("hospital worker %d listening on %s for the process %d", os.getpid(), path, watched_pid)
    last = time.time()
    try:
        while _alive(watched_pid) and time.time() - last < IDLE_EXIT:
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                continue
            with connection:
                connection.settimeout(None)
                header: dict[str, Any] = {}
                try:
                    payload, header = payload_from_bytes(_receive(connection))
                    reply, error = answer(header["kind"], payload, header["run-config"], header["node-config"]), None
                except Exception as failure:  # reported to the ClientApp, which turns it into an error reply
                    log.error("%s", traceback.format_exc())
                    reply, error = Payload(), f"{type(failure).__name__}: {failure}"
                try:
                    _send(connection, payload_to_bytes(reply, {"error": error, "request": header.get("request")}))
                except OSError as failure:  # the ClientApp is gone (its SuperNode stopped): nothing to answer
                    log.warning("reply not delivered: %s", failure)
            last = time.time()
    finally:
        listener.close()
        path.unlink(missing_ok=True)
        log.info("hospital worker %d stops", os.getpid())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout)
    serve(Path(sys.argv[1]), int(sys.argv[2]))
