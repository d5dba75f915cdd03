"""INT8 deployment models of a network: built by engine (PT2E in pt2e_int8.py, ONNX Runtime in onnx_int8.py or
OpenVINO in openvino_int8.py, :func:`build_candidate`), timed against each other here (:func:`fastest`) and loaded back
(:func:`load_deployment`). Plain PyTorch/ONNX: what loads a run's checkpoint, its config and data and drives an export
(``fedmed export-int8``, ``fedmed segment``) is cli/int8_export.py.

PyTorch's eager quantisation (``torch.ao.quantization``, TorchScript ``.pt`` files), which this module used before,
is deprecated by PyTorch and slower than PT2E on the CPU measured (docs/qfedpolyp.md); it is gone from here and
lives on only as the benchmark's reference (benchmarks/qfedpolyp/eager_int8.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("fedmed")


def load_deployment(path: str | Path, threads: int = 0) -> tuple[Any, dict[str, Any]]:
    """An exported INT8 model (a callable on normalised batches, logits out) and its metadata: a PT2E program
    (``.pt2``) or an ONNX model (``.onnx``), run by the engine it was exported for (an OpenVINO model by ONNX Runtime,
    slower, with a warning, where OpenVINO is not installed). ``threads``: an ONNX engine's threads (0: its default;
    PT2E uses torch's). ValueError naming the file where it is neither."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file")
    if path.suffix == ".pt2":
        from .pt2e_int8 import Pt2eSegmenter

        segmenter = Pt2eSegmenter(path)
        return segmenter, segmenter.metadata
    if path.suffix == ".onnx":
        import importlib.util

        from .onnx_int8 import OnnxSegmenter, read_metadata

        if read_metadata(path).get("engine") == "openvino":
            if importlib.util.find_spec("openvino") is not None:
                from .openvino_int8 import OpenVinoSegmenter

                segmenter = OpenVinoSegmenter(path, threads)
                return segmenter, segmenter.metadata
            log.warning("%s was exported for OpenVINO, which is not installed here: running it with ONNX Runtime, "
                        "slower (pip install openvino, or export it again here)", path)
        segmenter = OnnxSegmenter(path, threads)
        return segmenter, segmenter.metadata
    if path.suffix == ".pt":
        raise ValueError(f"{path}: a TorchScript model of the eager INT8 path, which fedmed no longer runs (PyTorch "
                         "deprecated it); export the run again: fedmed export-int8 --run <run> --out <file>.pt2")
    raise ValueError(f"{path}: not an INT8 model file of fedmed export-int8 (.pt2 or .onnx)")


#: ``export-int8 --engine``: PT2E, PyTorch's maintained quantisation (torchao), ONNX Runtime's static quantisation
#: (also for sites that run no PyTorch or have no C++ compiler), or OpenVINO running ONNX Runtime's QDQ file, each of
#: any network; ``auto``: every installed one measured on this machine, the fastest written
ENGINES = ("auto", "pt2e", "onnxruntime", "openvino")
SUFFIXES = {"pt2e": ".pt2", "onnxruntime": ".onnx", "openvino": ".onnx"}
NEEDS = {"pt2e": "torchao", "onnxruntime": "onnxruntime", "openvino": "openvino"}
#: the INT8 models an export chooses from: label -> (engine, form: ONNX Runtime's format, or PT2E with int8
#: concatenations, pt2e_int8.concatenating_quantiser)
CANDIDATES = {"pt2e": ("pt2e", ""), "pt2e-int8-concat": ("pt2e", "int8-concat"),
              "onnxruntime-qdq": ("onnxruntime", "qdq"), "onnxruntime-qoperator": ("onnxruntime", "qoperator"),
              "openvino-qdq": ("openvino", "qdq")}


def installed_engines(engine: str) -> list[str]:
    """The engines ``export-int8 --engine`` names (``auto``: every one installed): ValueError naming what is
    missing."""
    import importlib.util

    if engine not in ENGINES:
        raise ValueError(f"INT8 engine {engine!r}: use one of {', '.join(ENGINES)}")
    wanted = [e for e in NEEDS if engine in ("auto", e)]
    found = [e for e in wanted if importlib.util.find_spec(NEEDS[e]) is not None]
    if not found:
        raise ValueError(f"INT8 engine {engine}: {' or '.join(NEEDS[e] for e in wanted)} is not installed; "
                         "install fedmed-hospitals[int8]")
    return found


def build_candidate(label: str, model: nn.Module, batches: list[torch.Tensor], path: Path,
                    metadata: dict[str, Any]) -> Path:
    """The INT8 model ``label`` (:data:`CANDIDATES`) of ``model`` at ``path``."""
    engine, form = CANDIDATES[label]
    if engine == "pt2e":
        from .pt2e_int8 import export_int8 as export_pt2e_int8

        return export_pt2e_int8(model, batches, path, metadata, int8_concatenations=form == "int8-concat")
    if engine == "openvino":
        from .openvino_int8 import export_int8 as export_openvino_int8

        return export_openvino_int8(model, batches, path, metadata)
    from .onnx_int8 import export_int8 as export_onnx_int8

    return export_onnx_int8(model, batches, path, metadata, form=form)


def fastest(files: dict[str, Path], channels: int, size: int, repeats: int = 12) -> dict[str, Any]:
    """Which of the INT8 model ``files`` runs fastest here on ``channels`` x ``size`` x ``size`` inputs: the one whose
    median latencies at batch 1 and 8 have the smallest product (geometric mean), with the figures and the CPU."""
    from common.machine import cpu_flags, cpu_name

    from .timing import latencies

    models = {label: load_deployment(path)[0] for label, path in files.items()}
    measured: dict[str, list[float]] = {label: [] for label in files}
    for batch in (1, 8):
        x = torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(batch))
        for label, seconds in latencies(models, x, warmup=3, repeats=repeats if batch == 1 else
                                        max(3, repeats // 4)).items():
            measured[label].append(round(seconds * 1e3, 3))
    chosen = min(measured, key=lambda label: measured[label][0] * measured[label][1])
    return {"chosen": chosen, "median-ms-batch-1-and-8": measured, "input": [channels, size, size],
            "cpu": cpu_name(), "cpu-flags": cpu_flags(), "threads": torch.get_num_threads()}
