"""Which state entries of a model belong to its normalisation layers (FedBN keeps these at each hospital)."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _NormBase

from common.arrays import NamedArrays, is_exchanged

#: the group a FedBN reply carries its normalisation layers in, for the server's scoring of its own model only
NORM_GROUP = "norm-layers"


def norm_layer_names(model: torch.nn.Module) -> set[str]:
    """State-dict names of every BatchNorm (and affine or tracking InstanceNorm) layer's parameters and buffers."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, _NormBase):
            names.update(f"{prefix}.{name}" if prefix else name
                         for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
    return {name for name in names if is_exchanged(name)}


def norm_names_of(arrays: NamedArrays) -> set[str]:
    """The normalisation layers' entries of a state dict whose network is not at hand: every layer with running
    statistics (``<layer>.running_mean``), its affine weights and its buffers, its step counter included (the
    state dict is the user's network's as it is: all of the layer stays at the hospital)."""
    layers = {name.removesuffix(".running_mean") for name in arrays if name.endswith(".running_mean")}
    return {name for name in arrays if name.rpartition(".")[0] in layers}


def split_norm_layers(arrays: NamedArrays, norm_names: set[str]) -> tuple[NamedArrays, NamedArrays]:
    """(shared, normalisation-layer) parts of a model's arrays, each in state-dict order."""
    return ({k: v for k, v in arrays.items() if k not in norm_names},
            {k: v for k, v in arrays.items() if k in norm_names})
