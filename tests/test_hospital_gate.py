"""The hospital decides what runs at its site (issue 40): a run config or message naming code the hospital did not
approve is refused before anything is imported, a pinned loader wins over the message, approved code of the
consortium's own runs, and the refusal reaches the error reply and both audit logs."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app.api import Hospital
from common.config import load_job_config
from common.trust.audit import GENESIS, head_in_reason
from common.trust.code_gate import CodeGate, CodeRefused, load_factory, named_code

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"run-name": "t", "synthetic-samples": 80, "image-size": 16, "batch-size": 16, "min-partition-size": 5,
         "model": "small-cnn", "strategy": "fedavg", "task": "classification"}

#: code a hostile coordinator names, and the key it names it under
ATTACKS = [
    ({"model": "os:system", "model-args": json.dumps({"command": "touch {marker}"})}, "os:system"),
    ({"model": "subprocess:getoutput", "model-args": json.dumps({"cmd": "touch {marker}"})}, "subprocess:getoutput"),
    ({"dataset": "builtins:print"}, "builtins:print"),
    ({"dataset": "this:s"}, "this:s"),
    ({"dataset": "sys:exit"}, "sys:exit"),
    ({"dataset": "gate_sentinel:load"}, "gate_sentinel:load"),
    ({"task": "brain-tumour-segmentation", "strategy": "fedmepd", "dataset": "synthetic", "model": "rfnet",
      "model-args": json.dumps({"encoder": "gate_sentinel:encoder"})}, "gate_sentinel:encoder"),
]


@pytest.fixture
def sentinel(tmp_path, monkeypatch):
    """A module on the path that leaves a file behind when it is imported: proof that a refusal came first."""
    folder = tmp_path / "modules"
    folder.mkdir()
    marker = tmp_path / "imported"
    (folder / "gate_sentinel.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                             "def load(request):\n    raise SystemExit(3)\n"
                                             "def encoder(**kwargs):\n    raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("gate_sentinel", None)
    return marker


def policy(tmp_path, text='methods = ["fedavg"]\ntasks = ["classification"]\n', name="policy.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def deployed(tmp_path, **node) -> dict:
    data = tmp_path / "site-data"
    data.mkdir(exist_ok=True)
    return {"hospital": "h-a", "data-dir": str(data), "state-dir": str(tmp_path / "state"), **node}


def message(kind: str, config: dict) -> Message:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as inside a ServerApp
    content = RecordDict({"config": ConfigRecord({**config, "server-round": 1})})
    message = Message(content, dst_node_id=7, message_type=kind)
    message.metadata.__dict__["_message_id"] = "m1"
    return message


def answer(node_config: dict, config: dict, kind: str = MessageType.TRAIN) -> Message:
    context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=dict(SMALL))
    return Hospital(context).answer(message(kind, {**SMALL, **config}))


NODES = {
    "deployed": lambda tmp_path: deployed(tmp_path),
    "deployed with a policy": lambda tmp_path: deployed(tmp_path, **{"policy-file": policy(tmp_path)}),
    "simulated with a policy": lambda tmp_path: {"partition-id": 0, "num-partitions": 2,
                                                 "state-dir": str(tmp_path / "state"),
                                                 "policy-file": policy(tmp_path)},
}


@pytest.mark.parametrize("node_kind", list(NODES))
@pytest.mark.parametrize("attack,named", ATTACKS, ids=[named for _, named in ATTACKS])
def test_code_the_hospital_did_not_approve_is_refused_before_it_is_imported(tmp_path, sentinel, attack, named,
                                                                            node_kind):
    marker = tmp_path / "pwned"
    config = {k: v.replace("{marker}", str(marker)) for k, v in attack.items()}
    this_before = "this" in sys.modules
    reply = answer(NODES[node_kind](tmp_path), config)  # sys:exit would end this process if it were called
    assert reply.has_error()
    reason = reply.error.reason
    assert "not code this hospital approved" in reason and named in reason and "not imported" in reason
    assert not marker.exists() and not sentinel.exists()
    assert ("this" in sys.modules) == this_before
    assert head_in_reason(reason) not in (None, GENESIS)  # the refusal is anchored in its audit log
    lines = [json.loads(line) for line in (tmp_path / "state" / "audit.jsonl").read_text().splitlines()]
    assert lines[-1]["direction"] == "sent" and named in lines[-1]["error"]
    if "policy" in node_kind:
        assert any(line.get("decision") == "refused" and named in line.get("reason", "") for line in lines)


@pytest.mark.parametrize("kind", [MessageType.QUERY, MessageType.EVALUATE])
def test_queries_and_evaluations_pass_the_same_gate(tmp_path, sentinel, kind):
    reply = answer(deployed(tmp_path), {"dataset": "gate_sentinel:load"}, kind)
    assert reply.has_error() and "gate_sentinel:load" in reply.error.reason
    assert not sentinel.exists()


def test_the_gate_holds_where_code_is_imported_too(sentinel):
    """Defence in depth: while a hospital answers, load_factory itself refuses what the gate does not allow."""
    with CodeGate(models=("monai.networks.nets:*",)).enforced():
        with pytest.raises(CodeRefused, match="gate_sentinel"):
            load_factory("gate_sentinel:encoder", "model")
        assert load_factory("monai.networks.nets:DenseNet121").__name__ == "DenseNet121"
        assert load_factory("small-cnn") is not None  # built in
    assert not sentinel.exists()


def test_named_code_covers_every_key_that_imports():
    brain = load_job_config({"task": "brain-tumour-segmentation", "strategy": "fedmepd", "model-args": json.dumps(
        {"encoder": "a.b:enc", "decoder": "c:dec"}), "dataset": "x.y:load"})
    assert named_code(brain) == [("dataset", "x.y:load"), ("model-args encoder", "a.b:enc"),
                                 ("model-args decoder", "c:dec")]


@pytest.fixture
def site_package(tmp_path, monkeypatch):
    """A consortium's own network and loader, as a hospital installs them beside its data."""
    folder = tmp_path / "site_pkg"
    folder.mkdir()
    (folder / "site_code.py").write_text(textwrap.dedent("""
        import torch
        from common.data.containers import LabelledImages
        import numpy as np

        def net(num_classes=2, in_channels=3):
            return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 4, 3), torch.nn.AdaptiveAvgPool2d(1),
                                       torch.nn.Flatten(), torch.nn.Linear(4, num_classes))

        def load(request):
            rng = np.random.default_rng(0)
            images = rng.random((24, 16, 16, 3)).astype(np.float32)
            labels = np.arange(24) % 2
            part = LabelledImages(images, labels, ["a", "b"])
            return part, part
    """))
    monkeypatch.syspath_prepend(str(folder))
    return folder


def test_approved_code_of_the_consortium_runs(tmp_path, site_package):
    node = deployed(tmp_path, models="site_code:net", datasets="site_code:load")
    reply = answer(node, {"model": "site_code:net", "dataset": "site_code:load"}, MessageType.QUERY)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    assert reply.content.config_records["hospital"]["num-examples"] == 24
    # a factory function is run only when named exactly: a pattern approves network classes alone
    wide = answer(deployed(tmp_path, models="site_code:*", datasets="site_code:load"),
                  {"model": "site_code:net", "dataset": "site_code:load"}, MessageType.QUERY)
    assert wide.has_error() and "a pattern approves only networks" in wide.error.reason


def test_a_pinned_loader_wins_over_the_message(tmp_path, site_package, sentinel):
    node = deployed(tmp_path, datasets="site_code:load", dataset="site_code:load")
    reply = answer(node, {"dataset": "gate_sentinel:load"}, MessageType.QUERY)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    assert reply.content.config_records["hospital"]["num-examples"] == 24
    assert not sentinel.exists()


def test_the_policy_lists_approved_code_too(tmp_path, site_package):
    node = deployed(tmp_path, **{"policy-file": policy(tmp_path, 'models = ["site_code:net"]\n'
                                                                 'datasets = ["site_code:load"]\n')})
    ok = answer(node, {"model": "site_code:net", "dataset": "site_code:load"}, MessageType.QUERY)
    assert not ok.has_error()
    other = answer(node, {"model": "site_code:other", "dataset": "site_code:load"}, MessageType.QUERY)
    assert other.has_error() and "site_code:other" in other.error.reason


def test_a_hospital_that_refuses_the_runs_code_is_named_in_metrics_jsonl(tmp_path, site_package):
    """Two virtual hospitals take the run's own network; a third, with a policy that lists none, refuses to join:
    the run goes on, and the round records why that node is not in it."""
    from server_app.results import read_history, write_results
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, hospital_node, simulated_hospitals

    config = {**SMALL, "model": "site_code:net", "state-dir": str(tmp_path / "state"),
              "results-dir": str(tmp_path / "results"), "num-classes": 4}
    nodes = simulated_hospitals(config, 2)
    nodes[300] = hospital_node(config, {"partition-id": 0, "num-partitions": 2, "hospital": "strict",
                                        "policy-file": policy(tmp_path, "min-samples = 1\n")}, 300)
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    strategy.start(FakeGrid(nodes), num_rounds=1)
    write_results(strategy.job.run_dir, strategy.job.to_flat(), strategy.engine.history, plots=False)
    record = read_history(strategy.job.run_dir)[0]
    assert record["aggregated"] == ["hospital-00", "hospital-01"]
    assert "model='site_code:net' is not code this hospital approved" in record["not-joined"]["node 300"]


def test_app_hash_is_the_hash_a_supernode_is_sent(tmp_path, capsys):
    """`fedmed app-hash` builds the bundle with Flower's own builder, the one `flwr run` uses; the hash moves with
    any file of the app."""
    import hashlib

    from flwr.cli.build import build_fab_from_disk

    from cli.main import main as fedmed

    from .conftest import ROOT

    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text((ROOT / "examples" / "own_model" / "pyproject.toml").read_text())
    for name in ("client.py", "server.py", "data.py"):
        (app / name).write_text((ROOT / "examples" / "own_model" / name).read_text())
    assert fedmed(["app-hash", str(app)]) == 0
    printed = capsys.readouterr().out
    digest = hashlib.sha256(build_fab_from_disk(app)).hexdigest()
    assert printed.startswith(digest) and "client.py" in printed and f'apps = ["{digest}"]' in printed
    (app / "client.py").write_text((app / "client.py").read_text() + "\n# changed\n")
    assert fedmed(["app-hash", str(app)]) == 0
    assert not capsys.readouterr().out.startswith(digest)


def test_policy_check_prints_what_a_site_allows(tmp_path, capsys):
    from cli.main import main as fedmed

    path_yaml = tmp_path / "p.yaml"
    path_yaml.write_text(f'methods: [fedavg]\nmodels: ["site_code:*"]\napps: ["{"a" * 64}"]\n')
    node = f"hospital='h-a' data-dir='{tmp_path}' datasets='site_code:load' dataset='site_code:load'"
    assert fedmed(["policy", "check", str(path_yaml), "--node-config", node]) == 0
    out = capsys.readouterr().out
    assert "methods: fedavg" in out and "a" * 64 in out and "site_code:*" in out and "site_code:load" in out
    assert "set by the hospital only: state-dir, dataset, dataset-args" in out
    settable = out.split("the server may set: ")[1]
    assert "model" in settable and "dataset," not in settable and "results-dir" not in settable
    path_yaml.write_text("methods: [fedavgg]\n")
    assert fedmed(["policy", "check", str(path_yaml), "--node-config", node]) == 2
    assert "fedavgg" in capsys.readouterr().err
