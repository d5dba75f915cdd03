"""Quantisation-aware training (paper section 3.3): the forward pass sees b-bit weights, the gradient
passes straight through to the full-precision weights underneath.

``fake_quantize`` uses the same per-tensor asymmetric min-max grid as the payload codec
(``common.quantization.codec``), so the weights a hospital trained with are exactly the weights the
server rebuilds from its codes. The weights are swapped in with PyTorch's parametrisations, which keep
the full-precision tensor as the trained parameter and leave the state dict untouched afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

#: layers whose weights are fake-quantised during local training
QUANTISED_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                    nn.Linear)


def fake_quantize(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """``min + round((w - min) / step) * step`` with ``step = (max - min) / (2^bits - 1)``, per tensor.

    The straight-through estimator ``w + (w~ - w).detach()`` makes the gradient with respect to
    ``w`` the gradient with respect to ``w~``. A constant tensor (step 0) is returned as it is; no
    host synchronisation is needed to find that out.
    """
    if bits >= 32:
        return weight
    detached = weight.detach()
    low, high = detached.min(), detached.max()
    step = (high - low) / (2 ** bits - 1)
    safe_step = torch.where(step > 0, step, torch.ones_like(step))  # constant: w - low is 0 everywhere
    codes = torch.clamp(torch.round((detached - low) / safe_step), 0, 2 ** bits - 1)
    return weight + (low + codes * safe_step - detached)


class FakeQuantize(nn.Module):
    """A parametrisation: the layer's ``weight`` is read through :func:`fake_quantize`."""

    def __init__(self, bits: int):
        super().__init__()
        self.bits = bits

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quantize(weight, self.bits)

    def extra_repr(self) -> str:
        return f"bits={self.bits}"


@contextlib.contextmanager
def quantization_aware(model: nn.Module, bits: int) -> Iterator[nn.Module]:
    """Within the block, every conv/linear weight of ``model`` is fake-quantised to ``bits`` bits.

    The full-precision weights stay the parameters that optimisers update (create the optimiser
    inside the block or outside: the parameter objects are the same). On exit the model is a plain
    model again with those full-precision weights. ``bits >= 32`` changes nothing.
    """
    layers = [m for m in model.modules() if isinstance(m, QUANTISED_LAYERS)] if bits < 32 else []
    for layer in layers:
        parametrize.register_parametrization(layer, "weight", FakeQuantize(bits))
    try:
        yield model
    finally:
        for layer in layers:
            parametrize.remove_parametrizations(layer, "weight", leave_parametrized=False)
