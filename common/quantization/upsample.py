"""Non-overlapping transposed convolutions rewritten, exactly, as a 1x1 convolution and a pixel shuffle, for the INT8
models: PyTorch's int8 kernels take the 1x1 convolution (per-channel int8 weights), while a transposed convolution
stays in float in PT2E's x86 quantiser (its float weights were a quarter of the U-Net's INT8 file) and its eager
quantised kernel with stride 2 is wrong in torch 2.13 (docs/qfedpolyp.md)."""

from __future__ import annotations

import copy

import torch
from torch import nn


def is_rewritable(module: nn.Module) -> bool:
    """A transposed convolution whose kernel equals its stride, with no padding, dilation or groups: its outputs
    never overlap."""
    if not isinstance(module, nn.ConvTranspose2d):
        return False
    k = module.kernel_size[0]
    return (module.kernel_size == (k, k) and module.stride == (k, k) and module.padding == (0, 0)
            and module.output_padding == (0, 0) and module.dilation == (1, 1) and module.groups == 1)


class ShuffleUpsample(nn.Module):
    """``ConvTranspose2d(kernel_size=k, stride=k)`` as a 1x1 conv to ``k*k*C_out`` channels and a pixel shuffle.

    Output pixel (k*i + a, k*j + b) of channel o is ``sum_c x[c, i, j] * W[c, o, a, b] + bias[o]`` in both:
    the 1x1 conv computes it as its channel ``(a*k + b)*C_out + o``, and the shuffle moves it into place.
    The shuffle is written for channels-last memory, the layout of quantised convolutions: one copy, and
    a channels-last result, which the quantised concatenation that follows needs for its fast path.
    """

    def __init__(self, transposed: nn.ConvTranspose2d):
        super().__init__()
        if not is_rewritable(transposed):
            raise ValueError(f"only non-overlapping transposed convolutions can be rewritten, not {transposed}")
        k = transposed.kernel_size[0]
        c_in, c_out = transposed.in_channels, transposed.out_channels
        self.factor, self.out_channels = k, c_out
        self.conv = nn.Conv2d(c_in, c_out * k * k, 1, bias=transposed.bias is not None)
        with torch.no_grad():
            self.conv.weight.copy_(transposed.weight.permute(2, 3, 1, 0).reshape(k * k * c_out, c_in, 1, 1))
            if transposed.bias is not None:
                self.conv.bias.copy_(transposed.bias.repeat(k * k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, _, h, w = y.shape
        k, c = self.factor, self.out_channels
        y = y.permute(0, 2, 3, 1).reshape(n, h, w, k, k, c)  # (n, i, j, a, b, o)
        y = y.permute(0, 1, 3, 2, 4, 5).reshape(n, h * k, w * k, c)  # (n, k*i + a, k*j + b, o)
        # NCHW shape, channels-last memory. The explicit copy (Inductor fuses it into the shuffle's own) states
        # that layout: left a view, Inductor gave it a batch stride of 0 at batch 1, so the concatenation after it
        # could not see channels-last, wrote channels-first and copied back (PT2E INT8 U-Net 25 % slower there)
        return torch.clone(y.permute(0, 3, 1, 2), memory_format=torch.channels_last)


def without_transposed_convolutions(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every non-overlapping transposed convolution replaced by :class:`ShuffleUpsample`
    (the same outputs, to float rounding); any other module as it was."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if is_rewritable(child):
                setattr(parent, name, ShuffleUpsample(child))
    return model
