"""fedmed-supernode's executor (deploy/fedmed_supernode.py) keeps what a fresh ClientApp process per message
guaranteed: a task of another FAB restarts it before anything is pulled, a task stopped by the server restarts
it (nothing of that task is pushed later), and a failing app becomes an error reply while the executor goes on.
The whole path through a real SuperNode is in tests/test_deployment.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cli.launch import SUPERNODE_WITH_EXECUTOR


def load_script():
    spec = importlib.util.spec_from_file_location("fedmed_supernode", SUPERNODE_WITH_EXECUTOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Restarted(Exception):
    pass


@pytest.fixture
def script(monkeypatch):
    module = load_script()

    def restart(reason, token=None):
        raise Restarted(reason, token)

    monkeypatch.setattr(module, "restart", restart)
    return module


def test_the_runtime_address_comes_from_the_supernodes_own_flags_and_other_isolation_is_refused(script):
    assert script.runtime_address(["--superlink", "x:9092"]) == "127.0.0.1:9094"
    assert script.runtime_address(["--host", "0.0.0.0", "--port", "9200"]) == "127.0.0.1:9200"
    with pytest.raises(SystemExit, match="--isolation subprocess"):
        script.runtime_address(["--isolation", "subprocess"])
    with pytest.raises(SystemExit, match="ssl-certfile"):
        script.runtime_address(["--ssl-certfile", "c.pem"])


def test_a_task_of_another_fab_restarts_the_executor_with_its_token_before_anything_is_pulled(script):
    executor = script.Executor("127.0.0.1:1")  # nothing listens: nothing may be asked of it
    executor.fab_hash = "a" * 64
    ran: list[str] = []
    executor.acquire = lambda: ("token-1", "b" * 64)
    executor.run_task = ran.append
    with pytest.raises(Restarted) as restarted:
        executor.serve(first_token=None)
    assert restarted.value.args[1] == "token-1" and "FAB bbbbbbbbbbbb after FAB aaaaaaaaaaaa" in restarted.value.args[0]
    assert ran == []


def test_tasks_of_the_loaded_fab_run_here_one_after_the_other(script):
    executor = script.Executor("127.0.0.1:1")
    executor.fab_hash = "a" * 64
    tasks = iter([("token-1", "a" * 64), None, ("token-2", "a" * 64)])
    ran: list[str] = []

    def acquire():
        try:
            return next(tasks)
        except StopIteration:
            raise Restarted("no more tasks") from None

    executor.acquire = acquire
    executor.run_task = ran.append
    with pytest.raises(Restarted, match="no more tasks"):
        executor.serve(first_token=None)
    assert ran == ["token-1", "token-2"]


@pytest.mark.parametrize("given, told", [(["--superlink", "link.example:9200"], "link.example:9200"),
                                         ([], "127.0.0.1:9092")])  # flower-supernode's own default
def test_the_clientapp_is_told_the_superlink_its_supernode_reaches(monkeypatch, given, told):
    """To whom the hospital's audit log says it answered: the executor gets the SuperNode's --superlink and sets it
    for the ClientApp (client_app/api.py records it on every message line)."""
    from client_app.api import SUPERLINK_ENV

    module = load_script()
    started = []

    class Process:
        returncode, pid = 0, 0  # --parent-pid 0: no monitor of a parent to end with

        def __init__(self, command):
            started.append(command)

        poll = wait = lambda self, timeout=None: 0
        terminate = kill = lambda self: None

    monkeypatch.setattr(module.subprocess, "Popen", Process)
    monkeypatch.setattr(module.signal, "signal", lambda *_: None)
    assert module.supervise([module.ANY_APP_FLAG, module.NETWORK_FLAG, "host", "--insecure", *given]) == 0
    executor = next(command for command in started if module.EXECUTOR_FLAG in command)
    assert executor[executor.index("--superlink") + 1] == told
    assert module.SUPERLINK_ENV == SUPERLINK_ENV
    for name in (SUPERLINK_ENV, "FEDMED_RUNTIME_API_ADDRESS", "FLWR_TELEMETRY_ENABLED"):
        monkeypatch.setenv(name, "before")  # restored after the test
    seen = []
    monkeypatch.setattr(module, "Executor", lambda *_: type("E", (), {"serve": lambda self, token: seen.append(
        module.os.environ[SUPERLINK_ENV])})())
    module.run_executor(executor[executor.index(module.EXECUTOR_FLAG) + 1:])
    assert seen == [told]


def test_a_restart_keeps_the_command_line_and_hands_over_only_the_new_token(monkeypatch):
    module = load_script()
    calls = []
    monkeypatch.setattr(module.os, "execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setattr(module.sys, "argv", [str(SUPERNODE_WITH_EXECUTOR), module.EXECUTOR_FLAG,
                                             "--runtime-api-address", "127.0.0.1:9094", "--parent-pid", "7",
                                             "--token", "old"])
    module.restart("a new FAB", "new")
    module.restart("the task was stopped")
    assert [argv[1:] for argv in calls] == [
        [str(SUPERNODE_WITH_EXECUTOR), module.EXECUTOR_FLAG, "--runtime-api-address", "127.0.0.1:9094",
         "--parent-pid", "7", "--token", "new"],
        [str(SUPERNODE_WITH_EXECUTOR), module.EXECUTOR_FLAG, "--runtime-api-address", "127.0.0.1:9094",
         "--parent-pid", "7"]]


def test_the_script_imports_nothing_of_the_project_so_the_fabs_code_is_what_runs():
    source = Path(SUPERNODE_WITH_EXECUTOR).read_text()
    for package in ("common", "client_app", "server_app", "strategies"):
        assert f"from {package}" not in source and f"import {package}" not in source


class FakeRuntime:
    """The SuperNode's Runtime API as one task sees it: records what the executor pushes."""

    def __init__(self, heartbeat_success: bool = True):
        self.heartbeat_success = heartbeat_success
        self.task_outputs: list[tuple[str, str]] = []

    def SendTaskHeartbeat(self, request):  # noqa: N802 (Flower's method names)
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse

        return SendTaskHeartbeatResponse(success=self.heartbeat_success)

    def PushTaskOutput(self, request):  # noqa: N802
        self.task_outputs.append((request.sub_status, request.details))

    def close(self):
        pass


def test_a_task_the_server_stopped_restarts_the_executor_after_reporting_it_failed(script):
    from flwr.supercore.retry import make_simple_http_retry_invoker

    runtime, retry = FakeRuntime(heartbeat_success=True), make_simple_http_retry_invoker()
    beat = script.task_heartbeat(runtime, retry)
    assert beat() is True and runtime.task_outputs == []
    runtime.heartbeat_success = False
    with pytest.raises(Restarted, match="stopped") as restarted:
        beat()
    assert restarted.value.args[1] is None  # nothing handed over: the stopped task is dropped
    assert [status for status, _ in runtime.task_outputs] == ["failed"]


def test_an_app_that_raises_becomes_an_error_reply_and_the_executor_goes_on(script, monkeypatch):
    import flwr.supernode.runtime.run_clientapp as flower_clientapp
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as pull_task_input sets them
    runtime = FakeRuntime()
    message = Message(RecordDict(), dst_node_id=1, message_type="train")
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    class Fab:
        hash_str, content = "a" * 64, b""

    class Run:
        fab_id, fab_version = "fedmed", "1"

    def broken_app(message, context):
        raise ValueError("hospital x: data.npz is broken")

    pushed = []
    executor = script.Executor("127.0.0.1:1", node_config={"approved-apps": Fab.hash_str})
    executor.app, executor.fab_hash = broken_app, Fab.hash_str
    executor.task_client = lambda token: (runtime, make_simple_http_retry_invoker())
    monkeypatch.setattr(script, "pull_task_input", lambda client: (message, context, Run, Fab))
    monkeypatch.setattr(flower_clientapp, "push_message", lambda client, reply, ctx: pushed.append(reply))
    executor.run_task("token-1")
    executor.run_task("token-2")
    assert len(pushed) == 2 and all(reply.has_error() for reply in pushed)
    assert "data.npz is broken" in pushed[0].error.reason
    assert [status for status, _ in runtime.task_outputs] == ["failed", "failed"]


def test_a_task_that_turns_out_to_need_another_fab_is_refused_and_the_executor_restarts(script, monkeypatch):
    import flwr.supernode.runtime.run_clientapp as flower_clientapp
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    runtime = FakeRuntime()
    message = Message(RecordDict(), dst_node_id=1, message_type="train")
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    class Fab:
        hash_str, content = "b" * 64, b""

    ran, pushed = [], []
    executor = script.Executor("127.0.0.1:1", node_config={"approved-apps": f"{'a' * 64},{'b' * 64}"})
    executor.app, executor.fab_hash = (lambda message, context: ran.append(1)), "a" * 64
    executor.task_client = lambda token: (runtime, make_simple_http_retry_invoker())
    monkeypatch.setattr(script, "pull_task_input", lambda client: (message, context, None, Fab))
    monkeypatch.setattr(flower_clientapp, "push_message", lambda client, reply, ctx: pushed.append(reply))
    with pytest.raises(Restarted, match="FAB bbbbbbbbbbbb after FAB aaaaaaaaaaaa") as restarted:
        executor.run_task("token-1")
    assert restarted.value.args[1] is None and ran == []  # the old FAB's code never answered it
    assert len(pushed) == 1 and "needs bbbbbbbbbbbb" in pushed[0].error.reason


def test_the_supernode_polls_again_soon_after_a_message_and_slows_to_flowers_wait_when_idle(script, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(script.time, "sleep", slept.append)
    clock = script.SuperNodeClock(first=0.1, growth=2.0, reply_wait=0.02)
    for _ in range(7):
        clock.sleep(script.SuperNodeClock.IDLE)  # the loop's wait after a poll that found no message
    clock.sleep(script.SuperNodeClock.REPLY)  # waiting for the reply to send
    clock.message_received()
    clock.sleep(script.SuperNodeClock.IDLE)
    clock.sleep(7.0)  # any other wait is Flower's own
    assert slept == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.0, 3.0, 0.02, 0.1, 7.0])


def test_flowers_supernode_still_has_the_waits_the_script_shortens(script, monkeypatch):
    """A Flower upgrade that changes the SuperNode loop fails here, not silently in a deployment."""
    import inspect

    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supernode import start_client_internal as loop

    source = inspect.getsource(loop)
    assert f"time.sleep({script.SuperNodeClock.IDLE})" in source
    assert f"time.sleep({script.SuperNodeClock.REPLY})" in source
    assert "run_id = _pull_and_store_message(" in inspect.getsource(loop.start_client_internal)
    from flwr.supercore.retry import http_retry

    assert "exponential(max_delay=MAX_RETRY_DELAY)" in inspect.getsource(http_retry)
    monkeypatch.setattr(http_retry, "MAX_RETRY_DELAY", http_retry.MAX_RETRY_DELAY)
    defaults = dict(inflatable_utils.pull_objects.__kwdefaults__)
    try:
        monkeypatch.setattr(loop, "time", loop.time)  # restored after the test, as the loop's other names
        monkeypatch.setattr(loop, "_pull_and_store_message", lambda **kwargs: 7)
        clock = script.SuperNodeClock(first=0.1)
        clock.idle_wait = 3.0
        script.shorten_supernode_waits(clock)
        assert loop.time is clock
        assert loop._pull_and_store_message() == 7 and clock.idle_wait == 0.1  # a message: poll again soon
        assert inflatable_utils.pull_objects.__kwdefaults__["initial_backoff"] == 0.05
        assert http_retry.MAX_RETRY_DELAY == script.RECONNECT_WAIT < 20
    finally:
        inflatable_utils.pull_objects.__kwdefaults__.update(defaults)


def fab_of(content: bytes):
    import hashlib

    class Fab:
        pass

    fab = Fab()
    fab.content, fab.hash_str = content, hashlib.sha256(content).hexdigest()
    return fab


def run_one_task(script, monkeypatch, fab, node_config):
    """One task of ``fab`` through the executor; (what was installed, the pushed replies)."""
    import flwr.cli.install as flower_install
    import flwr.supernode.runtime.run_clientapp as flower_clientapp
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    runtime, installed, pushed = FakeRuntime(), [], []
    message = Message(RecordDict(), dst_node_id=1, message_type="train")
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    class Run:
        fab_id, fab_version = "fedmed", "1"

    executor = script.Executor("127.0.0.1:1", node_config=node_config)
    executor.task_client = lambda token: (runtime, make_simple_http_retry_invoker())
    monkeypatch.setattr(script, "pull_task_input", lambda client: (message, context, Run, fab))
    monkeypatch.setattr(flower_install, "install_from_fab", lambda content, **kw: installed.append(content))
    monkeypatch.setattr(flower_clientapp, "push_message", lambda client, reply, ctx: pushed.append(reply))
    monkeypatch.setattr("flwr.clientapp.utils.get_load_client_app_fn",
                        lambda **kw: lambda *a: (lambda message, context: message.create_reply(RecordDict())))
    executor.run_task("token-1")
    return installed, pushed


@pytest.mark.parametrize("where", ["node config", "policy"])
def test_an_app_the_hospital_did_not_approve_is_refused_before_it_is_installed(script, monkeypatch, tmp_path,
                                                                               where):
    hostile, approved = fab_of(b"a changed app"), fab_of(b"the reviewed app")
    if where == "node config":
        node_config = {"approved-apps": f"{'0' * 64}, {approved.hash_str}"}
    else:
        (tmp_path / "policy.yaml").write_text(f"apps: ['{approved.hash_str}']\n")
        node_config = {"policy-file": str(tmp_path / "policy.yaml")}
    installed, pushed = run_one_task(script, monkeypatch, hostile, node_config)
    assert installed == [] and len(pushed) == 1 and pushed[0].has_error()
    assert hostile.hash_str in pushed[0].error.reason and "not among the apps this hospital approved" in \
        pushed[0].error.reason
    installed, pushed = run_one_task(script, monkeypatch, approved, node_config)
    assert installed == [b"the reviewed app"] and not pushed[0].has_error()


def test_an_app_whose_content_does_not_match_its_hash_is_refused(script, monkeypatch):
    forged = fab_of(b"the reviewed app")
    forged.content = b"something else"
    installed, pushed = run_one_task(script, monkeypatch, forged, {"approved-apps": forged.hash_str})
    assert installed == [] and "does not hash to" in pushed[0].error.reason


def test_the_approved_list_comes_from_the_node_config_and_the_policy(script, tmp_path):
    assert script.approved_apps({}) is None  # nothing listed: no app runs (fedmed-supernode does not start)
    (tmp_path / "policy.toml").write_text('methods = ["fedavg"]\n')
    assert script.approved_apps({"policy-file": str(tmp_path / "policy.toml")}) is None
    (tmp_path / "listed.toml").write_text(f'apps = ["{"A" * 64}"]\n')
    assert script.approved_apps({"policy-file": str(tmp_path / "listed.toml"), "approved-apps": "b" * 64}) == \
        {"a" * 64, "b" * 64}
    (tmp_path / "broken.toml").write_text("apps = [")
    assert script.approved_apps({"policy-file": str(tmp_path / "broken.toml")}) == frozenset()  # fails closed
    args = ["--superlink", "x:1", "--node-config", f"hospital='h' approved-apps='{'c' * 64}'"]
    assert script.approved_apps(script.node_config_of(args)) == {"c" * 64}
