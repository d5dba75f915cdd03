"""What code a job names can reach at a deployed hospital (issue 65): only network classes through a pattern, and a
process closed before the first approved import, in every thread, for the life of the process.

Each test runs against the node configs the documented deployment writes (``deploy/start_supernode.sh``,
``docker-compose.yml``) and a hand-made policy (the fixtures of ``tests/test_secure_by_default.py``)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from common.settings import ConfigError
from common.trust.code_gate import CodeGate, is_network_class, load_factory

from .test_secure_by_default import (  # noqa: F401 (fixtures, used as arguments)
    AT_A_SITE,
    CONFIGURATIONS,
    answer,
    deployed,
    listener,
    shipped_configs,
    site_code,
)

# --- 1. allow-lists by kind ------------------------------------------------------------------------------------------
#: modules whose every public callable a wide pattern is tried on: MONAI's helpers and networks, torch, NumPy
WALKED = ("monai", "monai.utils", "monai.utils.misc", "monai.apps", "monai.apps.utils", "monai.networks.nets",
          "monai.networks.blocks", "monai.data", "monai.transforms", "torch", "torch.nn", "torch.hub",
          "torch.utils.cpp_extension", "numpy", "numpy.lib.npyio")
PATTERNS = ("*", "monai.*", "monai.utils*", "monai.networks.nets:*", "torch*", "numpy*")


def public_callables(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    return [f"{module_name}:{name}" for name in dir(module)
            if not name.startswith("_") and callable(getattr(module, name, None))]


@pytest.mark.parametrize("key", ["model", "dataset"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_admits_network_classes_and_nothing_else(pattern, key):
    """Every public callable of the walked modules that the pattern matches: loaded through the gate, it is either
    refused or a torch.nn.Module class (never run_cmd, load, load_inline, download_url, a loader, a factory)."""
    gate = CodeGate(models=(pattern,), datasets=(pattern,))
    admitted, tried = [], 0
    with gate.enforced():
        for module in WALKED:
            for name in public_callables(module):
                if not fnmatchcase(name, pattern):
                    continue
                tried += 1
                try:
                    factory = load_factory(name, key)
                except ConfigError:
                    continue
                assert is_network_class(factory), f"{pattern!r} admitted {name}, a {type(factory).__name__}"
                admitted.append(name)
    assert tried > 0
    if fnmatchcase("monai.networks.nets:DenseNet121", pattern) and key == "model":
        assert "monai.networks.nets:DenseNet121" in admitted  # what the pattern is for still runs


@pytest.mark.parametrize("key", ["model", "dataset"])
def test_a_function_runs_when_the_hospital_names_it_exactly(key):
    kind = "models" if key == "model" else "datasets"
    exact = CodeGate(**{kind: ("monai.utils.misc:run_cmd",)})
    with exact.enforced():
        assert load_factory("monai.utils.misc:run_cmd", key).__name__ == "run_cmd"
        with pytest.raises(ConfigError):  # the same function under another name is another approval
            load_factory("monai.utils:run_cmd", key)


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
@pytest.mark.parametrize("pattern", ["monai.*", "*", "monai.utils*"])
@pytest.mark.parametrize("named", ["monai.utils.misc:run_cmd", "monai.utils:run_cmd"])
def test_a_shell_through_an_allowed_package_is_refused(tmp_path, deployed, shipped, pattern, named,  # noqa: F811
                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    lists = {"policy": f'models = ["{pattern}"]\n'} if shipped == "policy" else {"models": pattern}
    reply = answer(deployed(shipped, **lists), {"model": named, "model-args": json.dumps(
        {"cmd_list": ["sh", "-c", "touch pwned"]})})
    assert reply.has_error() and "a pattern approves only networks" in reply.error.reason
    assert not (tmp_path / "pwned").exists()


# --- 2. closed before import, everywhere ----------------------------------------------------------------------------
#: an approved loader's ways out, each leaving what happened in the hospital's data folder (which it may write)
WAYS_OUT = {
    "a socket opened at import": "",  # the module's top level dials (see reaching_code)
    "a thread": """
        import threading
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(attempt(lambda: socket.create_connection(TARGET, 2))))
        thread.start(); thread.join()
        return outcome[0]""",
    "a subprocess": """
        import subprocess
        return attempt(lambda: subprocess.run([sys.executable, "-c",
            f"import socket; socket.create_connection({TARGET!r}, 2)"], check=True))""",
    "os.system": """
        command = f"{sys.executable} -c 'import socket; socket.create_connection({TARGET!r})'"
        return attempt(lambda: os.system(command))""",
    "ctypes, libc's connect": """
        import ctypes, struct
        def dial():
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            fd = libc.socket(2, 1, 0)
            address = struct.pack("!HH4s8x", 2, TARGET[1], bytes([127, 0, 0, 1]))
            address = struct.pack("=H", 2) + address[2:]
            if libc.connect(fd, address, len(address)) != 0:
                raise OSError(ctypes.get_errno(), "connect failed")
        return attempt(dial)""",
    "ctypes, a symbol of the process": """
        import ctypes
        return attempt(lambda: ctypes.pythonapi.connect)""",
    "a write outside its folders": """
        return attempt(lambda: open(OUTSIDE, "w").write("leaked"))""",
    "a hub library told offline=0": """
        return "refused" if os.environ.get("HF_HUB_OFFLINE") == "1" else "went through" """,
}


def reaching_code(folder: Path, port: int, way: str) -> None:
    """my_reach.data: a loader that tries ``way`` out (a socket at import time for the first) and writes what
    happened to its data folder, then loads as usual."""
    package = folder / "modules" / "my_reach"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    body = textwrap.indent(textwrap.dedent(WAYS_OUT[way] or "return OPENED_AT_IMPORT").strip("\n"), "    ")
    dials_at_import = way == "a socket opened at import"
    (package / "data.py").write_text(textwrap.dedent(f"""\
        import os, socket, sys
        import numpy as np
        from common.data.containers import LabelledImages

        TARGET, OUTSIDE = ("127.0.0.1", {port}), {str(folder / "outside.txt")!r}

        def attempt(action):
            try:
                action()
            except Exception as error:
                return f"refused ({{type(error).__name__}})"
            return "went through"

        OPENED_AT_IMPORT = attempt(lambda: socket.create_connection(TARGET, 2)) if {dials_at_import} else None

        def load(request):
            open(os.path.join(request.data_dir, "outcome.txt"), "a").write(way_out() + "\\n")
            rng = np.random.default_rng(0)
            part = LabelledImages(rng.random((24, 16, 16, 3)).astype(np.float32), np.arange(24) % 2, ["a", "b"])
            return part, part

        def way_out():
    """) + body + "\n")


@pytest.fixture
def reaching(tmp_path, monkeypatch):
    def make(port: int, way: str) -> None:
        reaching_code(tmp_path, port, way)
        monkeypatch.syspath_prepend(str(tmp_path / "modules"))
        for name in [m for m in sys.modules if m.startswith("my_reach")]:
            sys.modules.pop(name)
    return make


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
@pytest.mark.parametrize("way", list(WAYS_OUT))
def test_an_approved_loader_finds_every_way_out_closed(tmp_path, deployed, listener, reaching, shipped, way,  # noqa: F811
                                                       monkeypatch):
    port, accepted = listener
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    reaching(port, way)
    lists = ({"policy": 'datasets = ["my_reach.data:load"]\n'} if shipped == "policy"
             else {"datasets": "my_reach.data:load"})
    node = deployed(shipped, **lists)
    reply = answer(node, {"dataset": "my_reach.data:load"})
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    outcome = (Path(node["data-dir"]) / "outcome.txt").read_text().split()
    assert outcome and outcome[0] == "refused", outcome
    assert accepted == [] and not (tmp_path / "outside.txt").exists()
    assert os.environ["HF_HUB_OFFLINE"] == "0"  # the harness's own setting comes back once the answer is over


FOR_LIFE = """
import json, socket, sys, threading, time
sys.path[:0] = {paths!r}
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from client_app.api import Hospital
TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
job = {{**{run!r}, "dataset": "my_reach.data:load", "server-round": 1}}
message = Message(RecordDict({{"config": ConfigRecord(job)}}), dst_node_id=7, message_type=MessageType.QUERY)
message.metadata.__dict__["_message_id"] = "m1"
context = Context(run_id=1, node_id=7, node_config={node!r}, state=RecordDict(), run_config={run!r})
# a thread the approved loader leaves behind dials after the answer; so does the process's own code
import my_reach.data as reach
after = []
def later():
    time.sleep(0.5)
    after.append(reach.attempt(lambda: socket.create_connection(reach.TARGET, 2)))
reach.way_out = lambda: (threading.Thread(target=later).start(), "started")[1]
reply = Hospital(context).answer(message)
time.sleep(1.0)
own = reach.attempt(lambda: socket.create_connection(reach.TARGET, 2))
api = reach.attempt(lambda: socket.create_connection(("127.0.0.1", {api_port}), 2).close())
print(json.dumps({{"error": reply.error.reason if reply.has_error() else None, "after": after, "own": own,
                  "api": api}}))
"""


def test_the_process_stays_closed_after_the_answer_but_for_its_supernode(tmp_path, deployed, listener):  # noqa: F811
    """In a ClientApp process (lifetime "life", the default) a thread or socket left behind finds it closed after
    the answer too; the SuperNode's API address (fedmed-supernode's executor's) stays reachable."""
    import socket

    port, accepted = listener
    reaching_code(tmp_path, port, "a thread")
    api = socket.socket()
    api.bind(("127.0.0.1", 0))
    api.listen()
    node = deployed("policy", policy='datasets = ["my_reach.data:load"]\n')
    script = FOR_LIFE.format(paths=[str(tmp_path / "modules"), str(Path(__file__).parent.parent)], node=node,
                             run=AT_A_SITE, api_port=api.getsockname()[1])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FEDMED_RUNTIME_API_ADDRESS": f"127.0.0.1:{api.getsockname()[1]}"})
    api.close()
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is None
    assert result["after"] == ["refused (Refused)"] and result["own"] == "refused (Refused)"
    assert result["api"] == "went through" and accepted == []


# --- 4. arguments resolved, not pattern-matched -----------------------------------------------------------------------
#: strings that are not paths by their look but name files as a loader opens them (from a working folder that holds
#: secret.key, with $HOME set), and one that is
NAMING_FILES = (".", "..", "secret.key", "$HOME", "${PWD}", "~", "$PWD/secret.key", "/etc/hostname")


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
@pytest.mark.parametrize("place", ["value", "key", "nested key"])
@pytest.mark.parametrize("text", NAMING_FILES)
def test_a_string_that_names_a_file_outside_is_refused_wherever_it_stands(tmp_path, site_code, deployed,  # noqa: F811
                                                                          shipped, place, text, monkeypatch):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "secret.key").write_text("key")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    node = deployed(shipped)
    arguments = {"value": {"labels": text}, "key": {text: 1}, "nested key": {"options": [{text: True}]}}[place]
    reply = answer(node, {"dataset": "my_site.data:load", "dataset-args": json.dumps(arguments)})
    assert reply.has_error() and "outside this hospital's own folders" in reply.error.reason, \
        reply.error.reason if reply.has_error() else "accepted"
    assert not (tmp_path / "data" / "loader-ran").exists()


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
def test_plain_words_and_the_hospitals_own_files_still_pass(tmp_path, site_code, deployed, shipped,  # noqa: F811
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    node = deployed(shipped)
    own = Path(node["data-dir"]) / "labels.csv"
    own.write_text("patient,label\n")
    reply = answer(node, {"dataset": "my_site.data:load", "dataset-args": json.dumps(
        {"labels": str(own), "mode": "bilinear", "act": "relu", str(own): 1})})
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
@pytest.mark.parametrize("flag", ["false", "no", "0", "off"])
def test_a_string_where_a_download_flag_is_expected_is_refused(site_code, deployed, shipped, flag):  # noqa: F811
    lists = ({"policy": 'models = ["monai.networks.nets:DenseNet121"]\n'} if shipped == "policy"
             else {"models": "monai.networks.nets:DenseNet121"})
    node = deployed(shipped, **lists)
    reply = answer(node, {"model": "monai.networks.nets:DenseNet121",
                          "model-args": json.dumps({"spatial_dims": 2, "pretrained": flag})})
    assert reply.has_error() and "would fetch weights" in reply.error.reason
    off = answer(node, {"model": "monai.networks.nets:DenseNet121",
                        "model-args": json.dumps({"spatial_dims": 2, "pretrained": False})})
    assert not off.has_error(), off.error.reason if off.has_error() else ""


def test_a_string_where_any_flag_is_expected_is_refused_when_the_network_is_built():
    """With pretrained weights allowed, "false" still does not reach DenseNet, which would read it as true."""
    from common.models.networks import build_network

    with CodeGate(models=("monai.networks.nets:DenseNet121",)).enforced():
        for flag in ("false", "0", 0, None):
            with pytest.raises(ConfigError, match="takes true or false there"):
                build_network("monai.networks.nets:DenseNet121", {}, {"spatial_dims": 2, "in_channels": 3,
                                                                      "out_channels": 2, "pretrained": flag})
        assert build_network("monai.networks.nets:DenseNet121", {}, {"spatial_dims": 2, "in_channels": 3,
                                                                     "out_channels": 2, "pretrained": False})


@pytest.mark.parametrize("approval", ["monai.networks.nets:DenseNet121", "monai.*"])
def test_a_network_beyond_the_hospitals_size_is_refused_before_it_is_built(approval):
    from common.models.networks import build_network
    from common.trust.argument_gate import DEFAULT_JOB_LIMITS
    from common.trust.code_gate import CodeRefused

    limit = DEFAULT_JOB_LIMITS["model-parameters"]
    with CodeGate(models=(approval,), max_parameters=limit).enforced():
        with pytest.raises(CodeRefused, match="parameters, more than this hospital allows"):
            build_network("monai.networks.nets:DenseNet121", {}, {"spatial_dims": 2, "in_channels": 3,
                                                                  "out_channels": 10**12})
        built = build_network("monai.networks.nets:DenseNet121", {}, {"spatial_dims": 2, "in_channels": 3,
                                                                      "out_channels": 2})
    assert not any(parameter.is_meta for parameter in built.parameters())
    assert 0 < sum(parameter.numel() for parameter in built.parameters()) <= limit


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
def test_a_job_that_sizes_its_network_past_the_limit_is_refused(site_code, deployed, shipped):  # noqa: F811
    from flwr.app import MessageType

    lists = ({"policy": 'models = ["monai.*"]\n[job-limits]\nmodel-parameters = 1000000\n'} if shipped == "policy"
             else {"models": "monai.*"})
    node = deployed(shipped, **lists)
    reply = answer(node, {"model": "monai.networks.nets:DenseNet121",
                          "model-args": json.dumps({"spatial_dims": 2, "out_channels": 10**12}),
                          "model.num-classes": 2, "model.in-channels": 3}, MessageType.TRAIN)
    assert reply.has_error() and "parameters, more than this hospital allows" in reply.error.reason
