"""The eager INT8 path that ``fedmed export-int8`` shipped until PT2E replaced it (issue 33), kept here only as the
reference ``benchmarks.qfedpolyp.int8_speed`` measures the maintained paths against; PyTorch has deprecated it.

Static post-training quantisation with ``torch.ao.quantization`` and the x86 engine: every
conv + BatchNorm + ReLU is fused into one quantised kernel, weights are int8 per output channel,
activation ranges come from calibration images, and the skip concatenations become quantised
concatenations (``FloatFunctional``), so the whole network runs in int8 between one quantise and one
dequantise. It takes only the built-in U-Net.

The 2x2 stride-2 transposed convolutions are rewritten, exactly, as a 1x1 convolution to 4x the
channels and a pixel shuffle (``ShuffleUpsample``): torch 2.13's quantised ``ConvTranspose2d`` with
stride 2 gives errors larger than its outputs with the x86/fbgemm and onednn engines (numbers in
docs/qfedpolyp.md), while quantised 1x1 convolutions are right and take per-channel weights.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.ao import quantization as tq

from common.models.unet2d import Concat, ConvBlock
from common.quantization.upsample import without_transposed_convolutions

ENGINE = "x86"


@contextlib.contextmanager
def quiet_deprecations() -> Iterator[None]:
    """torch 2.13 still runs eager-mode quantisation and TorchScript but warns on every call that
    both are deprecated (in favour of torchao and torch.export, which do not cover this yet)."""
    with warnings.catch_warnings():
        for pattern in (r".*torch\.ao\.quantization is deprecated", r".*reduce_range will be deprecated",
                        r".*quantized tensor creation functions", r"`torch\.jit\.\w+` is deprecated"):
            warnings.filterwarnings("ignore", message=pattern)
        yield


class QuantisedConcat(nn.Module):
    """The U-Net's skip concatenation on quantised tensors (a ``FloatFunctional`` observes its output range)."""

    def __init__(self):
        super().__init__()
        self.op = nn.quantized.FloatFunctional()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.op.cat([a, b], dim=1)


class QuantisedModel(nn.Module):
    """float in -> quantise -> the int8 network -> dequantise -> float logits out."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.quant = tq.QuantStub()
        self.network = network
        self.dequant = tq.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.network(self.quant(x)))


def use_engine(engine: str = ENGINE) -> None:
    """Quantised kernels come from a process-wide engine; set it before building or loading an INT8 model."""
    if engine not in torch.backends.quantized.supported_engines:
        raise RuntimeError(f"quantised engine {engine!r} is not available here "
                           f"(have {torch.backends.quantized.supported_engines})")
    torch.backends.quantized.engine = engine


def fusion_groups(model: nn.Module) -> list[list[str]]:
    """[conv, bn, relu] name triples of every ConvBlock, for ``fuse_modules``."""
    groups = []
    for name, module in model.named_modules():
        if isinstance(module, ConvBlock):
            groups += [[f"{name}.conv{i}", f"{name}.bn{i}", f"{name}.relu{i}"] for i in (1, 2)]
    return groups


def prepare_for_calibration(model: nn.Module, engine: str = ENGINE) -> QuantisedModel:
    """A fused copy of ``model`` with observers, ready to see calibration images."""
    use_engine(engine)
    network = without_transposed_convolutions(model).cpu().eval()
    for parent in list(network.modules()):
        for child_name, child in parent.named_children():
            if isinstance(child, Concat):
                setattr(parent, child_name, QuantisedConcat())
    network = tq.fuse_modules(network, fusion_groups(network))
    wrapped = QuantisedModel(network).eval()
    with quiet_deprecations():
        wrapped.qconfig = tq.get_default_qconfig(engine)
        return tq.prepare(wrapped)


@torch.no_grad()
def int8_model(model: nn.Module, calibration: Iterable[torch.Tensor], engine: str = ENGINE) -> QuantisedModel:
    """The INT8 version of a float U-Net; ``calibration`` yields normalised input batches (N, C, H, W)."""
    prepared = prepare_for_calibration(model, engine)
    seen = 0
    for batch in calibration:
        prepared(batch.cpu())
        seen += len(batch)
    if seen == 0:
        raise ValueError("INT8 calibration needs at least one image")
    with quiet_deprecations():
        return tq.convert(prepared.eval())


def frozen_script(model: nn.Module) -> torch.jit.ScriptModule:
    with quiet_deprecations():
        return torch.jit.freeze(torch.jit.script(model.eval()))
