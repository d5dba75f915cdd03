"""docs/own-serverapp.md's quickstart diffs: Flower's quickstart-pytorch app (examples/quickstart_pytorch, with
Flower's FedAvg), changed by each diff on that page, runs with FedAvgStrategy, FedProxStrategy, FedProInStrategy and
QFedPolypStrategy: in one process on a fake Grid here, and through ``flwr run`` on a simulation SuperLink in the
slow tier. The diffs are read from the page, so the page shows what runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MessageType, RecordDict

from cli.launch import run_log, submit_run, wait_for_run
from strategies.own_network import into_network

from .conftest import ROOT
from .fake_grid import FakeGrid, flower_clientapp_node
from .flower_processes import simulation_superlink

EXAMPLE = ROOT / "examples" / "quickstart_pytorch"
DOCS = ROOT / "docs" / "own-serverapp.md"
VARIANTS = ("fedavg", "fedprox", "fedproin", "qfedpolyp")
TRAINS_ITSELF = ("fedavg", "fedprox")  # the app's own train loop answers; the others run fedmed's hospital step


def docs_diff(name: str) -> str:
    found = re.search(rf"<!-- quickstart-diff: {name} -->\n```diff\n(.*?)```", DOCS.read_text(), re.S)
    assert found, f"docs/own-serverapp.md has no quickstart diff for {name}"
    return found.group(1)


def variant(tmp_path: Path, name: str) -> Path:
    """A copy of the example with the page's diff for ``name`` applied (git apply: it fails on a stale diff)."""
    app = tmp_path / f"quickstart-{name}"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "apply", "-p1", "-"], input=docs_diff(name), cwd=app, check=True, text=True)
    return app


def app_config(app: Path, **overrides) -> dict:
    """The app's run config as Flower gives it: its pyproject's keys, with ``overrides``."""
    return {**tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"], **overrides}


@pytest.fixture
def app_modules(monkeypatch):
    """Imports the ``quickstart`` package of one copy of the app; the copies share its name, so each test gets its own
    and leaves the modules as they were."""
    before = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "quickstart"}

    def load(app: Path):
        for name in [n for n in sys.modules if n.split(".")[0] == "quickstart"]:
            del sys.modules[name]
        monkeypatch.syspath_prepend(str(app))
        from quickstart import client_app, server_app, task
        return server_app, client_app, task

    yield load
    for name in [n for n in sys.modules if n.split(".")[0] == "quickstart"]:
        del sys.modules[name]
    sys.modules.update(before)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", VARIANTS)
def test_each_diff_of_the_docs_runs_the_quickstart_app_with_our_strategy(tmp_path, monkeypatch, app_modules, name):
    app = variant(tmp_path, name)
    monkeypatch.chdir(tmp_path)  # where the ServerApp and the hospitals write (results/, state/)
    server, client, task = app_modules(app)
    config = app_config(app, **{"num-server-rounds": 2, "model-file": str(tmp_path / "final.pt")})
    grid = FakeGrid({101 + pid: flower_clientapp_node(client.app, config, {"partition-id": pid, "num-partitions": 2},
                                                      101 + pid) for pid in range(2)})
    server.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(config)))

    train = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN and not m.has_error()]
    evaluate = [m for m in grid.replies if m.metadata.message_type == MessageType.EVALUATE and not m.has_error()]
    assert len(train) == 4 and len(evaluate) == 4  # 2 hospitals x 2 rounds, Flower's evaluate phase too
    sent = [m.content["config"] for m in grid.sent_of_type(MessageType.TRAIN)]
    if name in TRAINS_ITSELF:  # Flower's messages, the app's own train loop's replies
        assert all(sorted(m.content["arrays"]) == sorted(task.Net().state_dict()) for m in train)
        assert all("train_loss" in m.content["metrics"] for m in train)
        assert all(config.get("proximal-mu") == (0.1 if name == "fedprox" else None) for config in sent)
    else:  # fedmed's hospital step, through HospitalClientApp's mod
        assert all("fedmed.configrecord-key" in config for config in sent)
        assert all("train_loss" not in m.content["metrics"] and "hospital-seconds" in m.content["metrics"]
                   for m in train)
    state = torch.load(tmp_path / "final.pt")
    assert ("prototypes" in state) == (name == "fedproin")
    model = into_network(state, task.Net())  # the Result loads into the app's network (FedProIn: built on it)
    loss, accuracy = task.test(model, task.load_centralized_dataset(), torch.device("cpu"))
    assert 0.0 <= accuracy <= 1.0 and loss > 0


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", ["fedavg", "moon", "fedproto"])
def test_the_same_hospitalclientapp_serves_moon_fedproto_and_trains_itself_for_fedavg(tmp_path, monkeypatch,
                                                                                      app_modules, method):
    """The FedProIn diff's app, unchanged, under other strategies: MOON and FedProto run fedmed's step on its Net and
    loader; for FedAvg the mod says the app trains itself, so its own train loop answers, under its own name."""
    from strategies import FedAvgStrategy, FedProtoStrategy, MoonStrategy

    app = variant(tmp_path, "fedproin")
    monkeypatch.chdir(tmp_path)
    _, client, task = app_modules(app)
    config = app_config(app)
    grid = FakeGrid({101 + pid: flower_clientapp_node(client.app, config, {"partition-id": pid, "num-partitions": 2},
                                                      101 + pid) for pid in range(2)})
    chosen = {"fedavg": FedAvgStrategy, "moon": MoonStrategy, "fedproto": FedProtoStrategy}[method]
    strategy = chosen(settings={"model": "quickstart.task:Net", "dataset": "quickstart.task:fedmed_data"})
    result = strategy.start(grid, initial_arrays=ArrayRecord(task.Net().state_dict()),
                            train_config=ConfigRecord({"lr": 0.05}), num_rounds=1)
    record = strategy.engine.history[0]
    assert record["aggregated"] == ["hospital-00", "hospital-01"] and "skipped" not in record  # named by the mod
    train = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]
    assert all(("train_loss" in m.content["metrics"]) == (method == "fedavg") for m in train)  # whose loop ran
    queries = [m for m in grid.replies if m.metadata.message_type == MessageType.QUERY]
    assert len(queries) == 4 and not [m for m in queries if m.has_error()]  # who it is, and the run's end: answered
    task.Net().load_state_dict(result.arrays.to_torch_state_dict())  # MOON's and FedAvg's: Net's own tensors
    if method != "fedproto":
        assert 0.0 <= result.evaluate_metrics_serverapp[1]["accuracy"] <= 1.0  # the server's test set: fedmed_data


@pytest.mark.usefixtures("one_thread")
def test_a_hospitalclientapp_serves_fedmepd_with_fedmeds_step_on_the_jobs_data(tmp_path):
    """FedMEPD's hospitals run its step on the built-in brain network: a ClientApp of one's own needs nothing more
    than HospitalClientApp; its own train handler is never asked."""
    from client_app.hospital_mod import HospitalClientApp
    from strategies import FedMEPDStrategy

    from .test_strategies import SMALL_BRAIN, run_config

    app = HospitalClientApp()

    @app.train()
    def own_train(message, context):
        raise AssertionError("FedMEPD's rounds are fedmed's step, not the app's own training")

    config = run_config(tmp_path, SMALL_BRAIN)
    nodes = {101 + pid: flower_clientapp_node(app, config, {"partition-id": pid, "num-partitions": 2}, 101 + pid)
             for pid in range(2)}
    grid = FakeGrid(nodes)
    strategy = FedMEPDStrategy(run_config=config)
    strategy.start(grid, num_rounds=1)
    assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    assert not [m for m in grid.replies if m.has_error()]


@pytest.mark.integration
@pytest.mark.slow  # the long tier (.ci/run): four Flower simulations
@pytest.mark.parametrize("name", VARIANTS)
def test_each_diff_of_the_docs_runs_through_flwr_run_on_a_simulation_superlink(tmp_path, monkeypatch, name):
    app = variant(tmp_path, name)
    monkeypatch.chdir(tmp_path)  # the SuperLink, and so the ServerApp and ClientApps, write here
    model_file = tmp_path / "final.pt"
    with simulation_superlink(tmp_path) as home:
        run_id = submit_run(home, "local", {"num-server-rounds": 2, "model-file": str(model_file)},
                            {"num-supernodes": 2}, app_dir=app)
        status = wait_for_run(home, "local", run_id, 420.0)
        log = run_log(home, "local", run_id)
        assert status == "finished:completed", log[-4000:]
    for rnd in (1, 2):  # the round lines of our loop, streamed as Flower's strategies' are
        assert f"[ROUND {rnd}/2]" in log and f"round {rnd}/2: 2/2 hospitals" in log, log[-4000:]
        assert re.search(rf"round {rnd}: evaluate_fn: accuracy=", log), log[-4000:]
    hospitals = "node-" if name in TRAINS_ITSELF else "hospital-00"
    assert hospitals in log
    if name in TRAINS_ITSELF:  # Flower's error at our identity query: said in words once per node, not Flower's lines
        assert log.count("is a Flower ClientApp that trains the model itself") == 2, log[-4000:]
        assert log.count("No query function registered") <= 2, log[-4000:]
    state = torch.load(model_file)
    assert ("prototypes" in state) == (name == "fedproin") and len(state) > 2
