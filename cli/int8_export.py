"""The deployment model: a run's trained polyp segmentation network turned into a real INT8 model file
(``export_int8``, by engine: PT2E in pt2e_int8.py, ONNX Runtime in onnx_int8.py or OpenVINO in openvino_int8.py,
whichever runs fastest where it is exported), loaded back
(``load_deployment``) and run on a folder of images (``segment_folder``).

PyTorch's eager quantisation (``torch.ao.quantization``, TorchScript ``.pt`` files), which this module used before,
is deprecated by PyTorch and slower than PT2E on the CPU measured (docs/qfedpolyp.md); it is gone from here and
lives on only as the benchmark's reference (benchmarks/qfedpolyp/eager_int8.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from PIL import Image
from torch import nn

from common.config import JobConfig
from common.data.containers import DataError
from common.data.image_files import list_images, read_rgb
from common.data.image_mask import data_set_folders
from common.tasks.base import images_to_tensor

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


def find_images(folder: str | Path) -> list[Path]:
    """Image files directly in ``folder``, or in the ``images/`` folders of an image-mask data set
    (its masks are never taken for images)."""
    try:
        sets = data_set_folders(folder)
    except DataError:
        return list_images(Path(folder))
    return [path for data_set in sets for path in list_images(data_set / "images")]


def dicom_images(folder: str | Path) -> list[Path]:
    """The DICOM files directly under ``folder`` or under the ``images/`` folders of a data set of them (its
    masks/ never taken for images); none for a folder of image files."""
    from common.data.dicom_files import dicom_files

    try:
        sets = [data_set / "images" for data_set in data_set_folders(folder)]
    except DataError:
        sets = [Path(folder)]
    return [path for images in sets if images.is_dir() for path in dicom_files(images)]


def file_sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_images(paths: list[Path], image_size: int) -> np.ndarray:
    """uint8 (N, H, W, 3), resized as in training."""
    return (np.stack([read_rgb(path, image_size) for path in paths]) if paths
            else np.zeros((0, image_size, image_size, 3), np.uint8))


def image_batches(images: np.ndarray, batch_size: int = 16) -> Iterable[torch.Tensor]:
    """Normalised float batches, exactly as the task feeds the network in training."""
    for start in range(0, len(images), batch_size):
        yield images_to_tensor(images[start:start + batch_size], torch.device("cpu"))


@torch.no_grad()
def segment_folder(model_path: str | Path, images_dir: str | Path, out_dir: str | Path,
                   batch_size: int = 8) -> list[Path]:
    """Write a mask PNG (0/255, the image's own size) for every image under ``images_dir``; for DICOM images, DICOM
    SEGs over them naming the run's method, name and checkpoint (:func:`common.data.dicom_images.segment_instances`)."""
    model, meta = load_deployment(model_path)
    normalisation = str(meta.get("normalisation", "imagenet"))
    if normalisation not in ("imagenet", "0.5/0.5"):
        raise ValueError(f"{model_path} takes inputs normalised by the run's own {normalisation} (calibrated on "
                         f"values in {meta.get('calibration-range')}), which segment cannot apply to image files: "
                         "score it with `fedmed evaluate --run RUN --data FOLDER --model MODEL` (a folder that loader "
                         "reads), or run it in Python on your loader's tensors: "
                         "common.quantization.int8.load_deployment(MODEL)")
    size, threshold = int(meta["image-size"]), float(meta.get("threshold", 0.5))

    def predict(images: list[np.ndarray]) -> list[np.ndarray]:
        """Binary masks (0/1) at each image's own size."""
        masks = []
        for start in range(0, len(images), batch_size):
            chunk = images[start:start + batch_size]
            resized = np.stack([np.asarray(Image.fromarray(rgb).resize((size, size), Image.BILINEAR)) for rgb in chunk])
            logits = model(images_to_tensor(resized, torch.device("cpu")))
            for rgb, mask in zip(chunk, (torch.sigmoid(logits[:, 0]) > threshold).numpy().astype(np.uint8)):
                masks.append(np.asarray(Image.fromarray(mask).resize(rgb.shape[1::-1], Image.NEAREST)))
        return masks

    paths = find_images(images_dir)
    out_dir = Path(out_dir)
    instances = [] if paths else dicom_images(images_dir)
    if instances:
        from common.data.dicom_images import segment_instances
        from common.data.dicom_write import Algorithm

        algorithm = Algorithm(str(meta.get("method", "unknown")), str(meta.get("run-name", "")),
                              str(meta.get("checkpoint-sha256") or file_sha256(Path(model_path))))
        return segment_instances(instances, out_dir, predict, algorithm)
    if not paths:
        raise DataError(f"{images_dir}: no image files")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for start in range(0, len(paths), batch_size):
        chunk = paths[start:start + batch_size]
        for path, mask in zip(chunk, predict([read_rgb(path, None) for path in chunk])):
            written.append(out_dir / f"{path.stem}.png")
            Image.fromarray(mask * 255).save(written[-1])
    return written


# --- from a run's checkpoint to a deployment file --------------------------------------------------
def run_config_of(state: dict[str, np.ndarray]) -> JobConfig:
    """The run config of a checkpoint of a polyp run (ValueError otherwise)."""
    from common.methods.base import unpack_json

    if "run/config" not in state or not any(k.startswith("method/global/") for k in state):
        raise ValueError("checkpoint holds no run config or no 'method/global/*' model arrays")
    cfg = JobConfig.model_validate(unpack_json(state["run/config"]))
    if cfg.task != "polyp-segmentation":
        raise ValueError(f"INT8 export is for polyp segmentation; this run's task is {cfg.task!r}")
    return cfg


def model_from_checkpoint(state: dict[str, np.ndarray]) -> tuple[JobConfig, nn.Module, int]:
    """(run config, float global model, rounds done) from a checkpoint's arrays (the run's own network importable:
    :func:`common.engine.run_imports.run_modules_importable`)."""
    from common.arrays import load_model_arrays
    from common.methods.base import unpack_json
    from common.tasks import get_task

    cfg = run_config_of(state)
    arrays = {k.removeprefix("method/global/"): v for k, v in state.items() if k.startswith("method/global/")}
    first_kernel = next((v for v in arrays.values() if v.ndim == 4), None)  # any network: its first convolution
    channels = int(first_kernel.shape[1]) if first_kernel is not None else 3
    model = get_task(cfg, {"in-channels": channels}).build_model()
    load_model_arrays(model, arrays)
    return cfg, model.eval(), len(unpack_json(state["run/history"])) if "run/history" in state else 0


def calibration_images(cfg: JobConfig, folder: str | Path | None = None, count: int = 64, seed: int = 0) -> np.ndarray:
    """``count`` images for INT8 calibration: from ``folder``, or else from the run's own training data
    (never its held-out test set)."""
    rng = np.random.default_rng(seed)
    if folder:
        paths = find_images(folder)
        if not paths:
            raise DataError(f"{folder}: no image files for calibration")
        chosen = sorted(rng.choice(len(paths), size=min(count, len(paths)), replace=False))
        return load_images([paths[i] for i in chosen], cfg.image_size)
    if cfg.dataset != "synthetic" and not cfg.data_dir:
        raise DataError("the run has no data-dir to calibrate on; pass a folder of calibration images")
    from common.data.sources import simulation_split

    pool = simulation_split(cfg).pool
    return pool.images[np.sort(rng.choice(len(pool), size=min(count, len(pool)), replace=False))]


def calibration_batches(cfg: JobConfig, folder: str | Path | None = None, count: int = 64,
                        seed: int = 0) -> list[torch.Tensor]:
    """About ``count`` inputs for INT8 calibration, as the network took them in training: a built-in format's images
    normalised as its task does (:func:`calibration_images`), or the items of the run's own loader (``dataset=
    'package.module:loader'``, its own normalisation), asked for a hospital's training data in ``folder`` or else in
    the run's data-dir (never the held-out test set)."""
    from common.data.loaders import is_custom

    if not is_custom(cfg.dataset):
        return list(image_batches(calibration_images(cfg, folder, count, seed)))
    from common.tasks import task_class

    data_dir = str(folder) if folder else cfg.data_dir
    train, _ = task_class(cfg.task).load_hospital_data(cfg, data_dir=data_dir or None, seed=seed,
                                                       hospital="calibration")
    if not len(train):
        raise DataError(f"dataset {cfg.dataset!r} gave no training items in {data_dir or 'its default place'} to "
                        "calibrate on; pass --calibration-dir, a folder the loader reads as a hospital's")
    chosen = np.sort(np.random.default_rng(seed).choice(len(train), size=min(count, len(train)), replace=False))
    order = [chosen[start:start + 16] for start in range(0, len(chosen), 16)]
    return [x.cpu() for x, _ in train.batches(order, torch.device("cpu"), segmentation=True)]


def input_normalisation(cfg: JobConfig, channels: int) -> str:
    """How the exported model's inputs are normalised (its metadata; ``segment`` feeds images so)."""
    from common.data.loaders import is_custom

    if is_custom(cfg.dataset):
        return f"dataset {cfg.dataset}"  # the loader's own pipeline: segment cannot apply it to image files
    return "imagenet" if channels == 3 else "0.5/0.5"


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


def choice_reason(metadata: dict[str, Any], asked: str, out: Path, engines: list[str]) -> str:
    """Why the INT8 model written is the one: measured fastest here (of how many, on what), or the only one
    ``--engine``, the suffix of ``--out`` or the engines installed left, with what would widen the choice."""
    choice = metadata.get("engine-choice")
    if choice:
        shape = "x".join(str(n) for n in choice["input"])
        reason = (f"fastest here of {len(choice['median-ms-batch-1-and-8'])} INT8 models timed at batch 1 and 8 on "
                  f"{shape} inputs ({choice['cpu']}, {choice['threads']} threads)")
    else:
        reason = "the only INT8 model left to choose"
    if asked != "auto":
        return f"{reason}: --engine {asked} was asked for (--engine auto times every engine installed)"
    if out.suffix and len(engines) < len(installed_engines("auto")):
        return (f"{reason}: --out {out.name} asks for a {out.suffix} file, which only {' or '.join(engines)} "
                f"writes; leave the suffix off --out to have every installed engine timed and the fastest written")
    if len(engines) == 1:
        return f"{reason}: {engines[0]} is the only INT8 engine installed (fedmed-hospitals[int8] installs them all)"
    return reason


def describe_export(metadata: dict[str, Any]) -> str:
    """What ``fedmed export-int8`` prints of an export: the engine, why, each candidate's timing, what was hidden."""
    form = f" ({metadata['format']})" if metadata.get("format") else ""
    lines = [f"engine: {metadata['engine']}{form}, {metadata['chosen-because']}"]
    choice = metadata.get("engine-choice")
    if choice:
        lines.append("  median ms at batch 1 and 8:")
        for label, (one, eight) in sorted(choice["median-ms-batch-1-and-8"].items(), key=lambda i: i[1][0] * i[1][1]):
            written = "   <- written" if label == choice["chosen"] else ""
            lines.append(f"    {label:<24}{one:>9.3f}{eight:>10.3f}{written}")
    lines.append(f"calibrated on {metadata['calibration-images']} images of the run's training data, values "
                 f"{metadata['calibration-range'][0]:.2f} to {metadata['calibration-range'][1]:.2f}")
    if metadata.get("warnings-hidden"):
        lines.append(f"({metadata['warnings-hidden']} warnings of the quantisers held back: the ops they skip or "
                     "leave in float)")
    return "\n".join(lines)


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


def export_int8(state: dict[str, np.ndarray], out: str | Path, calibration_dir: str | Path | None = None,
                num_calibration: int = 64, source: str = "", engine: str = "auto",
                app_dir: str | Path | None = None, timing_size: int | None = None) -> tuple[Path, dict[str, Any]]:
    """A run's final global model as an INT8 model file, its own network and loader imported from where the run took
    them (or ``app_dir``), calibrated on inputs as the run trained on them; returns the path and its metadata.

    ``engine``: one of :data:`ENGINES`; where that leaves more than one INT8 model (:data:`CANDIDATES`, restricted to
    the file type ``out`` names), each is built and timed here at batch 1 and 8 on the run's image size, and the
    fastest is written, the figures in its metadata (``engine-choice``); ``timing_size``: another input edge to time
    them at. The quantisers' own warnings are held back (``warnings-hidden`` counts them) and ``chosen-because``
    says why the engine written is the one."""
    from .quiet import quiet_quantisers

    asked = engine
    engines = installed_engines(engine)
    out = Path(out)
    if out.suffix:
        matching = [e for e in engines if SUFFIXES[e] == out.suffix]
        if not matching:
            raise ValueError(f"{out}: a {' or '.join(engines)} INT8 model is written as a "
                             f"{' or '.join(dict.fromkeys(SUFFIXES[e] for e in engines))} file")
        engines = matching
    with quiet_quantisers() as hidden:
        final, metadata = export_quietly(state, out, calibration_dir, num_calibration, source, engines, app_dir,
                                         timing_size)
    metadata["chosen-because"] = choice_reason(metadata, asked, out, engines)
    metadata["warnings-hidden"] = len(hidden)
    return final, metadata


def export_quietly(state: dict[str, np.ndarray], out: Path, calibration_dir: str | Path | None, num_calibration: int,
                   source: str, engines: list[str], app_dir: str | Path | None,
                   timing_size: int | None) -> tuple[Path, dict[str, Any]]:
    """:func:`export_int8` with the engines to choose from settled, inside :func:`quiet_quantisers`."""
    import shutil
    import tempfile

    from common.engine.run_imports import run_modules_importable

    with run_modules_importable(run_config_of(state), state, app_dir):
        cfg, model, rounds = model_from_checkpoint(state)
        batches = calibration_batches(cfg, calibration_dir, num_calibration, cfg.seed)
    if not batches:
        raise DataError("no images to calibrate on; pass --calibration-dir")
    channels = int(batches[0].shape[1])
    metadata = {"image-size": cfg.image_size, "in-channels": channels, "threshold": 0.5,
                "normalisation": input_normalisation(cfg, channels), "run-name": cfg.run_name, "rounds": rounds,
                "method": cfg.strategy, "checkpoint": source,
                "checkpoint-sha256": file_sha256(Path(source)) if Path(source).is_file() else "",
                "calibration-images": int(sum(len(b) for b in batches)),
                "calibration-range": [float(min(b.min() for b in batches)), float(max(b.max() for b in batches))]}
    labels = [label for label, (e, _) in CANDIDATES.items() if e in engines]
    with tempfile.TemporaryDirectory(prefix="fedmed-int8-") as work:
        files = {label: build_candidate(label, model, batches, Path(work) / (label + SUFFIXES[CANDIDATES[label][0]]),
                                        metadata) for label in labels}
        choice = fastest(files, channels, timing_size or cfg.image_size) if len(files) > 1 else {"chosen": labels[0]}
        chosen, form = choice["chosen"], CANDIDATES[choice["chosen"]][1]
        engine = CANDIDATES[chosen][0]
        final = out if out.suffix else out.with_suffix(SUFFIXES[engine])
        final.parent.mkdir(parents=True, exist_ok=True)
        extra = {"engine-choice": choice} if len(files) > 1 else {}
        if not extra:
            shutil.copyfile(files[chosen], final)
        elif engine == "pt2e":
            from .pt2e_int8 import with_metadata

            with_metadata(files[chosen], extra, final)
        else:
            from .onnx_int8 import with_metadata

            with_metadata(files[chosen], extra, final)
    return final, {"engine": engine, **({"format": form} if form else {}), **metadata, **extra}
