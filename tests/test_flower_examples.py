"""Flower's own examples as upstream writes them (examples/quickstart_pytorch, examples/custom_mods,
examples/quickstart_monai: their downloads replaced by generated data, trackers by stubs), each run with our FedAvg,
FedProx, FedProIn and QFedPolyp after the smallest change: for the FedAvg family the import and the constructor
(the final weights are Flower's bit for bit, the metric names the app's); for FedProIn and QFedPolyp also
``HospitalClientApp`` in place of ``ClientApp`` (the same mods and handlers) and the network and a loader named in
the settings. The app's mods see every train message, ours included; its own train loop trains the FedAvg family's
rounds. In one process on a fake Grid, Flower's loop and ours side by side."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType
from flwr.serverapp.strategy import FedAvg, FedProx

from client_app.hospital_mod import HospitalClientApp
from common.config import ConfigError
from strategies import FedAvgStrategy, FedProInStrategy, FedProxStrategy, QFedPolypStrategy
from strategies.records import arrays_of

from .conftest import ROOT
from .fake_grid import FakeGrid, flower_clientapp_node

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # the long tier: a few minutes in all

#: example -> (its folder, its package, its model factory, the train config its ServerApp sends)
EXAMPLES = {
    "quickstart-pytorch": ("quickstart_pytorch", "quickstart", "Net", {"lr": 0.1}),
    "custom-mods": ("custom_mods", "custom_mods", "Net", {"lr": 0.01}),
    "quickstart-monai": ("quickstart_monai", "monaiexample", "load_model", {}),
}


@pytest.fixture
def example(monkeypatch, tmp_path):
    """Imports one example's package as Flower's runtime would (its folder on the path), its trackers writing under
    ``tmp_path``; the modules are removed afterwards."""
    loaded: list[str] = []

    def load(name: str):
        folder, package, factory, train_config = EXAMPLES[name]
        monkeypatch.syspath_prepend(str(ROOT / "examples" / folder))
        monkeypatch.setenv("CUSTOM_MODS_TRACKER_DIR", str(tmp_path / "trackers"))
        monkeypatch.chdir(tmp_path)
        __import__(f"{package}.client_app")
        __import__(f"{package}.task")
        loaded.append(package)
        client, task = sys.modules[f"{package}.client_app"], sys.modules[f"{package}.task"]
        config = tomllib.loads((ROOT / "examples" / folder / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
        return client, task, getattr(task, factory), dict(config["config"]), ConfigRecord(train_config)

    yield load
    for package in loaded:
        for module in [m for m in sys.modules if m.split(".")[0] == package]:
            del sys.modules[module]


def grid_of(app, run_config: dict, nodes: int = 2) -> FakeGrid:
    """Nodes running ``app``; each seeds torch by node and round first, so the same node trains alike whichever
    loop (Flower's or ours) asks it first."""
    def seeded(node_id, answer):
        def reply(message):
            config = message.content.config_records.get("config") if not message.has_error() else None
            torch.manual_seed(node_id * 1000 + int((config or {}).get("server-round", 0)))
            return answer(message)
        return reply

    return FakeGrid({101 + pid: seeded(101 + pid, flower_clientapp_node(
        app, run_config, {"partition-id": pid, "num-partitions": nodes}, 101 + pid)) for pid in range(nodes)})


def as_hospital_clientapp(client) -> HospitalClientApp:
    """The one-line change ``app = HospitalClientApp(mods=...)`` of the example's ``app = ClientApp(mods=...)``: the
    same mods, the same ``train`` and ``evaluate`` functions registered."""
    swapped = HospitalClientApp(mods=list(client.app._mods))
    swapped.train()(client.train)
    swapped.evaluate()(client.evaluate)
    return swapped


def fedmed_settings(tmp_path: Path, name: str, **more) -> dict:
    return {"run-name": name, "results-dir": str(tmp_path / "results"), "state-dir": str(tmp_path / "state"), **more}


@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_the_fedavg_family_gives_flowers_weights_and_keeps_the_apps_loop_mods_and_metric_names(
        tmp_path, example, name, method):
    client, task, factory, run_config, train_config = example(name)
    initial = ArrayRecord(factory().state_dict())
    flowers_type, ours_type = (FedAvg, FedAvgStrategy) if method == "fedavg" else (FedProx, FedProxStrategy)
    mu = {} if method == "fedavg" else {"proximal_mu": 0.1}
    flowers = flowers_type(fraction_evaluate=0.0, **mu).start(grid_of(client.app, run_config), initial_arrays=initial,
                                                              num_rounds=2, train_config=train_config)
    shutil.rmtree(tmp_path / "trackers", ignore_errors=True)  # what the app's trackers log of our run alone
    grid = grid_of(client.app, run_config)
    ours = ours_type(fraction_evaluate=0.0, settings=fedmed_settings(tmp_path, f"{name}-{method}"), **mu).start(
        grid, initial_arrays=initial, num_rounds=2, train_config=train_config)
    assert list(ours.arrays) == list(flowers.arrays)
    for tensor, value in arrays_of(flowers.arrays).items():
        np.testing.assert_array_equal(arrays_of(ours.arrays)[tensor], value, err_msg=tensor)
    for rnd in (1, 2):  # Flower's names, as the app sent them, with Flower's aggregate
        assert ours.train_metrics_clientapp[rnd]["train_loss"] == pytest.approx(
            flowers.train_metrics_clientapp[rnd]["train_loss"], rel=1e-9)
    train = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 4 and all("train_loss" in m.content["metrics"] for m in train)  # the app's own loop
    if name == "custom-mods":
        assert_trackers_saw_every_round(tmp_path, "train_loss")


def assert_trackers_saw_every_round(tmp_path: Path, metric: str) -> None:
    """The app's TensorBoard and W&B mods (stubs) logged ``metric`` of every node's train reply, rounds 1 and 2."""
    scalars = [json.loads(line) for path in (tmp_path / "trackers").rglob("scalars.jsonl")
               for line in path.read_text().splitlines()]
    assert sorted(s["step"] for s in scalars if s["tag"] == metric) == [1, 1, 2, 2]
    wandb = [json.loads(line) for path in (tmp_path / "trackers").glob("wandb-*.jsonl")
             for line in path.read_text().splitlines()]
    assert sorted(w["server-round"] for w in wandb if metric in w) == [1, 1, 2, 2]


def fedmed_data_of(package: str):
    """The loader the FedProIn/QFedPolyp change adds to the app (five lines over its own ``load_data``)."""
    def fedmed_data(request):
        task = sys.modules[f"{package}.task"]
        if request.role == "server":
            return None  # the examples hold no server test set (the server then checks a made-up batch)
        if package == "monaiexample":
            return task.load_data(request.num_partitions, request.partition_id, request.job.batch_size)
        return task.load_data(request.partition_id, request.num_partitions, request.job.batch_size)
    return fedmed_data


quickstart_data = fedmed_data_of("quickstart")
custom_mods_data = fedmed_data_of("custom_mods")
monai_data = fedmed_data_of("monaiexample")
LOADERS = {"quickstart-pytorch": "quickstart_data", "custom-mods": "custom_mods_data",
           "quickstart-monai": "monai_data"}
SHAPES = {"quickstart-pytorch": ("3,32,32", 10), "custom-mods": ("3,32,32", 10), "quickstart-monai": ("1,64,64", 6)}


@pytest.mark.parametrize("strategy_type", [FedProInStrategy, QFedPolypStrategy], ids=lambda s: s.__name__)
@pytest.mark.parametrize("name", EXAMPLES)
def test_the_hospital_step_methods_run_each_example_with_its_mods_seeing_our_messages(tmp_path, example, name,
                                                                                    strategy_type):
    client, task, factory, run_config, train_config = example(name)
    package, model = EXAMPLES[name][1], EXAMPLES[name][2]
    shape, classes = SHAPES[name]
    settings = fedmed_settings(tmp_path, name, **{
        "model": f"{package}.task:{model}", "dataset": f"{__name__}:{LOADERS[name]}", "num-classes": classes,
        "image-size": int(shape.split(",")[-1]), "input-shape": shape, "task": "classification"})
    extra = {"bit_widths": "8"} if strategy_type is QFedPolypStrategy else {"num_prototypes": 1}
    app = as_hospital_clientapp(client)
    grid = grid_of(app, run_config)
    strategy = strategy_type(fraction_evaluate=0.0, settings=settings, **extra)
    result = strategy.start(grid, initial_arrays=ArrayRecord(factory().state_dict()), num_rounds=2,
                            train_config=train_config)
    assert [r["aggregated"] for r in strategy.engine.history] == [["hospital-00", "hospital-01"]] * 2
    if strategy_type is FedProInStrategy:
        assert "prototypes" in result.arrays
    else:
        factory().load_state_dict(result.arrays.to_torch_state_dict())  # the app's own network's tensors
    train = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 4 and not any("train_loss" in m.content["metrics"] for m in train)  # fedmed's step
    assert "train.val-accuracy" in result.train_metrics_clientapp[2]
    if name == "custom-mods":  # the app's mods saw fedmed's train messages and replies
        assert_trackers_saw_every_round(tmp_path, "val-accuracy")


def test_quickstart_monai_with_no_server_data_and_no_input_shape_is_refused_saying_the_batch_was_made_up(
        tmp_path, example):
    example("quickstart-monai")
    settings = fedmed_settings(tmp_path, "monai", **{"model": "monaiexample.task:load_model", "num-classes": 6,
                                                      "dataset": f"{__name__}:monai_data", "image-size": 64})
    with pytest.raises(ConfigError, match=r"made-up batch of zeros .*input-shape='C,H,W'.*expected input\[2, 3, 64, "
                                          r"64\] to have 1 channels"):
        FedProInStrategy(settings=settings).initial_arrays()


@pytest.mark.parametrize("name", ["quickstart-pytorch", "custom-mods"])
def test_with_secure_aggregation_the_apps_own_loop_trains_and_its_mods_see_the_masked_round(tmp_path, example, name):
    """FedAvg with secure aggregation, the app a HospitalClientApp: its own train loop trains (seeded as under
    Flower's FedAvg, so the mean is Flower's but for the masked sum's quantisation) and its mods log each round."""
    from .test_secure_aggregation import STEP

    client, task, factory, run_config, train_config = example(name)
    initial = ArrayRecord(factory().state_dict())
    flowers = FedAvg(fraction_evaluate=0.0).start(grid_of(client.app, run_config), initial_arrays=initial,
                                                  num_rounds=1, train_config=train_config)
    shutil.rmtree(tmp_path / "trackers", ignore_errors=True)
    grid = grid_of(as_hospital_clientapp(client), run_config)
    size = len(task.load_data(0, 2, 32)[0].dataset)  # the weight cap near the hospitals' size, as the docs advise
    ours = FedAvgStrategy(fraction_evaluate=0.0, settings=fedmed_settings(
        tmp_path, name, **{"secure-aggregation.enabled": True, "screening.max-samples": size})).start(
        grid, initial_arrays=initial, num_rounds=1, train_config=train_config)
    for tensor, value in arrays_of(flowers.arrays).items():
        np.testing.assert_allclose(arrays_of(ours.arrays)[tensor], value, atol=3 * STEP + 1e-6, err_msg=tensor)
    flowers_loss = flowers.train_metrics_clientapp[1]["train_loss"]
    assert ours.train_metrics_clientapp[1]["train_loss"] == pytest.approx(flowers_loss)  # the app's own loop's
    if name == "custom-mods":
        scalars = [json.loads(line) for path in (tmp_path / "trackers").rglob("scalars.jsonl")
                   for line in path.read_text().splitlines()]
        assert sorted(s["step"] for s in scalars if s["tag"] == "train_loss") == [1, 1]
