"""Networks by name or by import path: ``model='resnet18'`` (ours) or ``model='package.module:factory'`` (a
consortium's own), with ``model-args`` (a JSON object) as its keyword arguments; the server and every hospital
build the same network from the same run config.

A factory is called with the keyword arguments the task knows of (``num_classes``/``out_channels``,
``in_channels``, ``spatial_dims``, ``image_size``) that its signature names, then ``model-args`` over them, so
``model='monai.networks.nets:DenseNet121' model-args='{"spatial_dims": 2}'`` works as it is. The built-in
networks are entries of the same table (``BUILT_IN_NETWORKS`` in ``common/trust/code_gate.py``, which loads
every network by name: what a hospital runs without approving it).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from common.settings import ConfigError
from common.trust.code_gate import load_factory

#: the task's network when the run config names none
TASK_DEFAULT = {"classification": "resnet18", "polyp-segmentation": "polyp-unet", "brain-tumour-segmentation": "rfnet"}
#: which built-in networks fit which task
TASK_BUILT_IN = {"classification": ("resnet18", "small-cnn"), "polyp-segmentation": ("polyp-unet",),
                 "brain-tumour-segmentation": ("rfnet",)}


def accepted(factory, offered: Mapping[str, Any]) -> dict[str, Any]:
    """The ``offered`` keyword arguments ``factory``'s signature names."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer nothing
        return {}
    return {k: v for k, v in offered.items() if k in parameters
            and parameters[k].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def build_network(name: str, offered: Mapping[str, Any], arguments: Mapping[str, Any]) -> torch.nn.Module:
    """The network ``name`` with the task's ``offered`` keyword arguments it takes and ``arguments`` over them."""
    factory = load_factory(name)
    kwargs = {**accepted(factory, offered), **arguments}
    try:
        network = factory(**kwargs)
    except TypeError as error:
        raise ConfigError(f"model: {name!r} cannot be built with {sorted(kwargs)}: {error} (model-args gives "
                          "it keyword arguments)") from None
    if not isinstance(network, torch.nn.Module):
        raise ConfigError(f"model: {name!r} returned {type(network).__name__}, not a torch.nn.Module")
    return network
