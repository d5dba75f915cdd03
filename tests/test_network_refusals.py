"""One refusal, one exception type: a network without a linear layer is a ConfigError with the same words for every
method that needs the feature vector such a layer reads (MOON, FedProto, FedProIn), before round 1."""

from __future__ import annotations

import pytest
import torch

from common.config import ConfigError
from strategies import FedProInStrategy, FedProtoStrategy, MoonStrategy

from .test_strategies import SMALL_CLASSIFICATION, run_config


def conv_only(num_classes: int = 4) -> torch.nn.Module:
    """Class scores from convolutions and pooling alone: no linear layer to read a feature vector from."""
    return torch.nn.Sequential(torch.nn.Conv2d(3, num_classes, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten())


@pytest.mark.parametrize("strategy_type,method", [(MoonStrategy, "moon"), (FedProtoStrategy, "fedproto"),
                                                  (FedProInStrategy, "fedproin")])
def test_a_network_without_a_linear_layer_is_the_same_configerror_for_every_method(tmp_path, strategy_type, method):
    config = run_config(tmp_path, {**SMALL_CLASSIFICATION, "model": "tests.test_network_refusals:conv_only"})
    strategy = strategy_type(run_config=config)
    with pytest.raises(ConfigError) as refused:
        strategy.initial_arrays()  # builds the method's network and checks it, before anything is sent
    assert type(refused.value) is ConfigError
    assert str(refused.value) == (f"model 'tests.test_network_refusals:conv_only' has no linear layer: {method} "
                                  "needs a classifier whose last linear layer reads a feature vector (e.g. "
                                  "torch.nn.Linear(d, num_classes))")
