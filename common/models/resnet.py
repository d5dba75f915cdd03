"""MONAI's 2D ResNet-18, as a classifier and as the feature encoder of the prototype methods.

MONAI is imported inside the builders: importing it costs seconds of CPU, which every fresh
ClientApp process would pay even for models that do not use it.
"""

from __future__ import annotations

from pathlib import Path

import torch

FEATURE_DIM = 512


def _stem(image_size: int) -> dict:
    # ImageNet stem (7x7, stride 2, max-pool) for real-sized images; a 3x3 stride-1 stem keeps
    # small inputs (<= 64 px) from collapsing to 1x1 before the last stage.
    if image_size > 64:
        return {"conv1_t_size": 7, "conv1_t_stride": 2}
    return {"conv1_t_size": 3, "conv1_t_stride": 1}


def build_resnet18_classifier(num_classes: int, in_channels: int = 3, image_size: int = 128,
                              width: float = 1.0) -> torch.nn.Module:
    """``width`` multiplies the channels (MONAI's widen_factor); 1.0 is the standard ResNet-18."""
    from monai.networks.nets import resnet18

    return resnet18(spatial_dims=2, n_input_channels=in_channels, num_classes=num_classes, widen_factor=width,
                    **_stem(image_size))


def encoder_feature_dim(width: float = 1.0) -> int:
    """Length of the encoder's pooled feature: 512 channels times the width."""
    return int(FEATURE_DIM * width)


def build_resnet18_encoder(in_channels: int = 3, image_size: int = 128, weights: str = "",
                           width: float = 1.0) -> torch.nn.Module:
    """ResNet-18 up to global average pooling: image -> 512-d (times ``width``) post-ReLU feature.

    ``weights`` optionally names a user's pretrained state-dict file (a ``fc.*`` head in it is ignored).
    """
    from monai.networks.nets import resnet18

    encoder = resnet18(spatial_dims=2, n_input_channels=in_channels, feed_forward=False, widen_factor=width,
                       **_stem(image_size))
    if weights:
        load_pretrained(encoder, weights)
    return encoder


def load_pretrained(model: torch.nn.Module, path: str) -> None:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"pretrained weights {file}: file not found")
    state = torch.load(file, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    state = {k.removeprefix("module."): v for k, v in state.items() if not k.removeprefix("module.").startswith("fc.")}
    own = model.state_dict()
    wrong = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    missing = [k for k in own if k not in state and not k.startswith("fc.")]  # a classifier keeps its own head
    if wrong or missing:
        raise ValueError(f"pretrained weights {file}: shape mismatch in {wrong[:3]}, missing {missing[:3]}")
    model.load_state_dict(state, strict=False)
