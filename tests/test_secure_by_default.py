"""Secure by default (issue 55): what a hospital gets when it follows the docs is the hardened configuration.

Each attack a compromised coordinator tried is played against the node configs the documented deployment writes
(``deploy/start_supernode.sh``, ``docker-compose.yml``) and against a hand-made policy: an app nobody approved, a wide
"virtual" node config, allow-list patterns that reached what a module imported, server-set arguments that reached
the network or the disk, huge job keys, the ledger's clock, a missing audit log, local paths in refusals, and a cut
server log tail."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import yaml
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.config import parse_config_args
from flwr.supercore.task_identity import TaskIdentity

from cli.audit import main as audit_main
from cli.launch import PROJECT_ROOT, SUPERNODE_WITH_EXECUTOR, project_app_hash
from client_app.api import Hospital
from client_app.node_config import every_hospital_in_this_process
from common.trust.audit import AuditLog, verify
from common.trust.ledger import PrivacyLedger
from common.trust.policy import PolicyRefusal

from .conftest import ROOT
from .test_audit import lines_of

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"run-name": "t", "synthetic-samples": 80, "image-size": 16, "batch-size": 16, "min-partition-size": 5,
         "model": "small-cnn", "strategy": "fedavg", "task": "classification"}
#: a deployed hospital reads its own folder: here with a loader of the consortium's (site_code), approved by it
AT_A_SITE = {**SMALL, "dataset": "my_site.data:load"}


# --- the node configs the documented deployment writes -------------------------------------------------------------
def consortium_keys(folder: Path) -> Path:
    """deploy/make_hospital_keys.sh's key pairs for three hospitals, the folder of their public keys (peer keys)
    a hospital is handed, and hospital-a's policy as deploy/make_hospital_policy.sh writes it from the template
    (``policies/hospital-a.toml``: pinning the three keys its officer compared)."""
    keys = folder / "keys"
    subprocess.run(["bash", str(ROOT / "deploy" / "make_hospital_keys.sh"), str(keys), "hospital-a", "hospital-b",
                    "hospital-c"], check=True, capture_output=True)
    peers = folder / "peer-keys"
    peers.mkdir()
    for public in keys.glob("*.pub"):
        (peers / public.name).write_bytes(public.read_bytes())
    subprocess.run(["bash", str(ROOT / "deploy" / "make_hospital_policy.sh"), str(folder / "policies" /
                    "hospital-a.toml"), *map(str, sorted(keys.glob("*.pub")))], check=True, capture_output=True,
                   env={**os.environ, "FEDMED_PYTHON": sys.executable})
    return keys


def script_node_config(folder: Path) -> dict:
    """The node config deploy/start_supernode.sh hands fedmed-supernode (its Python replaced by one that records
    its arguments, except for `python -m cli.main app-hash`, which runs)."""
    keys = consortium_keys(folder)
    recorder = folder / "python"
    recorder.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [ "$1" = "-m" ]; then exec {sys.executable} "$@"; fi
        {sys.executable} -c 'import json, sys; json.dump(sys.argv[1:], open("{folder}/argv.json", "w"))' "$@"
        """))
    recorder.chmod(0o755)
    (folder / "data").mkdir()
    subprocess.run(["bash", str(ROOT / "deploy" / "start_supernode.sh"), "--policy",
                    str(folder / "policies" / "hospital-a.toml"), "hospital-a", "superlink.example.org:9200",
                    str(folder / "ca.crt"), str(keys / "hospital-a"), str(folder / "peer-keys"), str(folder / "data"),
                    str(folder / "state")], check=True, capture_output=True,
                   env={**os.environ, "FEDMED_PYTHON": str(recorder)})
    argv = json.loads((folder / "argv.json").read_text())
    return parse_config_args([argv[argv.index("--node-config") + 1]])


def compose_node_config(folder: Path) -> dict:
    """hospital-a's node config in docker-compose.yml, with .env as deploy/compose_env.sh writes it and the
    container's folders mapped to folders of this test."""
    consortium_keys(folder)
    env = subprocess.run(["bash", str(ROOT / "deploy" / "compose_env.sh")], check=True, capture_output=True, text=True,
                         env={**os.environ, "FEDMED_PYTHON": sys.executable}).stdout
    values = dict(line.split("=", 1) for line in env.splitlines())
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["hospital-a"]["command"]
    words = shlex.split(command)
    text = words[words.index("--node-config") + 1]
    text = text.replace("${FEDMED_APPROVED_APPS:?run deploy/compose_env.sh > .env first}",
                        values["FEDMED_APPROVED_APPS"])
    places = {"'/data'": folder / "data", "'/state/hospital'": folder / "state",
              "'/keys/hospital-a'": folder / "keys" / "hospital-a", "'/peer-keys'": folder / "peer-keys",
              "'/policy/hospital-a.toml'": folder / "policies" / "hospital-a.toml"}
    for inside, outside in places.items():
        text = text.replace(inside, repr(str(outside)))
    return parse_config_args([text])


@pytest.fixture(scope="module")
def shipped_configs(tmp_path_factory) -> dict[str, dict]:
    """Each documented deployment's node config for hospital-a, written once for this module (its data and state
    folders are each test's own: :func:`deployed`)."""
    made = {}
    for name, write in {"start_supernode.sh": script_node_config, "docker-compose.yml": compose_node_config}.items():
        made[name] = write(tmp_path_factory.mktemp(name.replace(".", "-")))
    return made


SHIPPED = ("start_supernode.sh", "docker-compose.yml")


@pytest.mark.parametrize("shipped", SHIPPED)
def test_the_documented_deployment_approves_the_checkouts_app_and_hands_out_the_consortiums_keys(shipped_configs,
                                                                                               shipped):
    node = shipped_configs[shipped]
    assert node["approved-apps"] == project_app_hash()  # exactly the app `flwr run .` sends from this checkout
    assert sorted(p.name for p in Path(node["peer-keys"]).iterdir()) == ["hospital-a.pub", "hospital-b.pub",
                                                                           "hospital-c.pub"]
    assert Path(node["identity-key"]).name == "hospital-a" and node["hospital"] == "hospital-a"
    assert node["state-dir"] and node["data-dir"]


def test_fedmed_supernode_does_not_start_without_an_approved_app(tmp_path):
    started = subprocess.run([sys.executable, str(SUPERNODE_WITH_EXECUTOR), "--insecure", "--superlink",
                              "127.0.0.1:9", "--node-config", f"hospital='h' data-dir='{tmp_path}'"],
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 2 and "approved-apps" in started.stderr and "--any-app" in started.stderr


def test_without_a_list_no_app_runs_but_with_the_loud_opt_out(tmp_path):
    import hashlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("fedmed_supernode", SUPERNODE_WITH_EXECUTOR)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    class Fab:
        content = b"a coordinator's own app"
        hash_str = hashlib.sha256(content).hexdigest()

    assert "approved no app" in script.app_refusal(Fab, script.approved_apps({}))
    assert script.app_refusal(Fab, script.approved_apps({}), any_app=True) is None
    assert "not among the apps" in script.app_refusal(Fab, script.approved_apps({"approved-apps": "0" * 64}))


# --- the attacks, at a hospital ------------------------------------------------------------------------------------
def message(kind: str, config: dict) -> Message:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as inside a ServerApp
    content = RecordDict({"config": ConfigRecord({**config, "server-round": 1})})
    made = Message(content, dst_node_id=7, message_type=kind)
    made.metadata.__dict__["_message_id"] = "m1"
    return made


def answer(node_config: dict, config: dict, kind: str = MessageType.QUERY, run_config: dict | None = None) -> Message:
    run = dict(run_config or (AT_A_SITE if "data-dir" in node_config else SMALL))
    context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=run)
    return Hospital(context).answer(message(kind, {**run, **config}))


@pytest.fixture
def site_code(tmp_path, monkeypatch):
    """A consortium's package beside the hospital: a network module that imported os.system, a loader that leaves
    a mark in its data folder when it runs and one that dials out."""
    package = tmp_path / "modules" / "my_site"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(textwrap.dedent("""
        from os import system
        import torch

        class Net(torch.nn.Module):
            def __init__(self, num_classes=2, in_channels=3, **kwargs):
                super().__init__()
                self.body = torch.nn.Sequential(torch.nn.Conv2d(in_channels, 4, 3), torch.nn.AdaptiveAvgPool2d(1),
                                                torch.nn.Flatten(), torch.nn.Linear(4, num_classes))

            def forward(self, x):
                return self.body(x)

    """))
    (package / "data.py").write_text(textwrap.dedent(f"""
        import numpy as np
        from common.data.containers import LabelledImages

        def dialling(request):
            import socket
            socket.create_connection(("127.0.0.1", request.args["port"]), 2).close()  # a download, in miniature
            return load(request)

        def load(request):
            open({str(tmp_path / "data" / "loader-ran")!r}, "a").write(request.args.get("labels", "") + "\\n")
            rng = np.random.default_rng(0)
            part = LabelledImages(rng.random((24, 16, 16, 3)).astype(np.float32), np.arange(24) % 2, ["a", "b"])
            return part, part
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    for name in [m for m in sys.modules if m.startswith("my_site")]:
        sys.modules.pop(name)
    return tmp_path


@pytest.fixture
def deployed(tmp_path, shipped_configs):
    """``deployed(shipped, **node config keys)``: a hospital as the docs ship it (the node config of the script or of
    compose, with its own loader listed) or with a hand-made policy (``shipped='policy'``; ``policy``: its text);
    its data and state folders in this test's folder."""
    def make(shipped: str, **extra) -> dict:
        policy = extra.pop("policy", 'methods = ["fedavg"]\n')
        (tmp_path / "data").mkdir(exist_ok=True)
        folders = {"data-dir": str(tmp_path / "data"), "state-dir": str(tmp_path / "state")}
        if shipped == "policy":
            listed = "" if "datasets" in policy else 'datasets = ["my_site.data:load"]\n'
            (tmp_path / "policy.toml").write_text(listed + policy)
            return {"hospital": "h-a", **folders, "policy-file": str(tmp_path / "policy.toml"), **extra}
        return {**shipped_configs[shipped], **folders, "datasets": "my_site.data:load", **extra}

    return make


CONFIGURATIONS = [*SHIPPED, "policy"]

#: node configs that are not Flower simulation's own: each must get a deployed hospital's gate
WIDE = {
    "with its name": {"hospital": "h-a"},
    "with a state folder": {"state-dir": "{tmp}/state"},
    "with its own lists": {"models": "my_site.nets:Net"},
    "with a pinned loader": {"dataset": "synthetic"},
}


@pytest.mark.parametrize("extra", list(WIDE))
@pytest.mark.parametrize("where", ["outside the engine", "inside the engine"])
def test_only_flowers_simulation_is_virtual(tmp_path, site_code, extra, where):
    marker = tmp_path / "pwned"
    node = {"partition-id": 0, "num-partitions": 2,
            **{k: v.replace("{tmp}", str(tmp_path)) for k, v in WIDE[extra].items()}}
    attack = {"model": "os:system", "model-args": json.dumps({"command": f"touch {marker}"})}
    if where == "inside the engine":
        with every_hospital_in_this_process():
            reply = answer(node, attack, run_config={**SMALL, "state-dir": str(tmp_path / "state")})
    else:
        reply = answer(node, attack, run_config={**SMALL, "state-dir": str(tmp_path / "state")})
    assert reply.has_error() and "os:system" in reply.error.reason and not marker.exists()


def test_the_engines_own_node_config_is_virtual_only_inside_the_engine(tmp_path, site_code):
    node = {"partition-id": 0, "num-partitions": 2}
    named = {"model": "my_site.nets:Net"}
    run = {**SMALL, "state-dir": str(tmp_path / "state")}
    outside = answer(node, named, run_config=run)  # a SuperNode started by hand with the engine's keys
    assert outside.has_error() and "not code this hospital approved" in outside.error.reason
    with every_hospital_in_this_process():  # one operator runs every hospital: its run config names the network
        inside = answer(node, named, run_config=run)
    assert not inside.has_error(), inside.error.reason if inside.has_error() else ""


ROGUE = {  # commands without a path (a path would be refused as an argument first): the mark is in the working folder
    "os.system the module imported": ("my_site.nets:*", {"model": "my_site.nets:system",
                                                        "model-args": json.dumps({"command": "touch pwned"})}),
    "MONAI's instantiate": ("monai.*", {"model": "monai.utils:instantiate", "model-args": json.dumps(
        {"__path": "os.system", "__mode": "default", "command": "touch pwned"})}),
    "MONAI's config parser": ("monai.*", {"model": "monai.bundle:ConfigParser"}),
    "a loader's import": ("my_site.*", {"dataset": "my_site.data:np"}),
}


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
@pytest.mark.parametrize("rogue", list(ROGUE))
def test_an_approved_pattern_reaches_only_the_modules_own_networks_and_loaders(tmp_path, site_code, deployed, shipped,
                                                                               rogue, monkeypatch):
    pattern, attack = ROGUE[rogue]
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    lists = ({"policy": f'models = ["{pattern}"]\ndatasets = ["{pattern}", "my_site.data:load"]\n'}
             if shipped == "policy" else {"models": pattern, "datasets": f"{pattern},my_site.data:load"})
    node = deployed(shipped, **lists)
    reply = answer(node, attack)
    assert reply.has_error() and not marker.exists()
    assert any(word in reply.error.reason for word in ("not a network", "not in my_site", "builds objects",
                                                       "not callable", "not a data loader")), \
        reply.error.reason
    own = answer(node, {"model": "my_site.nets:Net"})  # what the pattern is for still runs
    assert (not own.has_error()) if pattern != "monai.*" else own.has_error(), own


def test_policy_check_warns_about_package_wide_patterns(tmp_path, capsys):
    from cli.main import main as fedmed

    node = f"hospital='h-a' data-dir='{tmp_path}' models='monai.*,my_site.nets:Net' datasets='my_site.data:load'"
    assert fedmed(["policy", "check", "--node-config", node]) == 0
    out = capsys.readouterr().out
    assert "WARNING: 'monai.*' approves every module" in out
    assert "my_site.nets:Net" in out and "WARNING: 'my_site.nets:Net'" not in out
    assert "pretrained weights: refused" in out and "local-epochs <= 100" in out


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
def test_a_pretrained_flag_is_refused_before_anything_is_built(site_code, deployed, shipped):
    lists = ({"policy": 'models = ["monai.networks.nets:DenseNet121"]\n'} if shipped == "policy"
             else {"models": "monai.networks.nets:DenseNet121"})
    node = deployed(shipped, **lists)
    reply = answer(node, {"model": "monai.networks.nets:DenseNet121",
                          "model-args": json.dumps({"spatial_dims": 2, "pretrained": True})})
    assert reply.has_error() and "model-args.pretrained=True would fetch weights" in reply.error.reason


@pytest.fixture
def listener():
    """A local server a download would reach: how many connections it accepted."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
def test_nothing_connects_while_a_hospital_answers_even_with_pretrained_weights_allowed(site_code, deployed,
                                                                                      listener, shipped):
    port, accepted = listener
    lists = ({"policy": 'datasets = ["my_site.data:dialling"]\nallow-pretrained = true\n'} if shipped == "policy"
             else {"datasets": "my_site.data:dialling"})
    node = deployed(shipped, **lists)
    reply = answer(node, {"dataset": "my_site.data:dialling", "dataset-args": json.dumps({"port": port})})
    assert reply.has_error() and "reaches no network" in reply.error.reason
    assert accepted == []
    socket.create_connection(("127.0.0.1", port), 2).close()  # outside a hospital's answer the guard is off
    for _ in range(50):
        if accepted:
            break
        threading.Event().wait(0.05)
    assert len(accepted) == 1


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
@pytest.mark.parametrize("key", ["model-args", "dataset-args", "encoder-weights"])
def test_paths_outside_the_hospitals_folders_are_refused_alike_whether_or_not_they_exist(tmp_path, site_code,
                                                                                       deployed, shipped, key):
    lists = ({"policy": 'models = ["my_site.nets:Net"]\ndatasets = ["my_site.data:load"]\n'} if shipped == "policy"
             else {"models": "my_site.nets:Net", "datasets": "my_site.data:load"})
    node = deployed(shipped, **lists)
    secret = tmp_path / "elsewhere" / "secret.csv"
    secret.parent.mkdir()
    secret.write_text("patient,label\n")

    def naming(path: Path) -> dict:
        if key == "encoder-weights":
            return {"model": "resnet18", "encoder-weights": str(path)}
        if key == "model-args":
            return {"model": "my_site.nets:Net", "model-args": json.dumps({"weights_file": str(path)})}
        return {"dataset": "my_site.data:load", "dataset-args": json.dumps({"labels": str(path)})}

    existing, absent = answer(node, naming(secret)), answer(node, naming(tmp_path / "elsewhere" / "none.csv"))
    assert existing.has_error() and absent.has_error()
    strip = lambda reason: reason.rsplit("[audit-head", 1)[0].replace("secret.csv", "none.csv")  # noqa: E731
    assert strip(existing.error.reason) == strip(absent.error.reason)  # the same words: nothing learnt of the disk
    assert "outside this hospital's own folders" in existing.error.reason
    assert not (tmp_path / "data" / "loader-ran").exists()
    inside = Path(node["data-dir"]) / "labels.csv"
    inside.write_text("patient,label\n")
    if key == "dataset-args":  # a path in the hospital's own data folder is read
        ok = answer(node, naming(inside))
        assert not ok.has_error() and str(inside) in (tmp_path / "data" / "loader-ran").read_text()


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
@pytest.mark.parametrize("huge", [{"data-workers": 100000}, {"local-epochs": 10**9}, {"batch-size": 10**9},
                                  {"image-size": 1024, "synthetic-samples": 10**8}])
def test_huge_job_keys_are_refused(site_code, deployed, shipped, huge):
    """Asked with an evaluate message: the shipped policy refuses every plain training request before it looks at
    the job (require-secure-aggregation)."""
    node = deployed(shipped)
    reply = answer(node, huge, MessageType.EVALUATE)
    key = list(huge)[-1]
    assert reply.has_error() and f"{key}=" in reply.error.reason and "more than this hospital allows" in \
        reply.error.reason


def test_a_policy_sets_its_own_job_limits(site_code, deployed):
    node = deployed("policy", policy='[job-limits]\nlocal-epochs = 2\n')
    assert "local-epochs=3 is more than this hospital allows (2" in answer(node, {"local-epochs": 3}).error.reason
    assert not answer(node, {"local-epochs": 2}).has_error()


# --- ledger, log and refusals ----------------------------------------------------------------------------------------
def test_the_ledgers_clock_is_checked_against_the_audit_log(tmp_path):
    audit = AuditLog(tmp_path / "audit.jsonl", "hospital:h")
    ledger = PrivacyLedger(tmp_path / "state", audit)
    for rnd in (1, 2, 3):
        ledger.record("r", rnd, "fedavg", None)
    assert ledger.trainings_since(24 * 3600) == 3
    path = tmp_path / "state" / "privacy-ledger.json"
    releases = json.loads(path.read_text())["releases"]
    assert [r["time"] for r in releases] == [r["time"] for _, r in _releases_in(audit.path)]  # one time for both
    for release in releases:
        release["time"] = "2020-01-01T00:00:00Z"  # set back, to train past max-trainings-per-day
    path.write_text(json.dumps({"releases": releases}))
    with pytest.raises(PolicyRefusal, match="the ledger's clock was edited"):
        ledger.trainings_since(24 * 3600)


def _releases_in(path):
    from common.trust.audit import records_of

    return [(n, r) for n, r in records_of(path) if r.get("event") == "privacy-release"]


@pytest.mark.parametrize("log", ["missing", "empty"])
def test_rebuild_ledger_refuses_a_missing_or_empty_log(tmp_path, capsys, log):
    path = tmp_path / "audit.jsonl"
    if log == "empty":
        path.write_text("")
    assert audit_main(["audit", "rebuild-ledger", str(path), str(tmp_path / "state")]) == 2
    assert f"is {log}" in capsys.readouterr().err
    assert not (tmp_path / "state" / "privacy-ledger.json").exists()


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
def test_refusals_that_leave_a_hospital_name_no_local_path(tmp_path, site_code, deployed, shipped):
    node = deployed(shipped, policy="max-trainings-per-day = 5\n")
    if shipped != "policy":
        node["policy-file"] = str(tmp_path / "policy.toml")
        (tmp_path / "policy.toml").write_text("max-trainings-per-day = 5\n")
    ledger = Path(node["state-dir"]) / "privacy-ledger.json"
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.write_text("{broken")
    reply = answer(node, {}, MessageType.TRAIN)
    reason = reply.error.reason
    assert reply.has_error() and "privacy-ledger.json" in reason and "cannot be read" in reason
    for folder in (node["state-dir"], node["data-dir"], str(tmp_path)):
        assert folder not in reason
    local = [json.loads(line) for line in lines_of(Path(node["state-dir"]) / "audit.jsonl")]
    assert any(str(ledger) in json.dumps(line) for line in local)  # the hospital's own log keeps the whole reason


def test_a_cut_server_log_tail_is_caught_by_verify_peer(tmp_path):
    """The run's end carries the server's last audit head to every hospital: lines after the last training reply
    (its evaluation, its cross-site and closing messages) can no longer be cut off and the rest rechained."""
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, simulated_hospitals
    from .test_audit import rechained
    from .test_strategies import SMALL_CLASSIFICATION, run_config

    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    FedAvgStrategy(run_config=config).start(FakeGrid(simulated_hospitals(config, 2)), num_rounds=2)
    server_log, hospital_log = tmp_path / "results" / "t" / "audit.jsonl", tmp_path / "state" / "hospital-00" / \
        "audit.jsonl"
    hospital = [json.loads(line) for line in lines_of(hospital_log)]
    ended = [r for r in hospital if r.get("kind") == "query" and r.get("direction") == "received"][-1]
    server = [json.loads(line) for line in lines_of(server_log)]
    assert ended["peer-audit-head"] == next(r["hash"] for r in server if r["hash"] == ended["peer-audit-head"])
    assert audit_main(["verify", str(server_log), "--peer", str(hospital_log), "--name", "server"]) == 0
    # the last head a training message carried: before the run's end was announced, what came after it (the last
    # round's replies, its evaluation) could be cut off unseen
    heads = [r["peer-audit-head"] for r in hospital if r.get("kind") == "train" and r.get("direction") == "received"]
    anchored = max(i for i, r in enumerate(server) if r["hash"] == heads[-1])
    assert anchored < len(server) - 3
    server_log.write_bytes(rechained(server[:anchored + 1]))
    cut = [json.loads(line) for line in lines_of(server_log)]
    assert verify(server_log).ok and all(h in {r["hash"] for r in cut} for h in heads)  # every training head holds
    assert audit_main(["verify", str(server_log), "--peer", str(hospital_log), "--name", "server"]) == 1


# --- the command line -----------------------------------------------------------------------------------------------
def run_fedmed(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=120,
                          cwd=PROJECT_ROOT, env={**os.environ, "FLWR_HOME": str(home)})


CLI_CASES = {
    "an unknown run-config key": (["simulate", "--run-config", "nonsense-key=3"], "'nonsense-key' is not a run-config"),
    "an unknown federation key": (["simulate", "--federation-config", "bad=3"], "'bad' is not a key of Flower"),
    "a negative timeout": (["simulate", "--timeout", "-5"], "--timeout: '-5': it must be at least 1"),
    "a negative round": (["evaluate", "--run", ".", "--data", ".", "--round", "-1"], "--round: '-1'"),
    "a network that is os.system": (["simulate", "--run-config", "model='os:system'"], "'os:system' is Python's own"),
    "a node config cut short": (["policy", "check", "--node-config", "hospital='x"], "--node-config"),
    "an app folder in a link loop": (["app-hash", "{tmp}/loop-a"], "symbolic link loop"),
    "an app folder without an app": (["app-hash", "{tmp}"], "holds no pyproject.toml"),
    "a console policy that is not TOML": (["console", "--state", "{tmp}", "--policy", "{tmp}/policy.toml"],
                                          "is not valid TOML"),
    "demo results in a file": (["demo", "--results", "{tmp}/policy.toml"], "not a folder"),
    "a negative federation value": (["simulate", "--federation-config", "client-resources-num-cpus=-1"],
                                    "must be a whole number"),
    "an unknown simulation backend": (["simulate", "--federation-config", "backend='bogus'"], "backend 'ray'"),
    "a federation flag that is a number": (["simulate", "--federation-config", "verbose=3"], "true or false"),
    "a key file that is no key": (["key-fingerprint", "pyproject.toml"], "is not an OpenSSH ECDSA public or private"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_every_subcommand_fails_with_one_line_before_anything_starts(tmp_path, case):
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    (tmp_path / "policy.toml").write_text("models = [not toml\n")
    args, words = CLI_CASES[case]
    home = ["--home", str(tmp_path / "home")] if args[0] in ("simulate", "demo") else []
    done = run_fedmed(*[a.replace("{tmp}", str(tmp_path)) for a in args], *home, home=tmp_path / "home")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert words in done.stderr
    assert not (tmp_path / "home" / "superlink.log").exists() and not list(tmp_path.glob("home/**/*.db"))


def test_help_lists_every_subcommand():
    done = subprocess.run([sys.executable, "-m", "cli.main", "--help"], capture_output=True, text=True,
                          cwd=PROJECT_ROOT, timeout=60)
    for command in ("demo", "simulate", "partition", "export-int8", "segment", "evaluate", "audit", "app-hash",
                    "policy", "console", "key-fingerprint", "runs"):
        assert f"    {command} " in done.stdout, command


# --- peers pinned by the hospital (issue 64) -------------------------------------------------------------------------
def pinned_consortium(tmp_path: Path, shipped: str, shipped_configs: dict, policy_text: str = "") -> tuple[dict, Path]:
    """hospital-a's node config and the folder of the other hospitals' private keys: as the docs ship it (its own
    copy of the peer-keys folder, which the coordinator hands out) or with a hand-made policy (``shipped='policy'``:
    ``policy_text`` and a ``[peers]`` table of the three keys' fingerprints)."""
    import shutil

    from common.trust.identity import key_fingerprint

    from .test_hostile_hospital import key_pair

    (tmp_path / "data").mkdir(exist_ok=True)
    folders = {"data-dir": str(tmp_path / "data"), "state-dir": str(tmp_path / "state")}
    if shipped != "policy":
        node = shipped_configs[shipped]
        peers = tmp_path / "peer-keys"
        shutil.copytree(node["peer-keys"], peers)
        return {**node, **folders, "peer-keys": str(peers)}, Path(node["identity-key"]).parent
    keys, peers = tmp_path / "keys", tmp_path / "peer-keys"
    keys.mkdir()
    peers.mkdir()
    for name in ("hospital-a", "hospital-b", "hospital-c"):
        key_pair(keys, name)
        shutil.copy(keys / f"{name}.pub", peers / f"{name}.pub")
    pins = "".join(f'"{name}" = "{key_fingerprint(keys / f"{name}.pub")}"\n' for name in ("hospital-a", "hospital-b",
                                                                                          "hospital-c"))
    (tmp_path / "policy.toml").write_text(f"{policy_text or 'require-secure-aggregation = true'}\n[peers]\n{pins}")
    return {"hospital": "hospital-a", **folders, "identity-key": str(keys / "hospital-a"), "peer-keys": str(peers),
            "policy-file": str(tmp_path / "policy.toml")}, keys


def rules_of(node: dict):
    """hospital-a's secure-aggregation rules, as its ClientApp reads them from its node config and policy."""
    from client_app.secure_aggregation import hospital_rules

    return hospital_rules(Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={}))[0]


@pytest.mark.parametrize("sybils", ["added to the folder", "in place of the real keys"])
@pytest.mark.parametrize("shipped", CONFIGURATIONS)
def test_sybils_whose_keys_the_coordinator_put_in_the_peer_keys_folder_are_refused(tmp_path, shipped_configs, shipped,
                                                                                   sybils):
    """The issue's Sybil attack: the coordinator runs the other hospitals of hospital-a's round itself, with keys it
    made and put in the peer-keys folder it handed out (beside the real ones, or in their place under the real
    names). hospital-a refuses at share keys, before any share of its secrets leaves: the keys are not the ones its
    policy pins. The real hospitals' keys, in the same folder, pass."""
    from common.trust.secure_aggregation import SecureAggregationSettings
    from common.trust.secure_aggregation.hospital import HospitalRules, SecureAggregationRefusal
    from common.trust.secure_aggregation.inprocess import InProcess

    from .test_hostile_hospital import key_pair

    node, keys = pinned_consortium(tmp_path, shipped, shipped_configs)
    rules = rules_of(node)
    assert rules.pins is not None and sorted(rules.pins) == ["hospital-a", "hospital-b", "hospital-c"]
    honest = InProcess([1, 2, 3], SecureAggregationSettings(), 10, {
        1: rules, **{n: HospitalRules(name, str(keys / name), node["peer-keys"])
                     for n, name in ((2, "hospital-b"), (3, "hospital-c"))}})
    honest.plan.names = {1: "hospital-a", 2: "hospital-b", 3: "hospital-c"}
    honest.keys()
    assert honest.plan.keyed == {1, 2, 3}, honest.plan.lost  # the consortium's own hospitals: every share went out

    forged = tmp_path / "coordinator"
    forged.mkdir()
    names = ["hospital-b", "hospital-c"] if sybils == "in place of the real keys" else ["sybil-1", "sybil-2"]
    for name in names:  # the coordinator's keys, in the folder the hospital was handed
        key_pair(forged, name)
        (Path(node["peer-keys"]) / f"{name}.pub").write_bytes((forged / f"{name}.pub").read_bytes())
    attack = InProcess([1, 2, 3], SecureAggregationSettings(), 10, {
        1: rules_of({**node, "state-dir": str(tmp_path / "state-2")}),  # not refused as the same round again
        **{n: HospitalRules(name, str(forged / name), node["peer-keys"])
                              for n, name in zip((2, 3), names)}})
    attack.plan.names = {1: "hospital-a", 2: names[0], 3: names[1]}
    with pytest.raises(SecureAggregationRefusal, match="is not the one this hospital's policy pins"):
        attack.keys()
    assert attack.states[1].flower.sk1 == b""  # hospital-a kept nothing of the round, shared nothing


@pytest.mark.parametrize("shipped", CONFIGURATIONS)
def test_a_deployed_hospital_requiring_secure_aggregation_takes_part_only_with_pinned_peers(tmp_path, shipped_configs,
                                                                                          shipped):
    """Without the policy's peers (or without peer-keys) a hospital whose policy requires secure aggregation takes
    part in no secure round: every key would be the coordinator's to choose."""
    from common.trust.policy import read_policy

    node, _ = pinned_consortium(tmp_path, shipped, shipped_configs)
    assert rules_of(node).unusable == ""
    policy, _ = read_policy(node["policy-file"])
    assert policy.require_secure_aggregation and policy.min_hospitals_per_sum >= (3 if shipped != "policy" else 2)
    unpinned = tmp_path / "unpinned.toml"
    unpinned.write_text(Path(node["policy-file"]).read_text().split("\n[peers]")[0])
    assert "needs the consortium's keys pinned" in rules_of({**node, "policy-file": str(unpinned)}).unusable
    without_keys = {k: v for k, v in node.items() if k != "peer-keys"}
    assert "needs the consortium's keys pinned" in rules_of(without_keys).unusable


DISTRIBUTED_POLICY = """require-secure-aggregation = true
min-hospitals-per-sum = 4
[distributed-dp]
min-noise-multiplier = 0.6
max-dropped-or-colluding = 1
"""


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
def test_distributed_dp_counts_only_pinned_peers_as_honest(tmp_path, shipped_configs, pinned):
    """A hospital counts the noise of min-hospitals-per-sum less max-dropped-or-colluding hospitals (3 of 4 here)
    only where its peers are pinned; otherwise its own share alone (the server could have run every other
    hospital): a plan of noise 1.0 over 4 hospitals is then 0.5, below its minimum of 0.6, and refused."""
    import json
    from types import SimpleNamespace

    from client_app.hospital import hospital_enforcer
    from client_app.node_config import load_node_config
    from common.trust.secure_aggregation import distributed_dp as ddp
    from common.trust.secure_aggregation.messages import PLAN_KEY

    node, _ = pinned_consortium(tmp_path, "policy", shipped_configs, DISTRIBUTED_POLICY)
    if not pinned:
        Path(node["policy-file"]).write_text(DISTRIBUTED_POLICY)
    enforcer = hospital_enforcer(load_node_config(node), SimpleNamespace(state_dir=str(tmp_path / "state")))
    params = ddp.plan(1.0, 4, 0.5, 100, 2**32, 4)
    payload = SimpleNamespace(config={PLAN_KEY: json.dumps({ddp.PLAN_KEY: params.to_plan()})})
    if pinned:
        assert enforcer.honest_shares == 3
        counted = enforcer.distributed_release(payload, {})
        assert counted["variance"] == pytest.approx(3 * params.local_variance)
    else:
        assert enforcer.honest_shares == 1
        with pytest.raises(PolicyRefusal, match="0.5 from the 1 honest ones it counts on .*not pinned"):
            enforcer.distributed_release(payload, {})


def test_key_fingerprint_prints_what_ssh_keygen_prints_and_the_policys_peers_table(tmp_path):
    """The fingerprint officers compare is OpenSSH's (``ssh-keygen -l``); ``--peers`` prints a table a policy reads,
    and a private key gives its public half's."""
    import shutil

    from common.trust.policy import read_policy

    keys = consortium_keys(tmp_path)
    publics = sorted(keys.glob("*.pub"))
    done = run_fedmed("key-fingerprint", *map(str, publics), keys.joinpath("hospital-a"), home=tmp_path / "home")
    printed = [line.split()[:2] for line in done.stdout.splitlines()]
    assert done.returncode == 0 and [name for _, name in printed] == ["hospital-a", "hospital-b", "hospital-c",
                                                                     "hospital-a"]
    assert printed[0][0] == printed[3][0]  # the private key's public half
    if shutil.which("ssh-keygen"):
        for public, (fingerprint, _) in zip(publics, printed):
            assert subprocess.run(["ssh-keygen", "-l", "-f", str(public)], capture_output=True, text=True,
                                  check=True).stdout.split()[1] == fingerprint
    table = run_fedmed("key-fingerprint", "--peers", *map(str, publics), home=tmp_path / "home").stdout
    (tmp_path / "peers.toml").write_text(table)
    assert read_policy(tmp_path / "peers.toml")[0].peers == {name: fingerprint for fingerprint, name in printed[:3]}
