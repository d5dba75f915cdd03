"""Networks by name or by import path: ``model='resnet18'`` (ours) or ``model='package.module:factory'`` (a
consortium's own), with ``model-args`` (a JSON object) as its keyword arguments; the server and every hospital
build the same network from the same run config.

A factory is called with the keyword arguments the task knows of (``num_classes``/``out_channels``,
``in_channels``, ``spatial_dims``, ``image_size``) that its signature names, then ``model-args`` over them, so
``model='monai.networks.nets:DenseNet121' model-args='{"spatial_dims": 2}'`` works as it is. The built-in
networks are entries of the same table (``BUILT_IN_NETWORKS`` in ``common/trust/code_gate.py``, which loads
every network by name: what a hospital runs without approving it).

At a deployed hospital (a code gate in force) a flag the factory takes as ``True``/``False`` must be given as one
(``"pretrained": "false"`` is a string that reads as true), and the network is first built on PyTorch's meta device,
where nothing is allocated, to count its parameters against the hospital's ``model-parameters`` limit.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from common.settings import ConfigError
from common.trust.code_gate import CodeGate, CodeRefused, gate_in_force, load_factory

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
    """The network ``name`` with the task's ``offered`` keyword arguments it takes and ``arguments`` over them;
    under a hospital's gate its flags must be booleans and its size within the hospital's limit."""
    factory = load_factory(name)
    kwargs = {**accepted(factory, offered), **arguments}
    gate = gate_in_force()
    if gate is not None:
        flags_are_booleans(name, factory, arguments)
        if gate.max_parameters:
            within_size(name, factory, kwargs, gate)
    return construct(name, factory, kwargs)


def construct(name: str, factory: Any, kwargs: Mapping[str, Any]) -> torch.nn.Module:
    try:
        network = factory(**kwargs)
    except TypeError as error:
        raise ConfigError(f"model: {name!r} cannot be built with {sorted(kwargs)}: {error} (model-args gives "
                          "it keyword arguments)") from None
    if not isinstance(network, torch.nn.Module):
        raise ConfigError(f"model: {name!r} returned {type(network).__name__}, not a torch.nn.Module")
    return network


def flags_are_booleans(name: str, factory: Any, arguments: Mapping[str, Any]) -> None:
    """ConfigError for a model-args value that is not a boolean where ``factory`` takes one (its default or its
    annotation is ``bool``)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    for key, value in arguments.items():
        parameter = parameters.get(key)
        takes_flag = parameter is not None and (isinstance(parameter.default, bool)
                                                or parameter.annotation in (bool, "bool"))
        if takes_flag and not isinstance(value, bool):
            raise ConfigError(f"model-args.{key}={value!r}: {name!r} takes true or false there (a string such as "
                              "'false' reads as true), so it was not built")


def within_size(name: str, factory: Any, kwargs: Mapping[str, Any], gate: CodeGate) -> None:
    """Build the network on the meta device (no memory) and refuse it above ``gate.max_parameters``; one that
    cannot be built there is refused unless the hospital named it exactly (then it is built as it is)."""
    try:
        with torch.device("meta"):
            sized = construct(name, factory, kwargs)
    except ConfigError:
        raise
    except Exception as error:
        if gate.named_exactly("model", name):
            return
        raise CodeRefused(f"model: {name!r} cannot be sized before it is built ({type(error).__name__} on "
                          "PyTorch's meta device) and only a pattern approved it: a hospital that wants it names it "
                          "exactly") from None
    count = sum(parameter.numel() for parameter in sized.parameters())
    if count > gate.max_parameters:
        raise CodeRefused(f"model: {name!r} with these model-args has {count:,} parameters, more than this hospital "
                          f"allows ({gate.max_parameters:,}; its policy's [job-limits] model-parameters sets it)")
