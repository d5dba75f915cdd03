"""The methods take any network's ``state_dict()`` as a Flower user sends it (``ArrayRecord(model.state_dict())``,
BatchNorm's ``num_batches_tracked`` counters included), on networks MONAI ships with BatchNorm, one with GroupNorm
and one with no normalisation at all."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from torch import nn

from common.config import ConfigError
from strategies import (
    FedAvgStrategy,
    FedBNStrategy,
    FedProInStrategy,
    FedProtoStrategy,
    MoonStrategy,
    QFedPolypStrategy,
)

from .fake_grid import FakeGrid, simulated_hospitals
from .test_strategies import SMALL_CLASSIFICATION, run_config

pytestmark = pytest.mark.usefixtures("one_thread")


class GroupNormNet(nn.Module):
    """A small classifier with GroupNorm (no running statistics, no counters)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, 8, 3, stride=2, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


class PlainNet(nn.Module):
    """A classifier without normalisation layers."""

    def __init__(self, in_channels: int = 3, num_classes: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, 3, stride=4)
        self.fc1 = nn.Linear(4 * 8 * 8, 16)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


DENSENET_ARGS = {"spatial_dims": 2, "growth_rate": 4, "block_config": [1, 1, 1, 1], "init_features": 8, "bn_size": 2}
NETWORKS = {  # name -> (run-config keys, the user's own instance of the network)
    "monai-densenet121-batchnorm": (
        {"model": "monai.networks.nets:DenseNet121", "model-args": json.dumps(DENSENET_ARGS)},
        lambda: __import__("monai").networks.nets.DenseNet121(in_channels=3, out_channels=4, **DENSENET_ARGS)),
    "groupnorm": ({"model": f"{__name__}:GroupNormNet"}, GroupNormNet),
    "no-norm": ({"model": f"{__name__}:PlainNet"}, PlainNet),
}
STRATEGIES = [FedAvgStrategy, FedBNStrategy, MoonStrategy, FedProtoStrategy, FedProInStrategy, QFedPolypStrategy]


def network_config(tmp_path, network: str, **extra) -> dict:
    keys, _ = NETWORKS[network]
    base = {**SMALL_CLASSIFICATION, "task": "classification", "image-size": 32, "num-classes": 4, **keys}
    return run_config(tmp_path, base, **{"qfedpolyp.bit-widths": "8", **extra})


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("strategy_type", STRATEGIES, ids=lambda s: s.__name__)
def test_every_method_takes_the_users_state_dict_counters_included(tmp_path, network, strategy_type):
    if strategy_type is FedBNStrategy and network != "monai-densenet121-batchnorm":  # nothing of its own to keep
        with pytest.raises(ValueError, match="no BatchNorm or InstanceNorm layer to keep local; use fedavg"):
            strategy_type(run_config=network_config(tmp_path, network)).adopt_initial_arrays(
                ArrayRecord(NETWORKS[network][1]().state_dict()), "initial_arrays")
        return
    strategy = strategy_type(run_config=network_config(tmp_path, network))
    state = NETWORKS[network][1]().state_dict()
    counters = [name for name in state if name.endswith("num_batches_tracked")]
    assert bool(counters) == (network == "monai-densenet121-batchnorm")
    strategy.adopt_initial_arrays(ArrayRecord(state), "initial_arrays")
    held = strategy.engine.method.global_arrays
    for name, tensor in state.items():  # the user's weights are the global model's (FedProIn: as its encoder)
        own = f"encoder.{name}" if strategy_type is FedProInStrategy else name
        if own in held:
            np.testing.assert_array_equal(held[own], tensor.numpy(), err_msg=name)
    assert not [name for name in held if name.endswith("num_batches_tracked")]  # counters stay local
    kept = [n for n in state if n in held or f"encoder.{n}" in held]
    replaced = 2 if strategy_type is FedProInStrategy else 0  # its prototypes take the last linear layer's place
    assert len(kept) == len(state) - len(counters) - replaced


def test_fedproin_trains_a_round_from_monai_densenet_state_dict(tmp_path):
    """The issue's case: quickstart-monai's DenseNet121 sent as ``ArrayRecord(model.state_dict())`` to FedProIn."""
    config = network_config(tmp_path, "monai-densenet121-batchnorm", **{"synthetic-samples": 48})
    strategy = FedProInStrategy(run_config=config, num_prototypes=1)
    state = NETWORKS["monai-densenet121-batchnorm"][1]().state_dict()
    result = strategy.start(FakeGrid(simulated_hospitals(config, 2)), initial_arrays=ArrayRecord(state), num_rounds=1)
    assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    assert "prototypes" in result.arrays and "encoder.features.norm0.running_var" in result.arrays


def no_server_data(request):
    """A loader as docs/own-clientapp.md allows: the hospitals' data only, nothing at the server."""
    assert request.role == "server"  # only the server's check runs here
    return None


QUICKSTART_MONAI = {"model": "monai.networks.nets:DenseNet121", "dataset": f"{__name__}:no_server_data",
                    "num-classes": 4, "model-args": json.dumps({**DENSENET_ARGS, "in_channels": 1})}


def test_with_no_data_at_the_server_the_check_says_its_batch_was_made_up_and_how_to_give_the_shape(tmp_path):
    """quickstart-monai's 1-channel DenseNet, a loader that gives the server nothing: the made-up batch has 3
    channels, and the refusal says it was made up and names input-shape."""
    with pytest.raises(ConfigError, match=r"\(2, 3, 32, 32\) inputs, a made-up batch of zeros .*the server holds no "
                                          r"data; input-shape='C,H,W' in the run config"):
        FedAvgStrategy(run_config=run_config(tmp_path, {**QUICKSTART_MONAI, "image-size": 32})).initial_arrays()


@pytest.mark.parametrize("model_args", ["with-in-channels", "without"])
def test_input_shape_gives_the_check_its_batch_and_the_network_its_channels(tmp_path, caplog, model_args):
    keys = dict(QUICKSTART_MONAI)
    if model_args == "without":  # the run config's shape alone tells the factory its in_channels
        keys["model-args"] = json.dumps(DENSENET_ARGS)
    with caplog.at_level("INFO", logger="fedmed"):
        strategy = FedAvgStrategy(run_config=run_config(tmp_path, {**keys, "input-shape": "1,64,64"}))
        strategy.initial_arrays()  # the network is built, and checked, before round 1
    assert strategy.engine.method.global_arrays["features.conv0.weight"].shape[1] == 1
    assert [r for r in caplog.records if "made-up batch of zeros (input-shape" in r.getMessage()]


def test_an_input_shape_that_is_not_one_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="input-shape.*'C,H,W'"):
        FedAvgStrategy(run_config=run_config(tmp_path, {**QUICKSTART_MONAI, "input-shape": "64,64"}))
