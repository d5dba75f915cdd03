"""The process a deployed hospital answers in, closed before the first approved module is imported.

The code a job names (common/trust/code_gate.py) runs in the hospital's own process. From the moment a deployed
hospital starts answering, before it imports anything a message names, and in every thread of the process
(``sys.addaudithook`` is process-wide), this process:

- opens no connection and looks up no name, except Unix sockets and the SuperNode's own API address (its
  ``--runtime-api-address``, or :data:`RUNTIME_API_ENV` as ``fedmed-supernode`` sets it), and binds no port;
- starts no other program (``subprocess``, ``os.system``, ``os.exec*``, ``posix_spawn``): a child would not carry
  this hook; ``os.fork`` does, so data-loader workers still run; the one ``exec`` left is the process's own
  restart, its own command line again (fedmed-supernode's executor restarts so for another app bundle);
- loads no native library through ``ctypes`` (``dlopen``, ``dlsym``);
- writes, creates, moves or removes nothing outside the hospital's own folders (state, data, its policy's
  argument folders, its decoded-image cache); its temporary files go to a folder in its state folder;
- has the model hubs' libraries offline whatever its environment said (``HF_HUB_OFFLINE=0`` becomes 1).

In a ClientApp process (fedmed-supernode's executor, the warm worker, a ``flwr-clientapp``) this lasts for the
life of the process: a thread or a socket an approved module left behind finds it closed after the answer too.
:data:`LIFETIME` ``"answer"`` reopens it when the answer ends, for harnesses that answer in their own process
(the tests). An audit hook stops Python's own ways out; a compiled extension or code that edits this module's
state gets past it, which is why a deployment also runs the ClientApp where the OS gives it no route out
(docs/deployment.md: its own network namespace, or compose's internal network).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

#: the SuperNode's API address (``host:port``) a ClientApp process may still reach; fedmed-supernode sets it
RUNTIME_API_ENV = "FEDMED_RUNTIME_API_ADDRESS"
#: "life": closed until the process ends (every ClientApp process); "answer": reopened after each answer
LIFETIME = "life"
#: Libraries that fetch models and data sets: made to use their local caches only.
HUB_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

_NETWORK = frozenset({"socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
                      "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg",
                      "urllib.Request", "http.client.connect", "ftplib.connect", "smtplib.connect",
                      "poplib.connect", "imaplib.open", "nntplib.connect", "telnetlib.Telnet.open",
                      "webbrowser.open"})
_PROGRAMS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
                       "pty.spawn"})
_NATIVE = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"})
#: events whose arguments name files they change: (event, positions of the paths)
_FILE_CHANGES = {"os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.symlink": (1,),
                 "os.link": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
                 "os.mkfifo": (0,), "os.mknod": (0,), "shutil.rmtree": (0,), "os.removexattr": (0,),
                 "os.setxattr": (0,)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Refused(PermissionError):
    """Code running at a closed hospital tried to leave it: a connection, a program, a native library, a write."""


@dataclass
class _Closure:
    writable: tuple[Path, ...] = ()
    endpoints: frozenset[tuple[str, int]] = frozenset()
    files: set[Path] = field(default_factory=set)  #: single files of the process's own (:func:`keep_writable`)
    open_for: int = 0  #: answers in progress (LIFETIME "answer")
    for_life: bool = False
    saved: dict[str, Any] = field(default_factory=dict)

    @property
    def closed(self) -> bool:
        return self.for_life or self.open_for > 0


_STATE = _Closure()
_LOCK = threading.Lock()
_HOOKED = False


def endpoints_allowed() -> frozenset[tuple[str, int]]:
    """The SuperNode API address this ClientApp process talks to (env :data:`RUNTIME_API_ENV`, or a
    ``flwr-clientapp``'s ``--runtime-api-address``): the one TCP destination left open."""
    named = [os.environ.get(RUNTIME_API_ENV, "")]
    argv = sys.argv
    named += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--runtime-api-address"]
    named += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--runtime-api-address=")]
    found = set()
    for address in filter(None, named):
        host, _, port = address.rpartition(":")
        if port.isdigit():
            host = host.strip("[]")
            found.add((host, int(port)))
            with contextlib.suppress(OSError):  # the addresses a client connects to for that name
                found.update((info[4][0], int(port)) for info in socket.getaddrinfo(host, int(port)))
    return frozenset(found)


def _refuse(what: str) -> None:
    raise Refused(f"{what}: a hospital reaches no network, starts no program, loads no native library and writes "
                  "nowhere but its own folders while it runs the code a job names")


def _inside(path: Any) -> bool:
    if isinstance(path, int):  # an open file descriptor: opened before, where it was allowed
        return True
    try:
        resolved = Path(os.path.realpath(os.fsdecode(path)))
    except (TypeError, ValueError):
        return False
    return resolved in _STATE.files or any(resolved == root or root in resolved.parents for root in _STATE.writable)


def keep_writable(path: str | Path) -> None:
    """``path``, one file the process itself made before it was closed (the warm worker's socket), it may still
    remove once closed."""
    _STATE.files.add(Path(os.path.realpath(path)))


def _network_allowed(event: str, args: tuple) -> bool:
    if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
        family = getattr(args[0], "family", None)
        if family == getattr(socket, "AF_UNIX", None):  # a local socket (the warm worker's, a loader's queue)
            return True
        address = args[1] if len(args) > 1 else None
        return event == "socket.connect" and isinstance(address, tuple) and len(address) >= 2 and \
            (str(address[0]), address[1]) in _STATE.endpoints
    if event == "socket.getaddrinfo":  # only the API's own host, written as it is (no lookup of another name)
        return any(str(args[0]) == host and args[1] in (port, str(port)) for host, port in _STATE.endpoints)
    return False


def _restarts_itself(args: tuple) -> bool:
    """``os.execv(sys.executable, [sys.executable, *sys.argv, "--token", ...])``: this very program again, with at
    most a task token added (what fedmed-supernode's executor does to load another app bundle)."""
    path, argv = args[0], [os.fsdecode(arg) for arg in args[1]]
    own = [arg for i, arg in enumerate(sys.argv) if arg != "--token" and (i == 0 or sys.argv[i - 1] != "--token")]
    return os.fsdecode(path) == sys.executable and argv[:len(own) + 1] == [sys.executable, *own] and \
        (len(argv) == len(own) + 1 or (len(argv) == len(own) + 3 and argv[-2] == "--token"))


def _audit(event: str, args: tuple) -> None:
    if not _STATE.closed:
        return
    if event in _NETWORK:
        if not _network_allowed(event, args):
            _refuse(f"{event} {args[1:2]!r}")
    elif event in _PROGRAMS:
        if not (event == "os.exec" and _restarts_itself(args)):
            _refuse(f"{event} {args[0]!r}")
    elif event in _NATIVE:
        _refuse(f"{event} {args[0]!r}")
    elif event == "open":
        path, mode, flags = args
        writes = any(c in str(mode or "") for c in "wax+") or bool((flags or 0) & _WRITE_FLAGS)
        if writes and not _inside(path):
            _refuse(f"a write to {os.path.basename(os.fsdecode(path)) if not isinstance(path, int) else path}")
    elif event in _FILE_CHANGES:
        for position in _FILE_CHANGES[event]:
            if position < len(args) and args[position] is not None and not _inside(args[position]):
                _refuse(f"{event} of {os.path.basename(os.fsdecode(args[position]))}")


def _force_hubs_offline() -> dict[str, Any]:
    """Every hub library's offline switch on, in the environment and in any such library already imported; what
    was there before (restored when an ``"answer"`` closure ends)."""
    saved = {name: os.environ.get(name) for name in HUB_OFFLINE}
    os.environ.update(HUB_OFFLINE)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        saved["huggingface_hub.constants"] = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = True
    return saved


def _restore(saved: dict[str, Any]) -> None:
    for name in HUB_OFFLINE:
        if saved.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved[name]
    if "huggingface_hub.constants" in saved:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = saved["huggingface_hub.constants"]


@contextlib.contextmanager
def closed(writable: tuple[str | Path, ...]) -> Iterator[None]:
    """While inside (and, with :data:`LIFETIME` "life", until the process ends) this process is closed as the
    module says; ``writable``: the hospital's own folders. Python's audit hooks cannot be removed, so the hook is
    added once and reads :data:`_STATE`."""
    global _HOOKED
    roots = tuple(Path(os.path.realpath(folder)) for folder in writable if folder)
    private_tmp = roots[0] / "tmp" if roots else None
    with _LOCK:
        if private_tmp is not None:
            private_tmp.mkdir(parents=True, exist_ok=True)
        if not _STATE.closed:
            _STATE.saved = {**_force_hubs_offline(), "tempdir": tempfile.tempdir}
        else:
            _force_hubs_offline()
        _STATE.writable, _STATE.endpoints = roots, endpoints_allowed()
        tempfile.tempdir = str(private_tmp) if private_tmp is not None else tempfile.tempdir
        _STATE.open_for += 1
        _STATE.for_life = _STATE.for_life or LIFETIME == "life"
        if not _HOOKED:
            sys.addaudithook(_audit)
            _HOOKED = True
    try:
        yield
    finally:
        with _LOCK:
            _STATE.open_for -= 1
            if not _STATE.closed:
                tempfile.tempdir = _STATE.saved.pop("tempdir", None)
                _restore(_STATE.saved)
