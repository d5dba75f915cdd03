"""Getting at the representation a regulariser compares (FedProIn's FDL, MOON, FedProto) cheaply.

``FeatureTap`` keeps a layer's input or output from the model's own forward pass, so a loss on
the features costs no second forward; ``frozen_copy`` is the fixed reference network (the received
global model, a hospital's previous model) those losses compare against.
"""

from __future__ import annotations

import copy

import torch

from common.settings import ConfigError


class FeatureTap:
    """The latest input (``use_input``) or output of ``layer``, caught with a forward hook."""

    def __init__(self, layer: torch.nn.Module, use_input: bool = False):
        self.value: torch.Tensor | None = None
        if use_input:
            self._handle = layer.register_forward_pre_hook(lambda _module, inputs: self._keep(inputs[0]))
        else:
            self._handle = layer.register_forward_hook(lambda _module, _inputs, output: self._keep(output))

    def _keep(self, value: torch.Tensor) -> None:
        self.value = value

    def remove(self) -> None:
        self._handle.remove()


def no_linear_layer(name: str, method: str) -> ConfigError:
    """The one refusal of a network without a linear layer, whichever method (MOON, FedProto, FedProIn) finds it."""
    return ConfigError(f"model {name!r} has no linear layer: {method} needs a classifier whose last linear layer "
                       "reads a feature vector (e.g. torch.nn.Linear(d, num_classes))")


def classifier_head(model: torch.nn.Module, name: str = "", method: str = "the method") -> tuple[str, torch.nn.Linear]:
    """Name and module of a classifier's last linear layer (ResNet's ``fc``, the small CNN's ``final.1``);
    :func:`no_linear_layer` where it has none."""
    linears = [(layer, module) for layer, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if not linears:
        raise no_linear_layer(name or type(model).__name__, method)
    return linears[-1]


def classifier_features(model: torch.nn.Module) -> FeatureTap:
    """The feature a classifier feeds its last linear layer (MOON's and FedProto's representation z)."""
    return FeatureTap(classifier_head(model)[1], use_input=True)


def headless(classifier: torch.nn.Module, name: str = "the model",
             method: str = "the prototype methods") -> tuple[torch.nn.Module, int]:
    """``classifier`` with its last linear layer replaced by the identity, and that layer's input size: the
    network's feature vector, where the prototype methods put their prototypes."""
    head_name, head = classifier_head(classifier, name, method)
    parent_name, _, attribute = head_name.rpartition(".")
    parent = classifier.get_submodule(parent_name) if parent_name else classifier
    setattr(parent, attribute, torch.nn.Identity())
    return classifier, int(head.in_features)


class ClassifierFeatures(torch.nn.Module):
    """A classifier that returns the feature its last linear layer reads, instead of class scores."""

    def __init__(self, classifier: torch.nn.Module):
        super().__init__()
        self.classifier = classifier
        self._tap = classifier_features(classifier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier(x)
        return self._tap.value


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy that takes no gradients, for reference features.

    It stays in training mode: BatchNorm normalises with the batch's own statistics, exactly as the
    network being trained does, so at the start of local training both give identical features and
    the difference measures weight drift only (the copy's running statistics are never used).
    Copy before tapping the original: a copy would carry the original's hooks.
    """
    reference = copy.deepcopy(module)
    reference.requires_grad_(False)
    return reference.train()
