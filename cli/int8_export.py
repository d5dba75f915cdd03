"""``fedmed export-int8`` and ``fedmed segment``: a run's trained polyp segmentation network, from its checkpoint,
config and training data, turned into a real INT8 model file (``export_int8``: whichever engine of
``common/quantization/int8.py`` runs fastest where it is exported), and that model run on a folder of images
(``segment_folder``). A tool beside the command line: it loads runs, configs, data and tasks, which the plain model
code in common/quantization does not."""

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
from common.quantization.int8 import CANDIDATES, SUFFIXES, build_candidate, fastest, installed_engines, load_deployment
from common.tasks.base import images_to_tensor

log = logging.getLogger("fedmed")


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
    from common.quantization.quiet import quiet_quantisers

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
            from common.quantization.pt2e_int8 import with_metadata

            with_metadata(files[chosen], extra, final)
        else:
            from common.quantization.onnx_int8 import with_metadata

            with_metadata(files[chosen], extra, final)
    return final, {"engine": engine, **({"format": form} if form else {}), **metadata, **extra}
