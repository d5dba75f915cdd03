"""Networks by name or by import path: ``model='resnet18'`` (ours) or ``model='package.module:factory'`` (a
consortium's own), with ``model-args`` (a JSON object) as its keyword arguments; the server and every hospital
build the same network from the same run config.

A factory is called with the keyword arguments the task knows of (``num_classes``/``out_channels``,
``in_channels``, ``spatial_dims``, ``image_size``) that its signature names, then ``model-args`` over them, so
``model='monai.networks.nets:DenseNet121' model-args='{"spatial_dims": 2}'`` works as it is. The built-in
networks are entries of the same table.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Mapping

import torch

from common.settings import ConfigError

#: built-in networks: name -> "module:factory" (each takes the task's keyword arguments it names)
BUILT_IN: dict[str, str] = {
    "resnet18": "common.models.resnet:build_resnet18_classifier",
    "small-cnn": "common.models.small_cnn:build_small_cnn",
    "polyp-unet": "common.models.unet2d:PolypUNet",
    "rfnet": "common.models.rfnet:MultimodalSegNet",
}
#: the task's network when the run config names none
TASK_DEFAULT = {"classification": "resnet18", "polyp-segmentation": "polyp-unet", "brain-tumour-segmentation": "rfnet"}
#: which built-in networks fit which task
TASK_BUILT_IN = {"classification": ("resnet18", "small-cnn"), "polyp-segmentation": ("polyp-unet",),
                 "brain-tumour-segmentation": ("rfnet",)}


class CodeRefused(ConfigError):
    """A hospital was asked to import code it did not approve (``common/trust/code_gate.py``); nothing was imported."""


def is_import_path(name: str) -> bool:
    return ":" in name


def parse_arguments(text: str, key: str) -> dict[str, Any]:
    """``'{"depth": 3}'`` -> ``{"depth": 3}``; ConfigError naming ``key`` for anything but a JSON object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{key}: {text!r} is not JSON ({error.msg}); write a JSON object such as "
                          "'{\"spatial_dims\": 2}'") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{key}: {text!r} is not a JSON object of keyword arguments")
    return value


def load_factory(name: str, key: str = "model"):
    """The callable a model (or data set) name stands for: a built-in name or ``package.module:attribute``;
    ConfigError naming ``key`` when it cannot be imported."""
    from importlib import import_module

    from common.trust.code_gate import kind_of, kind_problem, refusal

    path = BUILT_IN.get(name, name)
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ConfigError(f"{key}: {name!r} is neither a built-in network ({', '.join(BUILT_IN)}) nor "
                          "'package.module:factory'")
    refused = refusal(key, name)  # a hospital imports only the code it approved (common/trust/code_gate.py)
    if refused:
        raise CodeRefused(refused)
    try:
        factory = getattr(import_module(module), attribute)
    except ImportError as error:
        raise ConfigError(f"{key}: {name!r}: module {module!r} cannot be imported ({error})") from None
    except AttributeError:
        raise ConfigError(f"{key}: {name!r}: module {module!r} has no {attribute!r}") from None
    if not callable(factory):
        raise ConfigError(f"{key}: {name!r} is not callable")
    problem = kind_problem(kind_of(key), name, factory) if name not in BUILT_IN else None
    if problem:
        raise CodeRefused(f"{key}: {problem}; it was not run")
    return factory


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
