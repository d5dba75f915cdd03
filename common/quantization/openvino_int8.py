"""An INT8 model run by OpenVINO: ONNX Runtime's QDQ file of the network as it is (transposed convolutions kept),
which OpenVINO turns into int8 oneDNN kernels, the transposed convolutions included.

Why a third runtime for the same kind of file: on an Intel Xeon with AMX (2 threads, the QFedPolyp U-Net at 3x128x128)
OpenVINO ran the QDQ file at batch 1 in 2.7 ms where PyTorch's fastest PT2E model took 5.0 ms, most of that difference
being PyTorch's per-call work around each oneDNN convolution (docs/qfedpolyp.md). ONNX Runtime runs the same file
slower than its own formats (it has no int8 transposed convolution), and the network is not rewritten with a pixel
shuffle here: OpenVINO runs that shuffle as a separate, slower kernel (3.1 ms at batch 1 instead of 2.5 in a probe).

Float parts run in FP32 (``INFERENCE_PRECISION_HINT``): on CPUs with bfloat16 units OpenVINO would otherwise run
them in bfloat16, which is not the model that was calibrated. Each input shape is compiled once, for latency (one
stream), with as many threads as torch uses.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from .onnx_int8 import export_float, quantise, read_metadata, with_metadata


def require_openvino():
    try:
        import openvino
    except ImportError as error:
        raise RuntimeError(f"the OpenVINO INT8 model needs OpenVINO ({error}); install fedmed-hospitals[int8]") \
            from None
    return openvino


def export_int8(model: nn.Module, calibration: Iterable[torch.Tensor], out: str | Path,
                metadata: dict[str, Any]) -> Path:
    """``model`` as a QDQ INT8 ONNX file for OpenVINO at ``out``; ``calibration`` yields normalised input batches."""
    batches = [b.detach().cpu().float().numpy() for b in calibration]
    if not batches:
        raise ValueError("INT8 calibration needs at least one image")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        float_path = export_float(model, torch.from_numpy(batches[0]), Path(work) / "float.onnx")
        quantise(float_path, out, batches, form="qdq")
    return with_metadata(out, {"engine": "openvino", "format": "qdq", "weight-bits": 7,
                               "calibration-images": int(sum(len(b) for b in batches)), **metadata})


class OpenVinoSegmenter:
    """An ONNX model (INT8 QDQ or float) run by OpenVINO on the CPU, as a callable on torch batches (logits out),
    with its fedmed metadata."""

    def __init__(self, path: str | Path, threads: int = 0):
        ov = require_openvino()
        self.path = Path(path)
        self.metadata: dict[str, Any] = read_metadata(self.path)
        self.core = ov.Core()
        self.config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32",
                       "INFERENCE_NUM_THREADS": threads or torch.get_num_threads()}
        self.requests: dict[tuple[int, ...], Any] = {}

    def request(self, shape: tuple[int, ...]):
        """The compiled model's infer request for inputs of ``shape`` (compiled on first use)."""
        if shape not in self.requests:
            model = self.core.read_model(str(self.path))
            model.reshape(list(shape))
            self.requests[shape] = self.core.compile_model(model, "CPU", self.config).create_infer_request()
        return self.requests[shape]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = np.ascontiguousarray(x.detach().cpu().float().numpy())
        request = self.request(tuple(x.shape))
        request.infer({0: x})
        return torch.from_numpy(request.get_output_tensor(0).data.copy())

    def eval(self) -> "OpenVinoSegmenter":
        return self

    def to(self, *_args, **_kwargs) -> "OpenVinoSegmenter":
        return self  # it runs on the CPU, in OpenVINO
