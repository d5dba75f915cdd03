#!/usr/bin/env python3
"""``fedmed-supernode``: Flower's SuperNode with one long-lived ClientApp process instead of one per message.

    fedmed-supernode [flower-supernode's arguments]        # e.g. deploy/start_supernode.sh, docker-compose.yml

Flower 1.42's SuperNode hands every message to its SuperExec, which starts a fresh ``flwr-clientapp``
process for it: Python, Flower, the FAB's installation and the app's imports, several seconds per
message on a small machine before any work is done (benchmarks/results/overhead.md). Flower offers no
setting that keeps a ClientApp process alive outside Kubernetes, so this script starts
``flower-supernode --isolation process`` (the SuperNode without its own SuperExec) and takes the
SuperExec's place with an executor that runs each ClientApp task in itself, with Flower's own task
functions (``pull_task_input``, ``push_message``, ``push_task_output``): the loaded app, torch and the
hospital's data stay in memory between messages.

What a fresh process per message guaranteed still holds:
- a task always runs its own FAB's code: a task of another FAB than the one loaded restarts the
  executor (``os.execv``) before it is pulled (one that names no FAB until its pull is refused with an
  error reply, and the executor restarts for the next);
- a task stopped by the server (``flwr stop``; the task heartbeat says so) ends at once, as Flower ends
  a ClientApp process: the executor restarts, so nothing of the stopped task can be pushed later;
- one task at a time, each pulled and answered with its own token, so a reply can only answer the
  message it was computed for;
- an exception in the app becomes an error reply, as in ``flwr-clientapp``; the executor goes on.

The hospital approves the apps it runs: a FAB whose SHA-256 is not among its node config's ``approved-apps`` and
its policy file's ``apps`` is refused before it is installed or loaded, with an error reply naming the hash
(``fedmed app-hash APP_DIR`` shows an app's hash and files for review). Without either list it does not start:
only ``--any-app`` (a closed test network's opt-out, logged as a warning at start and with every task) runs
whatever app the SuperLink sends, as Flower does. Flower's own ``--trusted-entities`` checks signatures that only
apps fetched from Flower Hub carry; it still applies to those.

Flower's SuperNode itself runs in this script's own process (``--fedmed-supernode``) with shorter waits
(:class:`SuperNodeClock`): Flower 1.42 sleeps 3 s after every poll of the SuperLink that found no message,
0.5 s between looks for the reply it is to send, 1 s, 2 s, 4 s... before asking again for a message
object the SuperLink does not hold yet, and up to 20 s between tries to reach a SuperLink it lost. None of
these is a setting; together they were most of a round's overhead on a loopback deployment
(benchmarks/results/overhead.md). ``FEDMED_SUPERNODE_POLL=flower`` keeps Flower's own waits.

The ClientApp process (the executor, which runs the code a job names) has no route out where the OS allows it:
it starts in a network namespace of its own (``unshare --net`` as root, or with an unprivileged user namespace),
which has no network interface at all, and reaches its SuperNode's Runtime API only through a Unix socket that
this script relays to the API's address (:class:`RuntimeRelay`). Neither Python's own modules nor a subprocess nor
``ctypes`` can open a connection from there. ``--clientapp-network`` says how: ``auto`` (the default: a namespace
where the OS allows it, else the host's network with a warning at start), ``namespace`` (refuse to start without
one), ``host`` (the host's network), or ``container`` (no executor here: another container, on an internal network
whose only other member is this SuperNode, runs it with ``--fedmed-executor``; docker-compose.yml).

This file imports nothing of the project (it is not part of the FAB), so the FAB's code is what runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("fedmed-supernode")

#: seconds between the executor's requests for a task (Flower's SuperExec: 1 s, FLWR_SUPEREXEC_TASK_POLL_INTERVAL)
POLL = float(os.environ.get("FEDMED_EXECUTOR_POLL", "0.05"))
#: set for the app while it answers a task: when the executor acquired it (time.time()), for overhead attribution
TASK_ACQUIRED_ENV = "FEDMED_TASK_ACQUIRED"
EXECUTOR_FLAG = "--fedmed-executor"  # the executor's own command line (started by the supervisor below)
#: the opt-out of app approval, for closed test networks only: any app the SuperLink sends is installed and run
ANY_APP_FLAG = "--any-app"
ANY_APP_WARNING = ("--any-app: this hospital runs ANY app bundle its SuperLink sends, unreviewed; whoever controls "
                   "the SuperLink runs code here. Only for a closed test network: approve apps by hash instead "
                   "(node config approved-apps, policy apps; `fedmed app-hash APP_DIR`)")
SUPERNODE_FLAG = "--fedmed-supernode"  # Flower's SuperNode with shorter waits, in a process of this script
#: where the ClientApp process runs: auto | namespace | host | container (see the module's docstring)
NETWORK_FLAG = "--clientapp-network"
NETWORKS = ("auto", "namespace", "host", "container")
#: set for the ClientApp: the SuperLink's address as this SuperNode was told it (--superlink), which the hospital's
#: audit log records on every message line (client_app/api.py: SUPERLINK_ENV)
SUPERLINK_ENV = "FEDMED_SUPERLINK"
FLOWER_SUPERLINK = "127.0.0.1:9092"  #: flower-supernode's --superlink when none is given
#: "flower": the SuperNode keeps Flower's own waits (3 s between empty polls of the SuperLink, ...)
POLL_MODE = os.environ.get("FEDMED_SUPERNODE_POLL", "short")


# --- Flower's SuperNode with shorter waits ----------------------------------------------------------------------------
class SuperNodeClock:
    """Stands in for the ``time`` module inside Flower's SuperNode loop (``start_client_internal``), whose
    waits are fixed numbers: 3 s after a poll of the SuperLink that found no message, 0.5 s between looks
    for a reply in the SuperNode's own memory.

    After a message the SuperLink is polled again at once and then at waits growing from ``first`` by
    ``growth`` up to Flower's 3 s, so the next round's message is picked up within a fraction of a second
    while an idle hospital costs the SuperLink no more than in Flower (16 polls in the first 14 s, then one
    per 3 s). The look for a reply is local and takes ``reply_wait``.
    """

    IDLE, REPLY = 3, 0.5  # Flower 1.42's waits (tests/test_supernode_executor.py checks they are still there)

    def __init__(self, first: float = 0.1, growth: float = 1.25, reply_wait: float = 0.02) -> None:
        self.first, self.growth, self.reply_wait = first, growth, reply_wait
        self.idle_wait = first

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def message_received(self) -> None:
        self.idle_wait = self.first

    def sleep(self, seconds: float) -> None:
        if seconds == self.IDLE:
            wait, self.idle_wait = self.idle_wait, min(self.IDLE, self.idle_wait * self.growth)
        elif seconds == self.REPLY:
            wait = self.reply_wait
        else:
            wait = seconds
        time.sleep(wait)


#: most seconds between a SuperNode's tries to reach a SuperLink it lost (Flower: 20): a hospital whose link
#: comes back rejoins within seconds, not after rounds have gone by without it
RECONNECT_WAIT = 5


def shorten_supernode_waits(clock: SuperNodeClock) -> None:
    """Give Flower's SuperNode loop ``clock``, a first retry of 0.05 s (at most 0.5 s between retries) for
    message objects the SuperLink does not hold yet (the server may still be pushing them), and at most
    :data:`RECONNECT_WAIT` seconds between tries to reach the SuperLink."""
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supercore.retry import http_retry
    from flwr.supernode import start_client_internal as loop

    pull_and_store = loop._pull_and_store_message

    def pull_and_store_message(*args: Any, **kwargs: Any) -> Any:
        run_id = pull_and_store(*args, **kwargs)
        if run_id is not None:
            clock.message_received()
        return run_id

    loop.time = clock
    loop._pull_and_store_message = pull_and_store_message
    inflatable_utils.pull_objects.__kwdefaults__.update(initial_backoff=0.05, backoff_cap=0.5)
    http_retry.MAX_RETRY_DELAY = RECONNECT_WAIT


def run_supernode(supernode_args: list[str]) -> None:
    """Flower's ``flower-supernode`` with ``supernode_args``, in this process, with shorter waits."""
    from flwr.supernode.cli import flower_supernode

    if POLL_MODE != "flower":
        shorten_supernode_waits(SuperNodeClock())
    sys.argv = ["flower-supernode", *supernode_args]
    sys.exit(flower_supernode())


# --- the apps this hospital approved -------------------------------------------------------------------------------
class AppRefused(RuntimeError):
    """A FAB the hospital did not approve: nothing of it was installed, loaded or run."""


class NodeConfigError(ValueError):
    """The SuperNode's --node-config cannot be read: the hospital does not start."""


def node_config_of(supernode_args: list[str]) -> dict[str, Any]:
    """The SuperNode's ``--node-config``, parsed as Flower parses it; NodeConfigError saying why it cannot be."""
    from flwr.common.config import parse_config_args

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--node-config")
    text = parser.parse_known_args(supernode_args)[0].node_config
    try:
        parsed = parse_config_args([text]) if text else {}
    except Exception as error:  # Flower raises click's exception, or TOML's
        reason = getattr(error, "message", None) or str(error)
        raise NodeConfigError(f"--node-config {text!r}: {reason.splitlines()[0] if reason else type(error).__name__}"
                              ) from None
    if text and text.strip() and not parsed:  # Flower reads 'hospital=' or 'a b' as no key at all
        raise NodeConfigError(f"--node-config {text!r}: holds no key='value' pair")
    return parsed


def approved_apps(node_config: dict[str, Any]) -> frozenset[str] | None:
    """SHA-256 hashes of the FABs this hospital runs: node config ``approved-apps`` (comma-separated) and the
    ``apps`` list of its policy file (TOML, JSON or YAML; read afresh for every task, as the policy is); None when
    neither has such a key (every app runs, as in Flower). A policy that cannot be read approves no app."""
    declared = "approved-apps" in node_config
    listed = [item for item in str(node_config.get("approved-apps", "")).replace(",", " ").split() if item]
    policy = str(node_config.get("policy-file", "") or "")
    if policy:
        try:
            table = read_table(Path(policy))
            apps = table.get("apps") if isinstance(table, dict) else None
            if apps is not None:
                if not isinstance(apps, list):
                    raise ValueError("'apps' is not a list")
                declared, listed = True, listed + [str(item) for item in apps]
        except Exception as error:  # fail closed
            log.error("policy-file %s cannot be read (%s): no app is approved", policy, error)
            return frozenset()
    return frozenset(item.lower() for item in listed) if declared else None


def read_table(path: Path) -> Any:
    """A policy file's table (the format its suffix names, as common/trust/policy.py reads it)."""
    data = path.read_bytes()
    suffix = path.suffix.lower()
    if suffix == ".json":
        import json

        return json.loads(data)
    if suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(data)
    import tomllib

    return tomllib.loads(data.decode())


def app_refusal(fab: Any, approved: frozenset[str] | None, any_app: bool = False) -> str | None:
    """Why this hospital does not run ``fab`` (None: it does): its content must hash to the hash the SuperLink
    gave, and that hash must be approved (``approved`` None: no list, so nothing is, unless ``any_app``)."""
    import hashlib

    content = getattr(fab, "content", b"") or b""
    if content and hashlib.sha256(content).hexdigest() != fab.hash_str:
        return (f"the app bundle's content does not hash to the {fab.hash_str} it was sent as: it was not "
                "installed")
    if approved is None and not any_app:
        return (f"app bundle {fab.hash_str} was neither installed nor run: this hospital approved no app (node "
                "config approved-apps, policy apps)")
    if approved is not None and fab.hash_str.lower() not in approved:
        return (f"app bundle {fab.hash_str} is not among the apps this hospital approved (node config approved-apps, "
                "policy apps), so it was neither installed nor run; to approve it, review it with `fedmed app-hash "
                "APP_DIR` and add its hash")
    return None


# --- a ClientApp process with no route out ------------------------------------------------------------------------
#: how to start a command in a network namespace of its own: as root, then with an unprivileged user namespace
NAMESPACE_COMMANDS = (["unshare", "--net", "--"], ["unshare", "--user", "--map-root-user", "--net", "--"])


def namespace_prefix() -> list[str] | None:
    """The command prefix that starts a process in a network namespace of its own on this machine, or None when
    the OS allows none (no ``unshare``, no privilege, user namespaces turned off, a container without the
    capability)."""
    import shutil

    if shutil.which("unshare") is None:
        return None
    for prefix in NAMESPACE_COMMANDS:
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


class RuntimeRelay:
    """A Unix socket whose every connection is piped to the Runtime API's TCP address: the way a ClientApp process
    in a network namespace (which a Unix socket crosses, TCP not) reaches its SuperNode, and nothing else."""

    def __init__(self, path: Path, address: str) -> None:
        import socket

        host, _, port = address.rpartition(":")
        self.target, self.path = (host.strip("[]"), int(port)), path
        path.unlink(missing_ok=True)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        os.chmod(path, 0o600)
        self.server.listen(64)
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        import socket

        while True:
            try:
                inner, _ = self.server.accept()
            except OSError:  # closed
                return
            try:
                outer = socket.create_connection(self.target, timeout=10)
                outer.settimeout(None)
            except OSError:
                inner.close()
                continue
            for source, sink in ((inner, outer), (outer, inner)):
                threading.Thread(target=self.pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def pipe(source: Any, sink: Any) -> None:
        import socket

        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()
        self.path.unlink(missing_ok=True)


def use_unix_socket(client: Any, path: str) -> Any:
    """``client`` (a Flower Runtime API client) sending its requests over the Unix socket ``path``; its URL (the
    Runtime API's address) stays the Host it names (tests/test_supernode_executor.py checks the attribute)."""
    import httpx

    client._client = httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=30.0, follow_redirects=True)
    return client


# --- the supervisor: the SuperNode and its executor --------------------------------------------------------------
def supernode_flags(supernode_args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default="9094")
    parser.add_argument("--isolation")
    parser.add_argument("--ssl-certfile")
    parser.add_argument("--superexec-auth-secret-file")
    parser.add_argument("--superlink", default=FLOWER_SUPERLINK)
    return parser.parse_known_args(supernode_args)[0]


def runtime_address(supernode_args: list[str]) -> str:
    """The Runtime API the SuperNode serves (its --host and --port, Flower's defaults otherwise)."""
    known = supernode_flags(supernode_args)
    if known.isolation not in (None, "process"):
        sys.exit(f"fedmed-supernode: --isolation {known.isolation}: this script runs the ClientApps itself "
                 "(--isolation process); use flower-supernode for Flower's own SuperExec")
    if known.ssl_certfile:
        sys.exit("fedmed-supernode: --ssl-certfile: a TLS Runtime API is not supported by the executor; the Runtime "
                 "API stays on the hospital's machine (--host 127.0.0.1)")
    host = "127.0.0.1" if known.host in ("0.0.0.0", "") else known.host
    return f"{host}:{known.port}"


def supervise(supernode_args: list[str]) -> int:
    """Run the SuperNode and keep an executor beside it; end with the SuperNode, or both on SIGTERM/SIGINT. It does
    not start without approved apps (or ``--any-app``)."""
    any_app = ANY_APP_FLAG in supernode_args
    supernode_args = [arg for arg in supernode_args if arg != ANY_APP_FLAG]
    network, supernode_args = clientapp_network(supernode_args)
    if network is None:
        return 2
    try:
        node_config = node_config_of(supernode_args)
    except NodeConfigError as error:
        log.error("%s", error)
        return 2
    if any_app:
        log.warning(ANY_APP_WARNING)
    elif approved_apps(node_config) is None:
        log.error("no approved-apps in the node config and no apps in its policy, so this hospital would run no app: "
                  "review the app, then add its hash (`fedmed app-hash APP_DIR`) as node config approved-apps='...' "
                  "or to the policy's apps (deploy/start_supernode.sh and docker-compose.yml do it for the checkout "
                  "they start from); %s only on a closed test network", ANY_APP_FLAG)
        return 2
    address = runtime_address(supernode_args)
    prefix: list[str] | None = []
    if network in ("auto", "namespace"):
        prefix = namespace_prefix()
        if prefix is None and network == "namespace":
            log.error("%s namespace: this machine gives the ClientApp process no network namespace (unshare as "
                      "root, or unprivileged user namespaces): not started", NETWORK_FLAG)
            return 2
        if prefix is None:
            log.warning("the ClientApp process runs in the host's network: this machine allows no network namespace "
                        "(unshare as root, or unprivileged user namespaces); only Python's audit hook keeps the code "
                        "a job names off the network (docs/deployment.md)")
            prefix = []
    args = supernode_args if any(a.startswith("--isolation") for a in supernode_args) \
        else ["--isolation", "process", *supernode_args]
    supernode = subprocess.Popen([sys.executable, __file__, SUPERNODE_FLAG, *args])  # this Python's own Flower
    if network == "container":  # another container runs the ClientApp (docker-compose.yml)
        return wait_for(supernode)

    secret = supernode_flags(supernode_args).superexec_auth_secret_file  # the SuperNode then asks the executor for it
    relay = None
    if prefix:  # the executor's only way out: a Unix socket to the Runtime API
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="fedmed-runtime-"))
        relay = RuntimeRelay(folder / "runtime.sock", address)
        log.info("the ClientApp process runs in a network namespace of its own (%s); it reaches the SuperNode only "
                 "through %s", " ".join(prefix[:-1]), relay.path)

    def start_executor() -> subprocess.Popen:
        import json

        return subprocess.Popen([*(prefix or []), sys.executable, __file__, EXECUTOR_FLAG, "--runtime-api-address",
                                 address, "--superlink", supernode_flags(supernode_args).superlink,
                                 "--parent-pid", str(supernode.pid), "--node-config-json",
                                 json.dumps(node_config),
                                 *(["--runtime-api-socket", str(relay.path)] if relay else []),
                                 *(["--superexec-auth-secret-file", secret] if secret else []),
                                 *([ANY_APP_FLAG] if any_app else [])])

    stopping = threading.Event()

    def stop(signum: int, _frame: Any) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    executor = start_executor()
    try:
        while not stopping.is_set() and supernode.poll() is None:
            if executor.poll() is not None:  # it crashed (a task's own failure is an error reply, not an exit)
                log.error("ClientApp executor exited with %s; starting a new one", executor.returncode)
                time.sleep(1.0)
                executor = start_executor()
            stopping.wait(0.2)
    finally:
        for process in (executor, supernode):
            if process.poll() is None:
                process.terminate()
        for process in (executor, supernode):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        if relay is not None:
            relay.close()
            relay.path.parent.rmdir()
    return 0 if stopping.is_set() or supernode.returncode is None else supernode.returncode


def clientapp_network(supernode_args: list[str]) -> tuple[str | None, list[str]]:
    """``--clientapp-network``'s value (None: not one of :data:`NETWORKS`, logged) and the other arguments."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(NETWORK_FLAG, default="auto")
    known, rest = parser.parse_known_args(supernode_args)
    if known.clientapp_network not in NETWORKS:
        log.error("%s %s: one of %s", NETWORK_FLAG, known.clientapp_network, ", ".join(NETWORKS))
        return None, rest
    return known.clientapp_network, rest


def wait_for(supernode: subprocess.Popen) -> int:
    """The SuperNode alone (its ClientApp runs elsewhere): until it ends, or SIGTERM/SIGINT ends it."""
    signal.signal(signal.SIGTERM, lambda *_: supernode.terminate())
    signal.signal(signal.SIGINT, lambda *_: supernode.terminate())
    return supernode.wait()


# --- the executor: Flower's SuperExec loop, the ClientApp in this process ---------------------------------------------
def restart(reason: str, token: str | None = None) -> None:
    """Replace this process by a fresh executor (the same command line), handing it ``token`` if given."""
    log.info("ClientApp executor restarts: %s", reason)
    logging.shutdown()
    argv = [a for i, a in enumerate(sys.argv) if a != "--token" and (i == 0 or sys.argv[i - 1] != "--token")]
    os.execv(sys.executable, [sys.executable, *argv, *(["--token", token] if token else [])])


class Executor:
    """Acquires the SuperNode's ClientApp tasks and answers them one at a time in this process."""

    def __init__(self, address: str, auth_secret: bytes | None = None,
                 node_config: dict[str, Any] | None = None, any_app: bool = False, socket_path: str = "") -> None:
        from flwr.supercore.interceptors import SuperExecAuthHttpInterceptor
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient

        self.address = address
        self.socket_path = socket_path  #: a Unix socket relayed to the Runtime API (the process's only way out)
        self.node_config = dict(node_config or {})  #: the SuperNode's: which apps the hospital approved
        self.any_app = any_app  #: --any-app: a closed test network's opt-out of app approval
        self.fab_hash: str | None = None  # the FAB whose code this process has loaded, and its ClientApp
        self.app: Any = None
        # with --superexec-auth-secret-file only who holds the secret may take the hospital's tasks, as in Flower
        interceptors = [SuperExecAuthHttpInterceptor(master_secret=auth_secret, protected_methods=frozenset(
            {"/flwr.proto.Runtime/AcquireTask"}))] if auth_secret else []
        self.client = self.through_socket(RuntimeHttpClient.from_server_address(
            server_address=address, insecure=True, root_certificates=None, interceptors=interceptors,
            retry_invoker=make_simple_http_retry_invoker()))

    def through_socket(self, client: Any) -> Any:
        return use_unix_socket(client, self.socket_path) if self.socket_path else client

    def acquire(self) -> tuple[str, str] | None:
        """(token, FAB hash) of the next ClientApp task, or None."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.constant import TaskType

        response = self.client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
        if response.HasField("task") and response.token:
            return response.token, response.task.fab_hash
        return None

    def serve(self, first_token: str | None) -> None:
        token, fab_hash = (first_token, None) if first_token else (None, None)
        while True:
            if token is None:
                acquired = self.acquire()
                if acquired is None:
                    time.sleep(POLL)
                    continue
                token, fab_hash = acquired
                if fab_hash and self.fab_hash not in (None, fab_hash):
                    restart(f"a task of FAB {fab_hash[:12]} after FAB {self.fab_hash[:12]}", token)
            self.run_task(token)
            token = None

    def task_client(self, token: str) -> tuple[Any, Any]:
        """A Runtime API client that acts for one task (its token), as a ``flwr-clientapp`` process does, and
        its retry policy (cut to one try once the task is over)."""
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient

        retry = make_simple_http_retry_invoker()
        return self.through_socket(RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=True, root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                          RuntimeTokenHttpInterceptor(token)], retry_invoker=retry)), retry

    def run_task(self, token: str) -> None:
        """Flower's ``run_clientapp`` for one task, minus the process: pull, install, load, call, push."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        started = time.time()
        os.environ[TASK_ACQUIRED_ENV] = repr(started)
        pulled = answered = started
        client, retry = self.task_client(token)
        beats = HeartbeatSender(task_heartbeat(client, retry))
        message = reply = context = other_fab = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        beats.start()
        try:
            message, context, run, fab = pull_task_input(client)
            pulled = time.time()
            approved = approved_apps(self.node_config)
            refused = app_refusal(fab, approved, self.any_app)
            if refused:
                raise AppRefused(refused)
            if approved is None:
                log.warning("app bundle %s runs unreviewed: %s", fab.hash_str, ANY_APP_WARNING)
            if fab.hash_str != self.fab_hash:
                if self.fab_hash is not None:  # the task named no FAB before its pull, and its message is taken
                    other_fab = fab.hash_str
                    raise RuntimeError(f"this ClientApp process has FAB {self.fab_hash[:12]} loaded, the task needs "
                                       f"{other_fab[:12]}: the process restarts for the next task")
                install_from_fab(fab.content, skip_prompt=True)
                load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
                self.app, self.fab_hash = load(run.fab_id, run.fab_version, fab.hash_str), fab.hash_str
            reply = self.app(message=message, context=context)
            answered = time.time()
            status, details = SubStatus.COMPLETED, ""
        except Exception as error:  # as flwr-clientapp: an error reply, and this process goes on
            code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(error, LoadClientAppError) \
                else ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            if isinstance(error, AppRefused):
                log.error("refused a task: %s", error)
                details = f"hospital refused the app: {error}"
            else:
                log.exception("ClientApp raised an exception")
                details = f"{type(error)}:<'{error}'>"
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            beats.stop()
            os.environ.pop(TASK_ACQUIRED_ENV, None)
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
            except Exception:
                log.exception("failed to push the reply")
            retry.max_tries = 1
            push_task_output(client=client, context=context, sub_status=status, details=details)
            client.close()
            done = time.time()
            log.info("task %s: pulled in %.2f s, answered in %.2f s, pushed in %.2f s", status, pulled - started,
                     max(0.0, answered - pulled), done - max(answered, pulled))
        if other_fab is not None:
            restart(f"FAB {other_fab[:12]} after FAB {self.fab_hash[:12]}")


def task_heartbeat(client: Any, retry: Any) -> Any:
    """Flower's task heartbeat, except that a task the server stopped restarts the executor (Flower's raises
    SIGINT, which ends a ``flwr-clientapp`` process): the stopped task's work ends and is never pushed."""
    import httpx
    from flwr.common.constant import SubStatus
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest
    from flwr.supernode.runtime.run_clientapp import push_task_output

    def beat() -> bool:
        try:
            response = client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.TransportError:
            return False
        except httpx.HTTPStatusError as error:
            if error.response.status_code in (503, 504):
                return False
            raise
        if not response.success:
            retry.max_tries = 1
            push_task_output(client=client, context=None, sub_status=SubStatus.FAILED, details="Task stopped.")
            restart("the task was stopped (flwr stop, or the run ended)")
        return True

    return beat


def pull_task_input(client: Any) -> tuple[Any, Any, Any, Any]:
    """Flower's ``run_clientapp.pull_task_input`` with a short retry for objects the SuperNode is still receiving.

    The SuperNode offers a task before all of its message's objects have arrived from the SuperLink; Flower
    retries such an object after 1 s, then 2 s, 4 s... (hidden behind a new process's start-up there, seconds
    of every round here). On the hospital's own machine, asking again every 0.05-0.5 s costs nothing.
    """
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    task = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = task.task_id, task.run.run_id, \
        task.context.node_id
    context, run, fab = context_from_proto(task.context), run_from_proto(task.run), fab_from_proto(task.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node, tree = Node(node_id=context.node_id), pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=0.05, backoff_cap=0.5)
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower's: not part of the deflated message
    return message, context, run, fab


def run_executor(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="fedmed-supernode " + EXECUTOR_FLAG)
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--parent-pid", type=int, default=0, help="the SuperNode: the executor ends with it (0: it "
                        "runs elsewhere, another container's)")
    parser.add_argument("--runtime-api-socket", default="", help="a Unix socket relayed to the Runtime API (the "
                        "executor's network namespace has no other way out)")
    parser.add_argument("--node-config", default="", help="the SuperNode's node config, as Flower's text (or "
                        "--node-config-json)")
    parser.add_argument("--token", help="a task acquired by the process this one replaced")
    parser.add_argument("--superexec-auth-secret-file", type=Path, help="the SuperNode's, if it has one")
    parser.add_argument("--node-config-json", default="{}", help="the SuperNode's node config (approved apps)")
    parser.add_argument(ANY_APP_FLAG, action="store_true", help="run any app (a closed test network's opt-out)")
    parser.add_argument("--superlink", default="", help="the SuperLink its SuperNode reaches, as the SuperNode's "
                        "--superlink: recorded on the hospital's audit lines (the executor itself never reaches it)")
    args = parser.parse_args(argv)
    from flwr.supercore.app_utils import start_parent_process_monitor

    if args.parent_pid:
        start_parent_process_monitor(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    # the one address a closed hospital process still reaches (common/trust/sandbox.py: RUNTIME_API_ENV)
    os.environ["FEDMED_RUNTIME_API_ADDRESS"] = args.runtime_api_address
    if args.superlink:
        os.environ[SUPERLINK_ENV] = args.superlink
    secret = args.superexec_auth_secret_file.read_bytes() if args.superexec_auth_secret_file else None
    import json

    try:
        node_config = node_config_of(["--node-config", args.node_config]) if args.node_config \
            else json.loads(args.node_config_json)
    except NodeConfigError as error:
        sys.exit(f"fedmed-supernode {EXECUTOR_FLAG}: {error}")
    Executor(args.runtime_api_address, secret, node_config, args.any_app, args.runtime_api_socket).serve(args.token)


def main() -> None:
    if sys.argv[1:2] == [SUPERNODE_FLAG]:  # Flower's logging only, as in flower-supernode
        run_supernode(sys.argv[2:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Runtime API request otherwise
    if sys.argv[1:2] == [EXECUTOR_FLAG]:
        run_executor(sys.argv[2:])
    else:
        sys.exit(supervise(sys.argv[1:]))


if __name__ == "__main__":
    main()
