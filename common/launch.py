"""Starting and stopping Flower processes and runs: used by the ``fedmed`` CLI, the deploy scripts'
tests and the benchmarks.

Every process starts in its own session, so stopping it (by PID) also stops what it spawned
(SuperExec, ClientApp processes, Ray). All of them share one ``FLWR_HOME`` whose ``config.toml``
names the SuperLink connections; ``flwr run`` reports success even when a run fails, so
:func:`wait_for_run` polls the run's status until it is finished.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

BIN = Path(sys.executable).parent
PROJECT_ROOT = Path(__file__).resolve().parent.parent


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
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
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


@dataclass
class ManagedProcess:
    """A started Flower process; ``stop()`` ends it and everything it spawned."""

    name: str
    process: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        try:  # leftovers in the session (ClientApp processes, Ray workers) go too
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.process.poll() is None:
            self.process.wait(timeout=5)

    def kill(self) -> None:
        """End it at once (SIGKILL to its session), as a crash or a pulled plug would: nothing is flushed."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        return tail_of(self.log_path, lines)


def start_process(name: str, args: list[str], home: Path, log_dir: Path, env: Mapping[str, str] | None = None,
                  cwd: Path | None = None) -> ManagedProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    handle = log_path.open("ab")
    process = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=dict(env or flower_env(home)),
                               cwd=cwd, start_new_session=True)
    handle.close()
    process.log_path = log_path  # read back by wait_for_port's error message
    return ManagedProcess(name, process, log_path)


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
                    extra: list[str] | None = None) -> ManagedProcess:
    """Start one hospital's SuperNode connected to ``superlink`` ("host:port")."""
    args = [str(BIN / "flower-supernode"), "--superlink", superlink, "--host", host, "--port", str(port),
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
    return start_process(name or f"supernode-{port}", args, home.path, log_dir or home.path / "logs", home.env,
                         cwd=PROJECT_ROOT)


def format_config(values: Mapping[str, Any]) -> str:
    """``{"a": 1, "b": "x"}`` -> ``a=1 b="x"``, the TOML-ish form of --run-config and --node-config."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            parts.append(f"{key}={value}")
        else:
            parts.append(f"{key}={json.dumps(str(value))}")
    return " ".join(parts)


def flwr(home: FlowerHome, *args: str, timeout: float = 120.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flwr"), *args], env=home.env, cwd=cwd or PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout)


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
