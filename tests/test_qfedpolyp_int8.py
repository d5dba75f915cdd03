"""QFedPolyp's INT8 deployment: PT2E, ONNX Runtime and OpenVINO models close to the float network, the
`fedmed export-int8` / `segment` / `evaluate` commands on the built-in U-Net and a MONAI one, and the benchmark's eager
reference path (the exact rewrite of the transposed convolutions, a quantised U-Net close to the float one)."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.ao.nn import intrinsic, quantized

from benchmarks.qfedpolyp.eager_int8 import int8_model
from cli.main import main as fedmed
from common.config import JobConfig
from common.data.export import write_site
from common.data.sources import generate
from common.data.synthetic import make_polyps
from common.engine.round_engine import RoundEngine
from common.models.unet2d import PolypUNet
from common.quantization.int8 import load_deployment
from common.quantization.upsample import ShuffleUpsample
from common.tasks.base import images_to_tensor
from server_app.checkpoint import save_checkpoint


def test_pixel_shuffle_rewrite_equals_the_transposed_convolution():
    torch.manual_seed(0)
    transposed = nn.ConvTranspose2d(12, 5, 2, stride=2)
    x = torch.randn(3, 12, 7, 9)
    torch.testing.assert_close(ShuffleUpsample(transposed)(x), transposed(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="non-overlapping"):
        ShuffleUpsample(nn.ConvTranspose2d(4, 4, 3, stride=2))


def settled_unet(images: torch.Tensor) -> PolypUNet:
    """An untrained U-Net whose BatchNorm statistics match ``images``, so its logits carry signal."""
    torch.manual_seed(0)
    model = PolypUNet()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None  # a plain average over the batches seen
            module.reset_running_stats()
    with torch.no_grad():
        model.train()(images)
    return model.eval()


def test_eager_reference_int8_model_runs_quantised_kernels_and_stays_close_to_fp32():
    images = images_to_tensor(make_polyps(48, 32, seed=0).images, torch.device("cpu"))
    model = settled_unet(images[:32])
    quantised = int8_model(model, [images[:32]])
    network = quantised.network
    assert isinstance(network.enc1.conv1, intrinsic.quantized.ConvReLU2d)  # conv + BN + ReLU fused, int8
    assert isinstance(network.up1.conv, quantized.Conv2d) and isinstance(network.cat1.op, quantized.QFunctional)
    with torch.no_grad():
        reference, output = model(images[32:]), quantised(images[32:])
    error = (output - reference).abs()
    assert error.mean() < 0.15 * reference.std()
    assert ((output > 0) == (reference > 0)).float().mean() > 0.9


def saved_run(tmp_path, image_size: int = 32, **extra) -> JobConfig:
    """A polyp run of one (untrained) round saved under ``tmp_path / 'run'``; its config."""
    cfg = JobConfig(run_name="q", task="polyp-segmentation", strategy="qfedpolyp", synthetic_samples=40,
                    image_size=image_size, min_partition_size=5, **extra)
    engine = RoundEngine(cfg)
    engine.history = [{"round": 1}]
    save_checkpoint(tmp_path / "run", 1, engine.state_dict())
    return cfg


@pytest.mark.slow  # every engine built and timed (about 2 min); fast: the ONNX export-and-segment test below
def test_export_a_run_and_segment_a_folder(tmp_path, capsys):
    """PT2E (a .pt2 asked for, torchao installed, as with the test extras): export, segment, evaluate."""
    pytest.importorskip("torchao")
    cfg = saved_run(tmp_path)

    model_file = tmp_path / "polyp-int8.pt2"
    assert fedmed(["export-int8", "--run", str(tmp_path / "run"), "--out", str(model_file),
                   "--calibration-images", "16"]) == 0
    loaded, metadata = load_deployment(model_file)
    assert metadata["engine"] == "pt2e" and metadata["image-size"] == 32 and metadata["rounds"] == 1
    assert metadata["calibration-images"] == 16
    assert "round-00001.npz" in metadata["checkpoint"]

    frames = tmp_path / "frames"
    frames.mkdir()
    sizes = {"a": (40, 30), "b": (32, 32), "c": (17, 50)}
    rng = np.random.default_rng(0)
    for name, (width, height) in sizes.items():
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(frames / f"{name}.png")
    assert fedmed(["segment", "--model", str(model_file), "--images", str(frames),
                   "--out", str(tmp_path / "masks")]) == 0
    assert "3 masks written" in capsys.readouterr().out
    for name, size in sizes.items():
        with Image.open(tmp_path / "masks" / f"{name}.png") as mask:
            assert mask.size == size and set(np.unique(np.asarray(mask))) <= {0, 255}

    labelled = tmp_path / "labelled"  # `fedmed evaluate` scores the INT8 model against the float one
    write_site(cfg, generate("polyp-segmentation", 8, 32, seed=5), labelled, "test")
    assert fedmed(["evaluate", "--run", str(tmp_path / "run"), "--data", str(labelled), "--model", str(model_file),
                   "--out", str(tmp_path / "int8-scores")]) == 0
    assert fedmed(["evaluate", "--run", str(tmp_path / "run"), "--data", str(labelled),
                   "--out", str(tmp_path / "float-scores")]) == 0
    int8, floats = (json.loads((tmp_path / f"{n}-scores.json").read_text()) for n in ("int8", "float"))
    assert int8["model"] == "INT8 polyp-int8.pt2" and int8["overall"]["num-examples"] == 8
    assert abs(int8["overall"]["dice"] - floats["overall"]["dice"]) < 0.2
    capsys.readouterr()

    assert fedmed(["segment", "--model", str(tmp_path / "missing.pt"), "--images", str(frames), "--out",
                   str(tmp_path / "x")]) == 2
    assert "missing.pt: no such model file" in capsys.readouterr().err
    (tmp_path / "old.pt").write_bytes(b"a TorchScript archive of the eager path")
    assert fedmed(["segment", "--model", str(tmp_path / "old.pt"), "--images", str(frames), "--out",
                   str(tmp_path / "x")]) == 2
    assert "old.pt: a TorchScript model of the eager INT8 path" in capsys.readouterr().err
    assert fedmed(["export-int8", "--run", str(tmp_path / "frames"), "--out", str(model_file)]) == 2
    assert "no checkpoints" in capsys.readouterr().err


def test_the_quantisers_warnings_are_held_back_and_counted_and_fedmeds_own_log_is_not(caplog):
    from common.quantization.quiet import quiet_quantisers

    child = logging.getLogger("torch.onnx._internal.exporter._registration")  # torch gives it a handler of its own
    printing = logging.StreamHandler()
    child.addHandler(printing)
    try:
        with caplog.at_level(logging.INFO), quiet_quantisers() as hidden:
            child.warning("torchvision is not installed. Skipping torchvision::nms")
            logging.getLogger("onnxruntime.quantization").warning("Inference failed for tensor 'val_0'")
            warnings.warn("torch.ao.quantization is deprecated", DeprecationWarning)
            logging.getLogger("fedmed").warning("fedmed's own line")
        assert child.handlers == [printing] and child.propagate  # as they were
    finally:
        child.removeHandler(printing)
    assert len(hidden) == 3 and any("Skipping torchvision::nms" in line for line in hidden)
    assert [r.getMessage() for r in caplog.records] == ["fedmed's own line"]


@pytest.mark.parametrize("engine,out,installed,says", [
    ("auto", "polyp-int8.pt2", ["pt2e", "onnxruntime", "openvino"], "--out polyp-int8.pt2 asks for a .pt2 file, which "
     "only pt2e writes; leave the suffix off --out to have every installed engine timed"),
    ("pt2e", "polyp-int8", ["pt2e"], "--engine pt2e was asked for"),
    ("auto", "polyp-int8", ["onnxruntime"], "onnxruntime is the only INT8 engine installed"),
    ("auto", "polyp-int8", ["pt2e", "onnxruntime", "openvino"], "fastest here of 5 INT8 models")])
def test_the_export_says_why_its_engine_was_chosen(monkeypatch, engine, out, installed, says):
    from cli import int8_export
    from common.quantization import int8

    monkeypatch.setattr(int8_export, "installed_engines", lambda asked: installed if asked == "auto" else [asked])
    allowed = [e for e in installed if not Path(out).suffix or int8.SUFFIXES[e] == Path(out).suffix]
    labels = [label for label, (e, _) in int8.CANDIDATES.items() if e in allowed] if engine == "auto" else ["pt2e"]
    choice = {"chosen": labels[0], "median-ms-batch-1-and-8": {label: [1.0, 2.0] for label in labels},
              "input": [3, 64, 64], "cpu": "a CPU", "threads": 2}
    metadata = {"engine-choice": choice} if len(labels) > 1 else {}
    assert says in int8_export.choice_reason(metadata, engine, Path(out), allowed)


def test_the_first_int8_example_of_the_docs_lets_every_engine_be_timed():
    """docs/qfedpolyp.md's first export is what users copy: it must not narrow the choice to one file type."""
    import shlex

    from cli.main import build_parser

    docs = (Path(__file__).resolve().parent.parent / "docs" / "qfedpolyp.md").read_text()
    first = next(line for line in docs.splitlines() if line.startswith("fedmed export-int8"))
    args = build_parser().parse_args(shlex.split(first.split("#")[0])[1:])
    assert args.engine == "auto" and Path(args.out).suffix == "", first


def test_benchmark_finds_the_time_spent_in_quantised_convolutions():
    """The INT8 benchmark's speed bound divides by this time: it must see the int8 kernels and nothing else."""
    from benchmarks.qfedpolyp.int8_speed import time_in_quantised_convolutions

    images = images_to_tensor(make_polyps(16, 32, seed=0).images, torch.device("cpu"))
    model = settled_unet(images)
    in_convs, in_all = time_in_quantised_convolutions(int8_model(model, [images]), images[:1], repeats=3)
    assert 0 < in_convs < in_all
    assert time_in_quantised_convolutions(model, images[:1], repeats=3)[0] == 0  # FP32 has no quantised kernels


def test_onnx_runtime_int8_model_keeps_weights_to_seven_bits_and_stays_close_to_fp32(tmp_path):
    """7-bit weights: at 8 bits the trained U-Net lost 0.031 Dice in ONNX Runtime on a CPU without int8
    dot-product instructions, at 7 bits nothing (common/quantization/onnx_int8.py)."""
    pytest.importorskip("onnxruntime")
    import onnx
    from onnx import numpy_helper

    from common.quantization.onnx_int8 import OnnxSegmenter, export_int8

    images = images_to_tensor(make_polyps(48, 32, seed=0).images, torch.device("cpu"))
    model = settled_unet(images[:32])
    path = export_int8(model, [images[:16], images[16:32]], tmp_path / "u.onnx", {"image-size": 32})
    graph = onnx.load(str(path)).graph
    weights = [numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert weights and max(int(abs(w.astype(int)).max()) for w in weights) == 64  # 7 bits, symmetric: -64..64
    assert any(node.op_type == "QLinearConv" for node in graph.node)
    segmenter = OnnxSegmenter(path)
    assert segmenter.metadata["weight-bits"] == 7
    with torch.no_grad():
        reference = model(images[32:])
    output = segmenter(images[32:])
    assert (output - reference).abs().mean() < 0.15 * reference.std()
    assert ((output > 0) == (reference > 0)).float().mean() > 0.9


@pytest.mark.parametrize("model", ["", pytest.param("monai.networks.nets:UNet", marks=pytest.mark.slow)])
def test_export_with_onnx_runtime_takes_any_segmentation_network_and_segments_with_it(tmp_path, capfd, model):
    """`export-int8 --engine onnxruntime`: an .onnx model of the built-in U-Net or a network of the user's own that
    `segment` and `evaluate` run; a file name of the other type refused; `auto` takes the user's network too."""
    pytest.importorskip("onnxruntime")
    own = {"model": model, "model_args": '{"spatial_dims": 2, "channels": [8, 16, 32], "strides": [2, 2]}'}
    cfg = saved_run(tmp_path, **(own if model else {}))
    run = str(tmp_path / "run")
    model_file = tmp_path / "polyp-int8.onnx"
    arguments = ["export-int8", "--run", run, "--out", str(model_file), "--calibration-images", "16"]
    assert fedmed(arguments + ["--engine", "onnxruntime"]) == 0
    printed, errors = capfd.readouterr()  # what it chose and why, and not the quantisers' own warnings
    assert "engine: onnxruntime" in printed and "--engine onnxruntime was asked for" in printed
    assert "<- written" in printed and "warnings of the quantisers held back" in printed
    assert "torchvision is not installed" not in errors and "Inference failed" not in errors, errors[:2000]
    loaded, metadata = load_deployment(model_file)
    assert metadata["engine"] == "onnxruntime" and metadata["image-size"] == 32 and metadata["rounds"] == 1
    frames = tmp_path / "frames"
    frames.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(frames / "a.png")
    assert fedmed(["segment", "--model", str(model_file), "--images", str(frames), "--out", str(tmp_path / "m")]) == 0
    with Image.open(tmp_path / "m" / "a.png") as mask:
        assert mask.size == (40, 30)
    labelled = tmp_path / "labelled"
    write_site(cfg, generate("polyp-segmentation", 8, 32, seed=5), labelled, "test")
    assert fedmed(["evaluate", "--run", run, "--data", str(labelled), "--model", str(model_file),
                   "--out", str(tmp_path / "scores")]) == 0
    assert json.loads((tmp_path / "scores.json").read_text())["overall"]["num-examples"] == 8
    capfd.readouterr()
    assert fedmed(["export-int8", "--run", run, "--out", str(tmp_path / "x.pt"), "--engine", "onnxruntime"]) == 2
    assert "written as a .onnx file" in capfd.readouterr().err
    if model:  # a path without a suffix (as --best's default) gets the file type of the engine measured fastest
        assert fedmed(["export-int8", "--run", run, "--out", str(tmp_path / "exports" / "own"),
                       "--calibration-images", "8"]) == 0
        [written] = (tmp_path / "exports").glob("own.*")
        engine = load_deployment(written)[1]["engine"]
        assert written.suffix == {"pt2e": ".pt2", "onnxruntime": ".onnx", "openvino": ".onnx"}[engine]
        assert fedmed(["segment", "--model", str(written), "--images", str(frames),
                       "--out", str(tmp_path / "own-masks")]) == 0
        with Image.open(tmp_path / "own-masks" / "a.png") as mask:
            assert mask.size == (40, 30)


@pytest.mark.slow  # a full-size U-Net through PT2E (about 50 s); fast: the PT2E concatenation test
def test_pt2e_int8_model_has_int8_weights_stays_close_to_fp32_and_round_trips(tmp_path):
    """PT2E (PyTorch's maintained path, torchao): a real int8 graph, calibrated; saved as .pt2 with its metadata and
    run compiled (int8 kernels) for any batch size, close to the float network; a file of another kind refused."""
    pytest.importorskip("torchao")
    from common.quantization.pt2e_int8 import Pt2eSegmenter, export_int8, quantise

    images = images_to_tensor(make_polyps(48, 32, seed=0).images, torch.device("cpu"))
    model = settled_unet(images[:32])
    converted = quantise(model, [images[:16], images[16:32]])
    int8_weights = [name for name, t in [*converted.named_parameters(), *converted.named_buffers()]
                    if t.dtype == torch.int8]
    assert len(int8_weights) >= sum(isinstance(m, nn.Conv2d) for m in model.modules())  # quantised, not observed

    path = export_int8(model, [images[:16], images[16:32]], tmp_path / "u.pt2", {"image-size": 32})
    segmenter, metadata = load_deployment(path)
    assert isinstance(segmenter, Pt2eSegmenter)
    assert metadata["engine"] == "pt2e" and metadata["image-size"] == 32 and metadata["calibration-images"] == 32
    with torch.no_grad():
        reference = model(images[32:])
    for batch in (reference, reference[:3]):  # exported at batch 2, run at 16 and 3
        output = segmenter(images[32:32 + len(batch)])
        assert output.shape == batch.shape
        assert 0 < (output - batch).abs().mean() < 0.15 * reference.std()
        assert ((output > 0) == (batch > 0)).float().mean() > 0.9

    if shutil.which("g++"):  # Inductor's compiler: the int8 kernels ran, not the uncompiled fallback
        assert segmenter.run is not segmenter.graph

    (tmp_path / "bad.pt2").write_bytes(b"not a program")
    with pytest.raises(ValueError, match="bad.pt2: not an exported PT2E program"):
        load_deployment(tmp_path / "bad.pt2")


def test_pt2e_concatenations_take_int8_inputs_even_after_the_pixel_shuffle():
    """The stock x86 quantiser leaves a concatenation in float when an input comes from the pixel shuffle;
    ours quantises every input of every concatenation, so the skip connections move uint8 values."""
    pytest.importorskip("torchao")
    from common.quantization.pt2e_int8 import quantise

    images = images_to_tensor(make_polyps(16, 32, seed=0).images, torch.device("cpu"))
    model = settled_unet(images)

    def concatenation_inputs(int8_concatenations: bool) -> list[list[str]]:
        converted = quantise(model, [images], int8_concatenations)
        return [[str(i.target) for i in n.args[0]] for n in converted.graph.nodes
                if n.target is torch.ops.aten.cat.default]

    dequantised = "quantized_decomposed.dequantize_per_tensor.default"
    assert concatenation_inputs(True) == [[dequantised] * 2] * 3  # the U-Net's three skip connections
    # the stock quantiser: each stays in float, on the shuffle's float output (its channels-last copy)
    stock = concatenation_inputs(False)
    assert [dequantised in inputs for inputs in stock] == [False] * 3
    assert all("aten.clone.default" in inputs for inputs in stock)


def test_engine_auto_takes_every_installed_one_and_a_missing_one_names_the_extra(monkeypatch):
    from common.quantization import int8

    missing: set[str] = set()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    assert int8.installed_engines("auto") == ["pt2e", "onnxruntime", "openvino"]
    missing.add("torchao")
    assert int8.installed_engines("auto") == ["onnxruntime", "openvino"]
    with pytest.raises(ValueError, match="pt2e: torchao is not installed; install fedmed-hospitals\\[int8\\]"):
        int8.installed_engines("pt2e")
    missing.update({"onnxruntime", "openvino"})
    with pytest.raises(ValueError, match="torchao or onnxruntime or openvino is not installed"):
        int8.installed_engines("auto")
    with pytest.raises(ValueError, match="INT8 engine 'torch': use one of auto, pt2e, onnxruntime, openvino"):
        int8.installed_engines("torch")


@pytest.mark.slow  # five INT8 models built; fast: the engine-choice and installed-engine tests
def test_auto_export_writes_the_fastest_engine_measured_here_each_a_third_of_the_float_model_at_most(
        tmp_path, monkeypatch):
    """`export-int8` (engine auto): every INT8 model installed is built and timed at batch 1 and 8, the one with the
    smallest product of the two medians is written with the figures and the CPU in its metadata; every candidate is
    at most a third of the float model's bytes."""
    pytest.importorskip("torchao")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    from cli import int8_export
    from common.quantization import int8, timing

    saved_run(tmp_path, image_size=16)
    state = dict(np.load(tmp_path / "run" / "checkpoints" / "round-00001.npz"))
    float_bytes = sum(v.nbytes for v in PolypUNet().state_dict().values())  # 7.7 MB
    # batch 1 and 8: qdq is fastest at batch 1, pt2e-int8-concat at batch 8; qdq's product is the smallest
    fake = {"pt2e": (0.004, 0.010), "pt2e-int8-concat": (0.005, 0.009), "onnxruntime-qdq": (0.002, 0.012),
            "onnxruntime-qoperator": (0.003, 0.020), "openvino-qdq": (0.0025, 0.0100)}
    monkeypatch.setattr(timing, "latencies", lambda paths, x, **_: {k: fake[k][len(x) > 1] for k in paths})
    sizes = {}
    real_fastest = int8_export.fastest

    def recording(files, *args, **kwargs):
        sizes.update({label: path.stat().st_size for label, path in files.items()})
        return real_fastest(files, *args, **kwargs)

    monkeypatch.setattr(int8_export, "fastest", recording)
    path, metadata = int8_export.export_int8(state, tmp_path / "model", num_calibration=16)
    assert path == tmp_path / "model.onnx" and metadata["engine"] == "onnxruntime" and metadata["format"] == "qdq"
    assert set(sizes) == set(int8.CANDIDATES) and all(size <= float_bytes / 3 for size in sizes.values()), sizes
    _, written = load_deployment(path)
    choice = written["engine-choice"]
    assert choice["chosen"] == "onnxruntime-qdq" and choice["input"] == [3, 16, 16] and choice["cpu"]
    assert choice["median-ms-batch-1-and-8"] == {k: [v[0] * 1e3, v[1] * 1e3] for k, v in fake.items()}
    assert written["image-size"] == 16 and written["format"] == "qdq"



def test_openvino_runs_every_convolution_in_int8_transposed_ones_included_and_stays_close_to_fp32(tmp_path):
    """`export-int8 --engine openvino`: ONNX Runtime's QDQ file of the network as it is, run by OpenVINO with every
    convolution and transposed convolution an int8 kernel (no pixel-shuffle rewrite: OpenVINO runs the transposed
    ones in int8), the float parts in FP32; a third of the float model at most; logits close to the float network's."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    from cli import int8_export
    from common.quantization import int8
    from common.quantization.openvino_int8 import OpenVinoSegmenter

    saved_run(tmp_path)
    state = dict(np.load(tmp_path / "run" / "checkpoints" / "round-00001.npz"))
    path, metadata = int8_export.export_int8(state, tmp_path / "u.onnx", num_calibration=16, engine="openvino")
    assert metadata["engine"] == "openvino" and metadata["format"] == "qdq" and "engine-choice" not in metadata
    assert path.stat().st_size <= sum(v.nbytes for v in PolypUNet().state_dict().values()) / 3
    segmenter, written = load_deployment(path)
    assert isinstance(segmenter, OpenVinoSegmenter) and written["image-size"] == 32 and written["weight-bits"] == 7
    images = images_to_tensor(make_polyps(48, 32, seed=0).images, torch.device("cpu"))
    model = settled_unet(images[:32])
    path = int8.build_candidate("openvino-qdq", model, [images[:16], images[16:32]], tmp_path / "s.onnx", {})
    segmenter = OpenVinoSegmenter(path, threads=1)
    output = segmenter(images[32:])
    with torch.no_grad():
        reference = model(images[32:])
    assert (output - reference).abs().mean() < 0.15 * reference.std()
    assert ((output > 0) == (reference > 0)).float().mean() > 0.9
    runtime = segmenter.requests[tuple(images[32:].shape)].get_compiled_model().get_runtime_model()
    precision = {}
    for op in runtime.get_ops():
        info = op.get_rt_info()
        precision.setdefault(info["layerType"].astype(str), set()).add(info["runtimePrecision"].astype(str))
    transposed = sum(isinstance(m, nn.ConvTranspose2d) for m in model.modules())
    assert transposed and "Deconvolution" in precision, sorted(precision.items())
    assert precision["Convolution"] | precision["Deconvolution"] <= {"u8", "i8"}, precision


def test_an_openvino_model_runs_in_onnx_runtime_where_openvino_is_missing(tmp_path, monkeypatch, caplog):
    """The file is plain QDQ ONNX: a site without OpenVINO still segments with it (ONNX Runtime, slower, said)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    from common.quantization import int8
    from common.quantization.onnx_int8 import OnnxSegmenter

    images = images_to_tensor(make_polyps(24, 32, seed=1).images, torch.device("cpu"))
    model = settled_unet(images[:16])
    path = int8.build_candidate("openvino-qdq", model, [images[:16]], tmp_path / "m.onnx", {"image-size": 32})
    with_openvino, _ = load_deployment(path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with caplog.at_level("WARNING", logger="fedmed"):
        without, metadata = load_deployment(path)
    assert isinstance(without, OnnxSegmenter) and metadata["engine"] == "openvino"
    assert "exported for OpenVINO, which is not installed here" in caplog.text and str(path) in caplog.text
    first, second = with_openvino(images[16:]), without(images[16:])
    assert ((first > 0) == (second > 0)).float().mean() > 0.98


def test_latencies_time_each_path_in_runs_of_consecutive_calls_after_one_untimed_call():
    """Side-by-side timing: paths take turns block by block (never call by call: an engine whose threads spin after a
    call would slow the next path), each block starts with an untimed call, and the medians are each path's own."""
    from common.quantization.timing import latencies

    calls: list[str] = []

    def path(name: str, seconds: float):
        def run(_x):
            calls.append(name)
            time.sleep(seconds)
        return run

    result = latencies({"fast": path("fast", 0.001), "slow": path("slow", 0.006)}, torch.zeros(1), warmup=2,
                       repeats=6, blocks=3)
    assert calls[:4] == ["fast", "fast", "slow", "slow"]  # warm-up
    timed = calls[4:]  # 3 blocks x 2 paths, each 1 untimed + 2 timed calls of one path
    assert len(timed) == 18 and all(len(set(timed[i:i + 3])) == 1 for i in range(0, 18, 3)), timed
    blocks = [timed[i:i + 6:3] for i in range(0, 18, 6)]
    assert all(sorted(block) == ["fast", "slow"] for block in blocks), blocks  # every path once per block
    assert 0.001 <= result["fast"] < result["slow"] and result["slow"] >= 0.006
