"""The global model of one of our strategies in a Flower user's own network: what their central ``evaluate_fn`` and
their deployment load.

FedAvg, FedProx, FedBN, MOON and QFedPolyp keep the network's own tensors under its own names: the Result's arrays
load as they do in Flower, ``Net().load_state_dict(result.arrays.to_torch_state_dict())``. FedProIn's global model is
its prototype classifier built on the network: the network without its last linear layer (``encoder.*``) and the
class prototypes in that layer's place (``prototypes``), which does not load into the network itself;
:func:`into_network` builds that classifier around a fresh copy of the network and loads it, and it scores like the
network (class scores out: the nearest prototype's class wins). FedProto and FedMEPD keep no global model of the
network (docs/own-serverapp.md).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord

from common.models.prototype_net import PrototypeNet
from common.models.representations import headless


def into_network(arrays: ArrayRecord | Mapping[str, np.ndarray], network: torch.nn.Module) -> torch.nn.Module:
    """``network`` with the global model ``arrays`` loaded, or for FedProIn's model the prototype classifier built on
    ``network`` (which loses its last linear layer to it); the module to score with. A mismatch is torch's
    ``load_state_dict`` error, naming the tensors."""
    state = (arrays.to_torch_state_dict() if isinstance(arrays, ArrayRecord)
             else {name: torch.as_tensor(np.asarray(value)) for name, value in arrays.items()})
    if "prototypes" in state and all(name == "prototypes" or name.startswith("encoder.") for name in state):
        encoder, feature_dim = headless(network, type(network).__name__, "FedProIn")
        classes, per_class = state["prototypes"].shape[:2]
        network = PrototypeNet(encoder, int(classes), int(per_class), feature_dim)
    network.load_state_dict(state)
    return network
