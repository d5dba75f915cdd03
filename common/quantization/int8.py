"""The deployment model: a run's trained polyp segmentation network turned into a real INT8 model file
(``export_int8``, by engine: PT2E in pt2e_int8.py, the default; ONNX Runtime in onnx_int8.py; or the deprecated eager
path below), loaded back (``load_deployment``) and run on a folder of images (``segment_folder``).

The eager path, kept to remake models exported before (PyTorch has deprecated it; PT2E is faster, docs/qfedpolyp.md):
static post-training quantisation with ``torch.ao.quantization`` and the x86 engine: every
conv + BatchNorm + ReLU is fused into one quantised kernel, weights are int8 per output channel,
activation ranges come from calibration images, and the skip concatenations become quantised
concatenations (``FloatFunctional``), so the whole network runs in int8 between one quantise and one
dequantise.

The 2x2 stride-2 transposed convolutions are rewritten, exactly, as a 1x1 convolution to 4x the
channels and a pixel shuffle (``ShuffleUpsample``): torch 2.13's quantised ``ConvTranspose2d`` with
stride 2 gives errors larger than its outputs with the x86/fbgemm and onednn engines (numbers in
docs/qfedpolyp.md), while quantised 1x1 convolutions are right and take per-channel weights.
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.ao import quantization as tq

from common.config import JobConfig
from common.data.containers import DataError
from common.data.image_files import image_size_of, list_images, read_rgb
from common.data.image_mask import data_set_folders
from common.models.unet2d import Concat, ConvBlock, PolypUNet
from common.tasks.base import images_to_tensor

ENGINE = "x86"
METADATA_FILE = "fedmed.json"  #: inside the saved TorchScript archive: image size, threshold, provenance



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


class ShuffleUpsample(nn.Module):
    """``ConvTranspose2d(kernel_size=k, stride=k)`` as a 1x1 conv to ``k*k*C_out`` channels and a pixel shuffle.

    Output pixel (k*i + a, k*j + b) of channel o is ``sum_c x[c, i, j] * W[c, o, a, b] + bias[o]`` in both:
    the 1x1 conv computes it as its channel ``(a*k + b)*C_out + o``, and the shuffle moves it into place.
    The shuffle is written for channels-last memory, the layout of quantised convolutions: one copy, and
    a channels-last result, which the quantised concatenation that follows needs for its fast path.
    """

    def __init__(self, transposed: nn.ConvTranspose2d):
        super().__init__()
        k = transposed.kernel_size[0]
        if (transposed.kernel_size != (k, k) or transposed.stride != (k, k) or transposed.padding != (0, 0)
                or transposed.output_padding != (0, 0) or transposed.dilation != (1, 1) or transposed.groups != 1):
            raise ValueError(f"only non-overlapping transposed convolutions can be rewritten, not {transposed}")
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
        return y.permute(0, 3, 1, 2)  # NCHW shape, channels-last memory


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
    network = copy.deepcopy(model).cpu().eval()
    for parent in list(network.modules()):
        for child_name, child in parent.named_children():
            if isinstance(child, Concat):
                setattr(parent, child_name, QuantisedConcat())
            elif isinstance(child, nn.ConvTranspose2d):
                setattr(parent, child_name, ShuffleUpsample(child))
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


def save_deployment(model: nn.Module, path: str | Path, metadata: dict[str, Any]) -> Path:
    """Frozen TorchScript with ``metadata`` (image size, threshold, provenance) inside the archive."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with quiet_deprecations():
        torch.jit.save(frozen_script(model), str(path),
                       _extra_files={METADATA_FILE: json.dumps({"engine": ENGINE, **metadata}, indent=2)})
    return path


def load_deployment(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """An exported INT8 model and its metadata: a PT2E program (``.pt2``), ONNX Runtime (``.onnx``) or TorchScript
    (``.pt``, the deprecated eager path)."""
    files = {METADATA_FILE: ""}
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such model file")
    if Path(path).suffix == ".pt2":
        from .pt2e_int8 import Pt2eSegmenter

        segmenter = Pt2eSegmenter(path)
        return segmenter, segmenter.metadata
    if Path(path).suffix == ".onnx":
        from .onnx_int8 import OnnxSegmenter

        segmenter = OnnxSegmenter(path)
        return segmenter, segmenter.metadata
    use_engine(ENGINE)
    try:
        with quiet_deprecations():
            model = torch.jit.load(str(path), map_location="cpu", _extra_files=files)
    except RuntimeError as error:
        raise ValueError(f"{path}: not a TorchScript model ({str(error).splitlines()[0]})") from None
    if not files[METADATA_FILE]:
        raise ValueError(f"{path}: has no {METADATA_FILE}; export it with `fedmed export-int8`")
    return model.eval(), json.loads(files[METADATA_FILE])


def find_images(folder: str | Path) -> list[Path]:
    """Image files directly in ``folder``, or in the ``images/`` folders of an image-mask data set
    (its masks are never taken for images)."""
    try:
        sets = data_set_folders(folder)
    except DataError:
        return list_images(Path(folder))
    return [path for data_set in sets for path in list_images(data_set / "images")]


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
    """Write a mask PNG (0/255, the image's own size) for every image under ``images_dir``."""
    model, meta = load_deployment(model_path)
    size, threshold = int(meta["image-size"]), float(meta.get("threshold", 0.5))
    paths = find_images(images_dir)
    if not paths:
        raise DataError(f"{images_dir}: no image files")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for start in range(0, len(paths), batch_size):
        chunk = paths[start:start + batch_size]
        logits = model(images_to_tensor(load_images(chunk, size), torch.device("cpu")))
        masks = (torch.sigmoid(logits[:, 0]) > threshold).numpy().astype(np.uint8) * 255
        for path, mask in zip(chunk, masks):
            target = out_dir / f"{path.stem}.png"
            Image.fromarray(mask).resize(image_size_of(path), Image.NEAREST).save(target)
            written.append(target)
    return written


# --- from a run's checkpoint to a deployment file --------------------------------------------------
def model_from_checkpoint(state: dict[str, np.ndarray]) -> tuple[JobConfig, nn.Module, int]:
    """(run config, float global model, rounds done) from a checkpoint's arrays."""
    from common.arrays import load_model_arrays
    from common.methods.base import unpack_json
    from common.tasks import get_task

    if "run/config" not in state or not any(k.startswith("method/global/") for k in state):
        raise ValueError("checkpoint holds no run config or no 'method/global/*' model arrays")
    cfg = JobConfig.model_validate(unpack_json(state["run/config"]))
    if cfg.task != "polyp-segmentation":
        raise ValueError(f"INT8 export is for polyp segmentation; this run's task is {cfg.task!r}")
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


#: ``export-int8 --engine``: PT2E, PyTorch's maintained quantisation (torchao), of any network (``.pt2``,
#: common/quantization/pt2e_int8.py); ONNX Runtime's static quantisation of any network (``.onnx``,
#: common/quantization/onnx_int8.py); or PyTorch's eager quantisation of the built-in U-Net (TorchScript ``.pt``;
#: deprecated by PyTorch, and no faster than PT2E: kept only to read and re-make models exported before).
#: ``auto``: the first of pt2e, onnxruntime installed, else torch for the built-in U-Net.
ENGINES = ("auto", "pt2e", "onnxruntime", "torch")
SUFFIXES = {"pt2e": ".pt2", "onnxruntime": ".onnx", "torch": ".pt"}


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def choose_engine(engine: str, model: nn.Module) -> str:
    """The engine ``export-int8 --engine`` names, ``auto`` resolved: ValueError naming what cannot be done."""
    if engine not in ENGINES:
        raise ValueError(f"INT8 engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "auto":
        engine = next((e for e, module in (("pt2e", "torchao"), ("onnxruntime", "onnxruntime")) if installed(module)),
                      "torch")
    if engine == "torch" and not isinstance(model, PolypUNet):
        raise ValueError(f"the eager INT8 path takes only the built-in U-Net, not {type(model).__name__} "
                         "(model=...); use --engine pt2e or onnxruntime (install fedmed-hospitals[int8])")
    return engine


def export_int8(state: dict[str, np.ndarray], out: str | Path, calibration_dir: str | Path | None = None,
                num_calibration: int = 64, source: str = "", engine: str = "auto") -> tuple[Path, dict[str, Any]]:
    """A run's final global model as an INT8 model file (:data:`ENGINES`); returns the path and its metadata."""
    cfg, model, rounds = model_from_checkpoint(state)
    engine = choose_engine(engine, model)
    images = calibration_images(cfg, calibration_dir, num_calibration, cfg.seed)
    metadata = {"image-size": cfg.image_size, "in-channels": int(images.shape[-1]), "threshold": 0.5,
                "normalisation": "imagenet" if images.shape[-1] == 3 else "0.5/0.5", "run-name": cfg.run_name,
                "rounds": rounds, "checkpoint": source, "calibration-images": int(len(images))}
    out = Path(out)
    if not out.suffix:  # a default path: the engine's own file type
        out = out.with_suffix(SUFFIXES[engine])
    if out.suffix != SUFFIXES[engine]:
        raise ValueError(f"{out}: a {engine} INT8 model is written as a {SUFFIXES[engine]} file")
    if engine == "pt2e":
        from .pt2e_int8 import export_int8 as export_pt2e_int8

        return export_pt2e_int8(model, list(image_batches(images)), out, metadata), {"engine": "pt2e", **metadata}
    if engine == "onnxruntime":
        from .onnx_int8 import export_int8 as export_onnx_int8

        path = export_onnx_int8(model, list(image_batches(images)), out, metadata)
        return path, {"engine": "onnxruntime", **metadata}
    warnings.warn("export-int8 --engine torch: PyTorch's eager quantisation is deprecated; use pt2e",
                  FutureWarning, stacklevel=2)  # shown by default, unlike a DeprecationWarning
    quantised = int8_model(model, image_batches(images))
    return save_deployment(quantised, out, metadata), metadata
