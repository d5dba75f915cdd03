"""What a method needs of a network, checked on the server before round 1 on a batch of the server's data (or
zeros of the configured size), so that a network that cannot work stops the run with its name and what is missing
instead of failing in the middle of a round at every hospital.

The needs (``MethodSpec.model_needs``):
- ``any`` (FedAvg, FedProx, FedBN): any module whose output fits the task;
- ``features`` (MOON, FedProto, FedProIn): a classifier whose last linear layer reads a feature vector (FedProIn
  puts its prototypes on that vector, MOON and FedProto compare it);
- ``quantisable`` (QFedPolyp): a segmentation network whose weights are in convolution or linear layers (QAT
  fake-quantises exactly those; the codec sends every weight at the hospital's bit-width) and normalisation layers;
- ``multimodal`` (FedMEPD and its baselines): the RFNet-style network, with encoders and decoder of its own
  if given (``common.models.rfnet``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from common.settings import ConfigError

NORMALISATION = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
#: layers whose few parameters travel at the hospital's bit-width like biases do (QAT fake-quantises weights only)
SMALL_PARAMETERS = (nn.PReLU,)

log = logging.getLogger("fedmed")


def sample_batch(task, data: Any) -> tuple[torch.Tensor, str]:
    """Two inputs as the task feeds its network, and where they come from: from ``data`` where the server holds
    some, else zeros of the run config's ``input-shape`` (or in-channels x image-size x image-size), made up."""
    if data is not None and len(data):
        few = data.subset(np.arange(min(2, len(data)))) if hasattr(data, "subset") else data[:1]
        for x, _ in task.batches(few, 2, torch.device("cpu"), None, train=False):
            return x, "the server's data"
    dims = task.cfg.input_dims
    if dims is None:
        size = task.cfg.image_size
        dims, given = (int(task.spec.get("in-channels", 3)), size, size), "in-channels x image-size x image-size"
    else:
        given = "input-shape"
    made_up = (f"a made-up batch of zeros ({given}: the server holds no data; input-shape='C,H,W' in the run "
               "config gives one input's shape)")
    log.info("model %r is checked on %s", task.network_name, made_up)
    return torch.zeros(2, *dims), made_up


def check_network(task, needs: str, data: Any = None) -> None:
    """Raise ConfigError naming the job's network and what the method misses in it."""
    name = task.network_name
    if needs == "multimodal":
        return check_multimodal(task)
    model = task.build_model()
    x, source = sample_batch(task, data)
    model.eval()
    try:
        with torch.no_grad():
            output = model(x)
    except Exception as error:
        raise ConfigError(f"model {name!r} fails on a batch of {tuple(x.shape)} inputs, {source}: "
                          f"{type(error).__name__}: {error}{layout_hint(error)}") from None
    expected = expected_output(task, x)
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ConfigError(f"model {name!r} gives {shape} for inputs of {tuple(x.shape)}; the {task.name} task needs "
                          f"{expected} (its factory is given num_classes/out_channels; model-args sets the rest)")
    if needs == "features":
        check_features(task, model, x)
    elif needs == "quantisable":
        check_quantisable(name, model)


def layout_hint(error: Exception) -> str:
    """What to change when a network's ``.view`` met a tensor whose memory is not laid out as its shape reads."""
    if "view size is not compatible" not in str(error):
        return ""
    return (". The batches fedmed gives are contiguous NCHW (batch, channels, height, width); a tensor inside the "
            "network is not (a permute, a transpose, or channels-last memory made it so): flatten with "
            "x.reshape(x.shape[0], -1) or torch.flatten(x, 1) instead of x.view(...), or call .contiguous() first")


def expected_output(task, x: torch.Tensor) -> tuple[int, ...]:
    if task.name == "classification":
        return (x.shape[0], task.num_classes)
    return (x.shape[0], 1, *x.shape[2:])


def check_features(task, model: nn.Module, x: torch.Tensor) -> None:
    """The feature the method uses is a (batch, d) vector: FedProIn's encoder output, else the input of the
    network's last linear layer."""
    from .representations import FeatureTap, classifier_head

    name = task.network_name
    if hasattr(model, "prototypes"):  # FedProIn's network: the encoder's output is the feature
        with torch.no_grad():
            feature = model.encoder(x)
        where = "its encoder (the network without its last linear layer)"
    else:
        tap = FeatureTap(classifier_head(model, name, task.cfg.strategy)[1], use_input=True)
        with torch.no_grad():
            model(x)
        tap.remove()
        feature, where = tap.value, "the input of its last linear layer"
    if feature is None or feature.ndim != 2 or feature.shape[0] != x.shape[0]:
        shape = None if feature is None else tuple(feature.shape)
        raise ConfigError(f"model {name!r}: {task.cfg.strategy} needs a feature vector per sample from {where}, "
                          f"got {shape} for {x.shape[0]} samples")


def check_quantisable(name: str, model: nn.Module) -> None:
    """Every layer that holds weights is one QAT and the codec handle: convolution, linear or normalisation."""
    from common.quantization.fake_quant import QUANTISED_LAYERS

    for layer_name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False)]
        if own and not isinstance(module, QUANTISED_LAYERS + NORMALISATION + SMALL_PARAMETERS):
            raise ConfigError(f"model {name!r}: layer {layer_name!r} ({type(module).__name__}) holds weights that "
                              "QFedPolyp's quantisation-aware training cannot fake-quantise (it handles Conv, "
                              "ConvTranspose and Linear layers, and keeps normalisation layers' parameters)")


def check_multimodal(task) -> None:
    """The brain network builds and segments a small crop with every modality (its encoders and decoder included)."""
    model = task.build_model(lacca=True)
    crop = torch.zeros(1, 4, 16, 16, 16)
    crop[:, :, 4:12, 4:12, 4:12] = 1.0
    model.eval()
    try:
        with torch.no_grad():
            logits = model(crop)
    except Exception as error:
        raise ConfigError(f"model {task.network_name!r} (brain network) fails on a 16^3 crop of 4 modalities: "
                          f"{type(error).__name__}: {error}") from None
    if tuple(logits.shape) != (1, int(task.spec.get("num-classes", 4)), 16, 16, 16):
        raise ConfigError(f"model {task.network_name!r} gives {tuple(logits.shape)} for a 16^3 crop; the brain task "
                          "needs (1, 4, 16, 16, 16) logits")
