"""Starting and stopping Flower processes and runs: used by the ``fedmed`` CLI, the deploy scripts'
tests and the benchmarks.

Every process starts in its own session and carries a launch mark in its environment
(``FEDMED_LAUNCH_ID``, inherited by all it spawns). Stopping it collects its whole process tree
first (SuperExec, ``flwr-simulation``, Ray's GCS, raylet and workers, ClientApp processes: some of
them start sessions of their own), then everything still carrying its mark (orphans reparented to
init) and their trees, and every process seen in its tree while it ran, sends them SIGTERM and, after
a grace period, SIGKILL. The last is a census a background thread takes every
:data:`CENSUS_INTERVAL` seconds: a process whose parent was killed (Ray's agents after a SIGKILL of
the ServerApp that started Ray) is no descendant any more, and its mark may be unreadable (Ray's
``setproctitle`` overwrites the environment ``/proc/<pid>/environ`` shows; a process may also start
with a fresh environment), but it was seen in the tree before, with its start time (so a reused PID
is never taken for it). Processes still running when the
launching program exits are stopped by an ``atexit`` hook, and a program that starts Flower
processes turns SIGTERM/SIGHUP into ``SystemExit`` (unless it set its own handlers), so ``timeout``
or a closed terminal unwinds its ``finally`` blocks too. All processes share one ``FLWR_HOME``
whose ``config.toml`` names the SuperLink connections; ``flwr run`` reports success even when a
run fails, so :func:`wait_for_run` polls the run's status until it is finished.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

BIN = Path(sys.executable).parent
PROJECT_ROOT = Path(__file__).resolve().parent.parent
SUPERNODE_WITH_EXECUTOR = PROJECT_ROOT / "deploy" / "fedmed_supernode.py"  # fedmed-supernode (deploy/)


def flower_env(home: Path) -> dict[str, str]:
    """Environment for every Flower process: private FLWR_HOME, no telemetry, no dependency installs.

    The SuperLink and SuperNode start ``flower-superexec`` and ``flwr-clientapp`` by name, so this
    environment's ``bin`` leads PATH even when the venv is not activated (as in CI).
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.update({
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        # a virtual hospital Ray gave no GPU sees none (it trains on the CPU as asked), instead of every such
        # hospital piling onto GPU 0 (common/devices.py)
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process {process.pid} exited with {process.returncode} before {host}:{port} opened"
                               f"{_log_tail_of(process)}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{host}:{port} did not open within {timeout:.0f}s")


def tail_of(log_path: Path | None, lines: int = 40) -> str:
    """The last lines of a log file ("" when there is none)."""
    try:
        return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-lines:]) if log_path else ""
    except OSError:
        return ""


def _log_tail_of(process: subprocess.Popen) -> str:
    """The end of the log of a process started by :func:`start_process`, for error messages."""
    log_path = getattr(process, "log_path", None)
    return f"; the end of its log {log_path}:\n{tail_of(log_path, 30)}" if log_path else ""


# --- process trees -------------------------------------------------------------------------------
#: Environment variable every process started here carries (and passes on to what it spawns).
LAUNCH_MARK = "FEDMED_LAUNCH_ID"
PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessInfo:
    """One line of ``/proc/<pid>/stat``: enough to walk trees and to tell a PID from its reuse."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    start: int  # clock ticks after boot: a reused PID has another
    state: str  # "Z": a zombie, already dead


def _stat(pid: int) -> ProcessInfo | None:
    try:
        data = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses
    return ProcessInfo(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0].decode())


def process_table() -> dict[int, ProcessInfo]:
    """Every process on this machine ({} where there is no /proc)."""
    table = {}
    try:
        entries = [int(e.name) for e in os.scandir(PROC) if e.name.isdigit()]
    except OSError:
        return {}
    for pid in entries:
        info = _stat(pid)
        if info is not None:
            table[pid] = info
    return table


def process_tree(roots: Iterable[int], table: Mapping[int, ProcessInfo] | None = None) -> dict[int, ProcessInfo]:
    """The processes ``roots`` and all their descendants, and the members of their sessions and process
    groups (a root started with its own session names both), as they are now."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    roots = [pid for pid in roots if pid in table]
    found: dict[int, ProcessInfo] = {}
    todo = list(roots)
    todo += [i.pid for i in table.values() if any(i.sid == r or i.pgid == r for r in roots) and i.pid > 1]
    while todo:
        pid = todo.pop()
        if pid in found or pid not in table or pid == os.getpid():
            continue
        found[pid] = table[pid]
        todo += children.get(pid, [])
    return found


def marked_processes(marks: Iterable[str], table: Mapping[int, ProcessInfo] | None = None) -> dict[int, ProcessInfo]:
    """Processes whose environment carries one of these launch marks (see :data:`LAUNCH_MARK`)."""
    wanted = {f"{LAUNCH_MARK}={mark}".encode() for mark in marks}
    if not wanted:
        return {}
    table = process_table() if table is None else table
    found = {}
    for pid, info in table.items():
        if pid == os.getpid() or info.state == "Z":
            continue
        try:
            environ = (PROC / str(pid) / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if wanted.intersection(environ.split(b"\0")):
            found[pid] = info
    return found


def _alive(procs: Mapping[int, ProcessInfo]) -> dict[int, ProcessInfo]:
    """Those of ``procs`` still running: same PID and start time, not a zombie."""
    alive = {}
    for pid, info in procs.items():
        now = _stat(pid)
        if now is not None and now.start == info.start and now.state != "Z":
            alive[pid] = info
    return alive


def _signal(procs: Mapping[int, ProcessInfo], signum: int) -> None:
    for pid in _alive(procs):
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _still_there(known: Mapping[int, ProcessInfo], table: Mapping[int, ProcessInfo]) -> dict[int, ProcessInfo]:
    """Those of ``known`` that ``table`` still holds: same PID and start time (not a reused PID)."""
    return {pid: table[pid] for pid, info in known.items() if pid in table and table[pid].start == info.start}


def _collect(roots: Iterable[int], marks: Iterable[str],
             known: Mapping[int, ProcessInfo] | None = None) -> dict[int, ProcessInfo]:
    """``roots``, the processes carrying one of ``marks`` and those of ``known`` still running, with all their
    descendants and the members of their sessions and process groups."""
    table = process_table()
    seeds = [pid for pid in roots if pid in table]
    seeds += list(marked_processes(marks, table)) + list(_still_there(known or {}, table))
    return process_tree(seeds, table)


def terminate_tree(roots: Iterable[int], marks: Iterable[str] = (), grace: float = 10.0, kill_wait: float = 10.0,
                   reap: Iterable[subprocess.Popen] = (), poll: float = 0.2, at_once: bool = False,
                   known: Mapping[int, ProcessInfo] | None = None) -> list[int]:
    """Stop ``roots``, all their descendants, every process carrying one of ``marks`` and every process of
    ``known`` (seen in the tree earlier, :meth:`ManagedProcess.take_census`) still running, with their trees:
    SIGTERM, then SIGKILL to whatever still runs after ``grace`` seconds (``at_once``: SIGKILL only). The tree is
    collected before the first signal (a parent's death hands its children to init), again while waiting (for
    processes started meanwhile) and once more when all seem gone (a process started by one that was dying).
    ``reap``: our own children among them, waited for so that none is left a zombie. Returns the PIDs still alive
    ``kill_wait`` seconds after SIGKILL (none, unless a process hangs in the kernel)."""
    roots, marks, reap, known = list(roots), list(marks), list(reap), dict(known or {})
    steps = [(signal.SIGKILL, kill_wait)] if at_once else [(signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)]
    if not PROC.is_dir():  # no /proc (not Linux): each root's session is all we can reach
        for signum, seconds in steps:
            for pid in roots:
                try:
                    os.killpg(pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + seconds
            while any(p.poll() is None for p in reap) and time.monotonic() < deadline:
                time.sleep(poll)
        return [p.pid for p in reap if p.poll() is None]
    targets = _collect(roots, marks, known)
    signalled: dict[int, ProcessInfo] = {}
    for signum, seconds in steps:
        deadline = time.monotonic() + seconds
        while True:
            fresh = {pid: info for pid, info in _alive(targets).items() if signalled.get(pid) != info}
            _signal(fresh, signum)
            signalled.update(fresh)
            for process in reap:
                process.poll()
            if not _alive(targets):  # a last look for what was started meanwhile and has no living ancestor left
                late = {pid: info for pid, info in _alive(_collect([], marks, known)).items()
                        if targets.get(pid) != info}
                if not late or time.monotonic() >= deadline:
                    break
                targets.update(late)
                continue
            if time.monotonic() >= deadline:
                break
            time.sleep(poll)
            # descendants started since, and processes that escaped (reparented, new sessions)
            targets.update(_collect(list(_alive(targets)), marks, known))  # (a reaped root's PID may be reused)
        signalled = {}
        if not _alive(targets):
            break
    for process in reap:
        process.poll()
    return sorted(_alive(targets))


@dataclass
class ManagedProcess:
    """A started Flower process; ``stop()`` ends it and everything it spawned."""

    name: str
    process: subprocess.Popen
    log_path: Path
    mark: str = ""  # its LAUNCH_MARK value: inherited by all it spawns
    #: every process seen in its tree while it ran (itself included), kept while it runs: see :meth:`take_census`
    members: dict[int, ProcessInfo] = field(default_factory=dict, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def take_census(self, table: Mapping[int, ProcessInfo] | None = None) -> dict[int, ProcessInfo]:
        """Remember every process now in the tree of its members still running (itself, and what they spawned),
        forget those that ended. A member whose parent is killed later is reparented to init and, under Ray,
        hides its launch mark (``setproctitle`` overwrites the environment /proc shows): :meth:`stop` ends it
        all the same. Taken every :data:`CENSUS_INTERVAL` seconds by a background thread, and before a stop."""
        table = process_table() if table is None else table
        with _CENSUS_LOCK:
            alive = _still_there(self.members, table)
            self.members = {**alive, **process_tree(list(alive), table)} if alive else {}
            return dict(self.members)

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 10.0) -> list[int]:
        """SIGTERM to it and to all it spawned, SIGKILL to what is left after ``grace`` seconds; returns the
        PIDs that outlived even SIGKILL (normally none)."""
        return self._end(grace=grace, at_once=False)

    def kill(self) -> None:
        """End it at once (SIGKILL to it and all it spawned), as a crash or a pulled plug would: nothing is
        flushed."""
        self._end(grace=0.0, at_once=True)

    def _end(self, grace: float, at_once: bool) -> list[int]:
        # Once reaped, its PID may belong to someone else: then only the mark and the census (PIDs with their
        # start times) find what it left behind.
        roots = [self.pid] if self.process.poll() is None else []
        known = self.take_census() if PROC.is_dir() else {}
        left = terminate_tree(roots, [self.mark] if self.mark else [], grace=grace, reap=[self.process],
                              at_once=at_once, known=known)
        if self.process.poll() is None:
            self.process.wait(timeout=5)
        _forget(self)
        return left

    def log_tail(self, lines: int = 40) -> str:
        return tail_of(self.log_path, lines)


#: Processes started here and not stopped yet, in the order they started: stopped at exit.
_LIVE: list[ManagedProcess] = []
#: Marks of processes being started (interrupted between fork and registration: found by their mark).
_PENDING: set[str] = set()


def _forget(process: ManagedProcess) -> None:
    for i, live in enumerate(_LIVE):
        if live is process:
            del _LIVE[i]
            return


#: Seconds between two censuses of the started processes' trees (:meth:`ManagedProcess.take_census`): about 10 ms
#: of one core each for a hundred processes on this machine.
CENSUS_INTERVAL = 1.0
_CENSUS_LOCK = threading.Lock()
_census_thread: threading.Thread | None = None


def take_census() -> None:
    """One census of every process started here and not stopped yet."""
    live = list(_LIVE)
    if live and PROC.is_dir():
        table = process_table()
        for process in live:
            process.take_census(table)


def _census_loop() -> None:
    while True:
        time.sleep(CENSUS_INTERVAL)
        try:
            take_census()
        except Exception:  # best effort, never the end of the thread (a process vanishing mid-read, ...)
            pass


def _start_census() -> None:
    global _census_thread
    with _CENSUS_LOCK:
        if _census_thread is None or not _census_thread.is_alive():
            _census_thread = threading.Thread(target=_census_loop, name="fedmed-process-census", daemon=True)
            _census_thread.start()


def running_processes() -> list[ManagedProcess]:
    """Processes started by :func:`start_process` in this program and not stopped yet, the newest first."""
    return _LIVE[::-1]


def stop_all(grace: float = 5.0, keep: Iterable[ManagedProcess] = ()) -> None:
    """Stop every process started here and not stopped yet (but those in ``keep``), with everything it spawned,
    newest first: the SuperNodes before their SuperLink."""
    keep = list(keep)
    for process in running_processes():
        if any(process is kept for kept in keep):
            continue
        try:
            process.stop(grace)
        except Exception as error:  # at exit: carry on with the others
            print(f"could not stop {process.name} (pid {process.pid}): {error}", file=sys.stderr)
            _forget(process)
    if _PENDING:
        terminate_tree([], list(_PENDING), grace=grace)
        _PENDING.clear()


atexit.register(stop_all)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def exit_on_termination() -> None:
    """SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` so that ``finally`` blocks and the ``atexit`` hook
    stop the Flower processes (their default action would end this program and leave them running). Handlers
    a program set itself are kept; only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _exit_on_signal)


def start_process(name: str, args: list[str], home: Path, log_dir: Path, env: Mapping[str, str] | None = None,
                  cwd: Path | None = None) -> ManagedProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    exit_on_termination()
    mark = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {**dict(env or flower_env(home)), LAUNCH_MARK: mark}
    _PENDING.add(mark)  # a signal between fork and the line below still leaves a mark stop_all finds
    with log_path.open("ab") as handle:
        process = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   start_new_session=True)
    process.log_path = log_path  # read back by wait_for_port's error message
    managed = ManagedProcess(name, process, log_path, mark)
    info = _stat(process.pid)
    if info is not None:
        managed.members[process.pid] = info
    _LIVE.append(managed)
    _PENDING.discard(mark)
    if PROC.is_dir():
        _start_census()
    return managed


@dataclass
class TLSFiles:
    """A SuperLink's CA certificate, certificate and key (see ``deploy/make_certificates.sh``)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass
class FlowerHome:
    """A private FLWR_HOME holding the connections ``flwr`` commands use."""

    path: Path
    connections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def add_connection(self, name: str, address: str, root_certificates: Path | None = None) -> None:
        entry: dict[str, Any] = {"address": address}
        if root_certificates is None:
            entry["insecure"] = True
        else:
            entry["root-certificates"] = str(Path(root_certificates).resolve())
        self.connections[name] = entry
        self._write()

    def _write(self) -> None:
        lines = ["[superlink]", f'default = "{next(iter(self.connections))}"', ""]
        for name, entry in self.connections.items():
            lines.append(f"[superlink.{name}]")
            for key, value in entry.items():
                lines.append(f"{key} = {json.dumps(value)}")
            lines.append("")
        (self.path / "config.toml").write_text("\n".join(lines))

    @property
    def env(self) -> dict[str, str]:
        return flower_env(self.path)


def start_superlink(home: FlowerHome, port: int, *, simulation: bool, host: str = "127.0.0.1",
                    tls: TLSFiles | None = None, supernode_auth: bool = False, database: Path | None = None,
                    log_dir: Path | None = None, extra: list[str] | None = None, timeout: float = 60.0,
                    connection: str = "local", netns: str | None = None, in_memory: bool = False) -> ManagedProcess:
    """Start a SuperLink (simulation or deployment) and register it as ``connection`` in FLWR_HOME.

    Its state lives in ``database`` (default: a file in FLWR_HOME), or in memory with ``in_memory``."""
    args = [str(BIN / "flower-superlink"), "--host", host, "--port", str(port),
            "--disable-runtime-dependency-installation"]
    if not in_memory:
        args += ["--database", str(database or (home.path / f"superlink-{port}.db"))]
    if simulation:
        args.append("--simulation")
    if tls is None:
        args.append("--insecure")
    else:
        args += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
                 "--ssl-keyfile", str(tls.server_key)]
    if supernode_auth:
        args.append("--enable-supernode-auth")
    args += extra or []
    if netns:
        args = ["ip", "netns", "exec", netns, *args]
    process = start_process(f"superlink-{port}", args, home.path, log_dir or home.path / "logs", home.env)
    if not netns:
        wait_for_port(host, port, timeout, process.process)
    home.add_connection(connection, f"{host}:{port}", tls.ca_cert if tls else None)
    return process


def start_supernode(home: FlowerHome, superlink: str, port: int, node_config: Mapping[str, Any], *,
                    host: str = "127.0.0.1", root_certificates: Path | None = None, auth_key: Path | None = None,
                    log_dir: Path | None = None, name: str | None = None, netns: str | None = None,
                    extra: list[str] | None = None, env: Mapping[str, str] | None = None,
                    executor: bool = True) -> ManagedProcess:
    """Start one hospital's SuperNode connected to ``superlink`` ("host:port"); ``env`` adds to its environment.

    ``executor``: as ``deploy/`` starts it, ``fedmed-supernode`` (one long-lived ClientApp process beside the
    SuperNode); False: plain ``flower-supernode``, whose SuperExec starts a ClientApp process per message.
    """
    command = [sys.executable, str(SUPERNODE_WITH_EXECUTOR)] if executor else [str(BIN / "flower-supernode")]
    if executor and "approved-apps" not in node_config and "policy-file" not in node_config:
        node_config = {**node_config, "approved-apps": project_app_hash()}  # as deploy/start_supernode.sh approves
    args = [*command, "--superlink", superlink, "--host", host, "--port", str(port),
            "--node-config", format_config(node_config)]
    if root_certificates is None:
        args.append("--insecure")
    else:
        args += ["--root-certificates", str(root_certificates)]
    if auth_key is not None:
        args += ["--auth-supernode-private-key", str(auth_key)]
    args += extra or []
    if netns:
        args = ["ip", "netns", "exec", netns, *args]
    return start_process(name or f"supernode-{port}", args, home.path, log_dir or home.path / "logs",
                         {**home.env, **dict(env or {})}, cwd=PROJECT_ROOT)


@functools.lru_cache(maxsize=1)
def project_app_hash() -> str:
    """The SHA-256 of this checkout's app bundle, as `flwr run .` builds it (`fedmed app-hash .`)."""
    from flwr.cli.build import build_fab_from_disk

    return hashlib.sha256(build_fab_from_disk(PROJECT_ROOT)).hexdigest()


def format_config(values: Mapping[str, Any]) -> str:
    """``{"a": 1, "b": "x"}`` -> ``a=1 b="x"``, the TOML-ish form of --run-config and --node-config."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            parts.append(f"{key}={value}")
        else:
            parts.append(f"{key}={quoted(key, str(value))}")
    return " ".join(parts)


def quoted(key: str, text: str) -> str:
    """``text`` as Flower's command-line parser reads a string (a TOML string that holds no quote of its own kind:
    a JSON object such as model-args goes in single quotes); ValueError naming ``key`` for what it cannot carry."""
    if '"' not in text and "\n" not in text:
        return json.dumps(text)
    if "'" not in text and "\n" not in text:
        return f"'{text}'"
    raise ValueError(f"run config key {key!r}: {text!r} holds both ' and \" (or a line break), which Flower's "
                     "--run-config cannot carry; put the value in a file")


def flwr(home: FlowerHome, *args: str, timeout: float = 120.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flwr"), *args], env=home.env, cwd=cwd or PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def simulation_resources(hospitals: int, given: Mapping[str, Any], gpus: int | None = None) -> dict[str, Any]:
    """Flower's federation config for ``hospitals`` virtual hospitals: where GPUs are visible and the user set no
    ``client-resources-num-gpus``, each hospital gets an equal share of them (4 hospitals on 1 GPU: 0.25 each,
    sharing it; 8 on 4: 0.5 each, Ray spreading them over the 4), so none trains on the CPU unasked."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    resources = {"num-supernodes": hospitals, **given}
    if gpus and "client-resources-num-gpus" not in given:
        resources["client-resources-num-gpus"] = round(min(1.0, gpus / max(hospitals, 1)), 4)
    return resources


def submit_run(home: FlowerHome, connection: str, run_config: Mapping[str, Any] | None = None,
               federation_config: Mapping[str, Any] | None = None, app_dir: Path = PROJECT_ROOT) -> int:
    """``flwr run``: returns the run id (raises with Flower's message when submission fails)."""
    args = ["run", str(app_dir), connection, "--format", "json"]
    if run_config:
        args += ["--run-config", format_config(run_config)]
    if federation_config:
        args += ["--federation-config", format_config(federation_config)]
    done = flwr(home, *args)
    try:
        reply = json.loads(done.stdout[done.stdout.index("{"):])
    except ValueError:
        reply = {}
    if not reply.get("success"):
        raise RuntimeError(f"flwr run failed: {done.stdout.strip()} {done.stderr.strip()}")
    return int(reply["run-id"])


def run_status(home: FlowerHome, connection: str, run_id: int) -> str:
    done = flwr(home, "ls", connection, "--run-id", str(run_id), "--format", "json", timeout=60)
    try:
        reply = json.loads(done.stdout[done.stdout.index("{"):])
        return str(reply["runs"][0]["status"])
    except (ValueError, KeyError, IndexError):
        return "unknown"


def wait_for_run(home: FlowerHome, connection: str, run_id: int, timeout: float, poll: float = 4.0,
                 on_poll=None) -> str:
    """Poll until the run is finished; return its final status (e.g. ``finished:completed``).

    Each poll is a ``flwr ls`` process (about a second of CPU), so polls are a few seconds apart.
    """
    deadline = time.time() + timeout
    status = "unknown"
    while time.time() < deadline:
        status = run_status(home, connection, run_id)
        if on_poll is not None:
            on_poll(status)
        if status.startswith("finished"):
            return status
        time.sleep(poll)
    raise TimeoutError(f"run {run_id} not finished after {timeout:.0f}s (last status {status})")


def run_log(home: FlowerHome, connection: str, run_id: int) -> str:
    done = flwr(home, "log", str(run_id), connection, "--show", timeout=60)
    return done.stdout + done.stderr
