"""An INT8 model of any segmentation network on PyTorch's maintained quantisation path (PT2E, in torchao): the float
network captured by ``torch.export``, observed by the x86 Inductor quantiser (8-bit activations per tensor, int8
weights per output channel), calibrated, converted, and saved as an exported program (``.pt2``) with its metadata.

Activations are kept to 7 bits (the quantiser's ``reduce_range``, its advice for CPUs without int8 dot-product
instructions, where uint8 x int8 products saturate): with 8 bits, a U-Net's compiled output on an AVX2-only AMD EPYC
was on average 0.31 of its logits' standard deviation away from the float network's (0.05 run uncompiled), with 7
bits 0.08 either way. A model runs wherever it is copied, so 7 bits is the default on every CPU.

Run, it is compiled by Inductor with the weights frozen as constants, which is what turns the graph's
quantise/dequantise pairs around each convolution into oneDNN int8 convolutions; without a C++ compiler the same
graph runs as written (float convolutions between quantise and dequantise steps: the same masks, slower), and the
segmenter says so once. Measured beside ONNX Runtime and the deprecated eager path in
``benchmarks.qfedpolyp.int8_speed`` (docs/qfedpolyp.md).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .upsample import without_transposed_convolutions

METADATA_FILE = "fedmed.json"  #: inside the .pt2 archive: image size, threshold, provenance
log = logging.getLogger("fedmed")


def require_torchao():
    try:
        import torchao.quantization.pt2e as pt2e
    except ImportError as error:
        raise RuntimeError(f"the PT2E INT8 model needs torchao ({error}); install fedmed-hospitals[int8]") from None
    return pt2e


def capture(module: nn.Module, first: torch.Tensor) -> torch.export.ExportedProgram:
    """``module`` captured by torch.export with batch and spatial sizes free (channels fixed), traced on two copies
    of one image from ``first``: torch.export specialises a size of 1. ValueError naming what it refused."""
    example = torch.cat([first[:1]] * 2)
    dynamic = ({axis: torch.export.Dim.AUTO for axis in range(example.ndim) if axis != 1},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.export.export(module, (example,), dynamic_shapes=dynamic)
        except Exception as error:
            raise ValueError(f"the network cannot be captured by torch.export for the INT8 model: "
                             f"{type(error).__name__}: {str(error).splitlines()[0][:300]}") from None


def quantise(model: nn.Module, calibration: Iterable[torch.Tensor],
             int8_concatenations: bool = False) -> torch.fx.GraphModule:
    """The converted INT8 graph of ``model``; ``calibration`` yields normalised batches (N, C, H, W);
    ``int8_concatenations``: every concatenation in int8 (:func:`concatenating_quantiser`). ValueError naming what
    torch.export refused."""
    pt2e = require_torchao()
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    batches = [b.detach().cpu().float() for b in calibration]
    if not batches:
        raise ValueError("INT8 calibration needs at least one image")
    exported = capture(without_transposed_convolutions(model).cpu().eval(), batches[0])  # int8 1x1 convolutions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = x86.get_default_x86_inductor_quantization_config(reduce_range=True)
        quantiser = (concatenating_quantiser(x86) if int8_concatenations else x86.X86InductorQuantizer())
        quantiser.set_global(config)
        prepared = prepare_pt2e(exported.module(), quantiser)
        with torch.no_grad():
            for batch in batches:
                prepared(batch)
        converted = convert_pt2e(prepared)
    drop_unused_tensors(converted)
    pt2e.allow_exported_model_train_eval(converted)  # callers (a task's evaluate) switch it to eval()
    return converted


def concatenating_quantiser(x86):
    """The x86 Inductor quantiser, but every concatenation in int8 whatever feeds it.

    The stock quantiser keeps a concatenation in float unless each input comes out of an op it quantised; a U-Net's
    upsampled branch ends in the pixel shuffle's permutes (upsample.py), so every skip concatenation and the copies
    around it ran in float: on an Intel Xeon with AMX, half of the INT8 U-Net's time at batch 8 was there and not in
    its int8 convolutions (docs/qfedpolyp.md, "INT8 against FP32"). Quantising the concatenation's inputs lets
    Inductor move each quantise step above the permutes into the convolution before them, so the shuffle and the
    concatenation move uint8 values: the whole model 1.8x faster at batch 8 there. ``export-int8`` builds both
    and keeps the one that runs faster on the exporting machine."""

    # the quantiser's own helpers (private in torchao 0.x), so a concatenation is annotated exactly as it would be
    class ConcatenatingQuantizer(x86.X86InductorQuantizer):
        def _annotate_propagation_quantizable_pattern(self, node, quantization_config, filter_fn):
            if (node.op == "call_function" and node.target is torch.ops.aten.cat.default
                    and quantization_config is not None and not x86._is_any_annotated([node])
                    and not x86._skip_annotate([node], filter_fn)):
                self._annotate_cat(node, quantization_config)
                return
            super()._annotate_propagation_quantizable_pattern(node, quantization_config, filter_fn)

    return ConcatenatingQuantizer()


def drop_unused_tensors(graph: torch.fx.GraphModule) -> int:
    """Delete the parameters and buffers no node of ``graph`` reads; returns their bytes. After conversion the
    float weights (7.0 of the U-Net's 7.7 MB) stay attributes beside the int8 copies the graph uses, and a saved
    program would carry both."""
    used = {node.target for node in graph.graph.nodes if node.op == "get_attr"}
    dropped = 0
    for name, tensor in [*graph.named_parameters(), *graph.named_buffers()]:
        if name in used:
            continue
        owner, _, leaf = name.rpartition(".")
        delattr(graph.get_submodule(owner) if owner else graph, leaf)
        dropped += tensor.numel() * tensor.element_size()
    return dropped


def export_int8(model: nn.Module, calibration: Iterable[torch.Tensor], out: str | Path,
                metadata: dict[str, Any], int8_concatenations: bool = False) -> Path:
    """``model`` as an INT8 exported program at ``out`` (.pt2), metadata inside."""
    batches = [b.detach().cpu().float() for b in calibration]
    program = capture(quantise(model, batches, int8_concatenations), batches[0])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    quantiser = "x86-inductor" + (", int8 concatenations" if int8_concatenations else "")
    full = {"engine": "pt2e", "quantiser": quantiser, "weight-bits": 8, "activation-bits": 7,
            "calibration-images": int(sum(len(b) for b in batches)), **metadata}
    torch.export.save(program, str(out), extra_files={METADATA_FILE: json.dumps(full, indent=2)})
    return out


def with_metadata(path: str | Path, metadata: dict[str, Any], out: str | Path) -> Path:
    """The program at ``path`` saved at ``out`` with its metadata updated by ``metadata``."""
    files = {METADATA_FILE: ""}
    program = torch.export.load(str(path), extra_files=files)
    full = {**json.loads(files[METADATA_FILE] or "{}"), **metadata}
    torch.export.save(program, str(out), extra_files={METADATA_FILE: json.dumps(full, indent=2)})
    return Path(out)


def compiled(graph: nn.Module) -> Callable:
    """``graph`` compiled by Inductor with frozen weights (the int8 kernels; also faster for a float network), for
    each input shape on its own (``dynamic=False``): once a second shape had been seen, torch.compile's default
    recompiled for any shape and the U-Net at batch 1 took 10.8 ms instead of 7.4 (AMD EPYC Zen 4, 2 threads). A
    segmenter meets two shapes (its batch and the last, shorter one). Inductor's C++ wrapper, not its Python one:
    about 0.8 ms less per call at batch 1 (Intel Xeon with AMX, 2 threads)."""
    import torch._inductor.config as inductor_config

    # process-wide: passing it as torch.compile(options=...) alone failed (Inductor met onednn.qconv_prepack
    # unlowered), as the quantisation patterns are chosen by the global setting
    inductor_config.freezing = True
    return torch.compile(graph, dynamic=False, options={"cpp_wrapper": True})


class Pt2eSegmenter:
    """An exported INT8 program as a callable on torch batches (logits out), with its metadata. Compiled on the first
    call; where compiling fails (no C++ compiler), it runs the graph as written and logs why once."""

    def __init__(self, path: str | Path):
        require_torchao()
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such model file")
        files = {METADATA_FILE: ""}
        try:
            program = torch.export.load(str(path), extra_files=files)
        except Exception as error:
            raise ValueError(f"{path}: not an exported PT2E program ({str(error).splitlines()[0][:200]})") from None
        if not files[METADATA_FILE]:
            raise ValueError(f"{path}: has no {METADATA_FILE}; export it with `fedmed export-int8`")
        self.metadata: dict[str, Any] = json.loads(files[METADATA_FILE])
        self.graph = program.module()
        self.run: Callable = compiled(self.graph)

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.run(x.detach().cpu().float())
        except Exception as error:  # Inductor needs a C++ compiler; the graph itself does not
            if self.run is self.graph:
                raise
            log.warning("INT8 model: torch.compile failed (%s: %s); running the graph uncompiled, slower",
                        type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
            self.run = self.graph
            return self.run(x.detach().cpu().float())

    def eval(self) -> "Pt2eSegmenter":
        return self

    def to(self, *_args, **_kwargs) -> "Pt2eSegmenter":
        return self  # it runs on the CPU
