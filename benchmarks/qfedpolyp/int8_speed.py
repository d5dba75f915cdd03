"""INT8 against FP32 for QFedPolyp's global model: CPU latency at batch 1 and 8, and Dice on the same
held-out test images.

    flock /tmp/fedmed-cpu.lock python -m benchmarks.qfedpolyp.int8_speed --run results/qfedpolyp-cpu/runs/8-8-8-8-8

The model is a run's final global model (its latest checkpoint); each INT8 model is built as ``fedmed export-int8``
builds it with that engine (calibrated on the same 64 of the run's training images). Latency is measured in one
process on 3x<size>x<size> inputs (default 128, the paper's), for every path: FP32 eager, FP32 frozen TorchScript,
FP32 torch.compile (weights frozen as constants), the eager INT8 model fedmed exported before (as is and as frozen
TorchScript; eager_int8.py),
ONNX Runtime's FP32 and INT8 models, and PT2E's INT8 model compiled by Inductor (where torchao is installed; extra
``fedmed-hospitals[int8]``). After a warm-up,
the paths take turns in a shuffled order every repetition, so that a busy machine slows them alike;
the table gives medians. Dice of FP32 and INT8 are on the run's test images at its training size.
Where the INT8 time goes: the share of it inside the quantised convolution kernels (torch.profiler), and
the speed-up of this CPU's int8 convolution kernels over its float ones on the model's own layer shapes,
which is what decides how much faster INT8 can be on a given CPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

from benchmarks.qfedpolyp.eager_int8 import frozen_script, int8_model, quiet_deprecations
from common.data.sources import server_test_set
from common.machine import cpu_flags, cpu_name
from common.quantization.int8 import calibration_images, image_batches, model_from_checkpoint
from common.quantization.timing import latencies
from common.tasks import get_task

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("fedmed")


def compiled(model: torch.nn.Module) -> Callable:
    """torch.compile with frozen weights, as the PT2E segmenter runs (faster for FP32 too)."""
    from common.quantization.pt2e_int8 import compiled as frozen_compile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    return frozen_compile(model)


def time_in_quantised_convolutions(model: torch.nn.Module, x: torch.Tensor, repeats: int = 20) -> tuple[float, float]:
    """(seconds per forward spent inside quantised convolution kernels, seconds per forward in all ops), from
    torch.profiler's self times. The first bounds how fast INT8 can get here with these kernels: the rest of the
    network (pooling, concatenation, upsampling copies) could at best shrink to nothing."""
    from torch.profiler import profile

    with torch.inference_mode():
        model(x)
        with profile() as prof:
            for _ in range(repeats):
                model(x)
    events = prof.key_averages()
    in_convs = sum(e.self_cpu_time_total for e in events if e.key.startswith("quantized::conv"))
    return in_convs / repeats / 1e6, sum(e.self_cpu_time_total for e in events) / repeats / 1e6


def convolution_kernel_times(model: torch.nn.Module, size: int, warmup: int = 5,
                             repeats: int = 20) -> tuple[float, float]:
    """(FP32 seconds, INT8 seconds) for the model's Conv2d layers at batch 1, each run alone as one float
    convolution and as one quantised int8 convolution of the same shape, summed over the layers.

    Their ratio is what this CPU's kernels give, whatever the rest of the network does; the whole model's INT8
    speed-up stays near it, since convolutions are nearly all of its work (INT8 also saves the separate BatchNorm
    and ReLU passes that the FP32 paths may keep)."""
    from torch.ao.nn.quantized import Conv2d as QuantisedConv2d

    inputs: list[tuple[torch.nn.Conv2d, torch.Size]] = []
    hooks = [m.register_forward_hook(lambda module, args, _: inputs.append((module, args[0].shape)))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.inference_mode():
        model(torch.randn(1, 3, size, size))
    for hook in hooks:
        hook.remove()
    totals = {"FP32": 0.0, "INT8": 0.0}
    for conv, shape in inputs:
        x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        weight = conv.weight.detach()
        quantised = QuantisedConv2d(conv.in_channels, conv.out_channels, conv.kernel_size, padding=conv.padding)
        quantised.set_weight_bias(torch.quantize_per_tensor(weight, float(weight.abs().max()) / 127 + 1e-12, 0,
                                                            torch.qint8), None)
        quantised.scale, quantised.zero_point = float(x.abs().max()) / 64, 0
        x_int8 = torch.quantize_per_tensor(x, float(x.abs().max()) / 127, 128, torch.quint8)
        times = latencies({"FP32": lambda _: conv(x), "INT8": lambda _: quantised(x_int8)}, x, warmup, repeats)
        for name in totals:
            totals[name] += times[name]
    return totals["FP32"], totals["INT8"]


def onnx_paths(model: torch.nn.Module, cfg, size: int, threads: int) -> dict[str, Callable]:
    """ONNX Runtime's float model and its INT8 models in both encodings (``fedmed export-int8 --engine
    onnxruntime``), calibrated on the same 64 training images as the eager model."""
    import tempfile

    from common.quantization.onnx_int8 import FORMATS, OnnxSegmenter, export_float_model, export_int8

    work = Path(tempfile.mkdtemp(prefix="int8-onnx-"))
    images = [batch for batch in image_batches(calibration_images(cfg, None, 64, cfg.seed))]
    paths = {"FP32 ONNX Runtime": OnnxSegmenter(export_float_model(model, images[0], work / "float.onnx", {}),
                                                threads)}
    for form in FORMATS:
        file = export_int8(model, images, work / f"int8-{form}.onnx", {"image-size": cfg.image_size}, form=form)
        paths[f"INT8 ONNX Runtime ({form})"] = OnnxSegmenter(file, threads)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="run folder (latest checkpoint) or checkpoint file")
    parser.add_argument("--size", type=int, default=128, help="input edge for the latency runs (paper: 128)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "qfedpolyp_int8.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    if args.threads:
        torch.set_num_threads(args.threads)

    from server_app.checkpoint import find_checkpoint, load_checkpoint

    checkpoint = find_checkpoint(args.run)
    cfg, model, rounds = model_from_checkpoint(load_checkpoint(checkpoint))
    quantised = int8_model(model, image_batches(calibration_images(cfg, None, 64, cfg.seed)))

    task = get_task(cfg, {"in-channels": 3})
    test = server_test_set(cfg)
    fp32_scores, int8_scores = task.evaluate(model, test), task.evaluate(quantised, test)
    fp32_masks, int8_masks = (task.predict_masks(model, test, torch.device("cpu")),
                              task.predict_masks(quantised, test, torch.device("cpu")))
    agreement = float((fp32_masks == int8_masks).mean())
    log.info("Dice FP32 %.4f, INT8 %.4f", fp32_scores["dice"], int8_scores["dice"])

    paths: dict[str, Callable] = {"FP32 eager": model, "FP32 TorchScript (frozen)": frozen_script(model)}
    notes = []
    if not args.no_compile:
        try:
            candidate = compiled(model)
            with torch.inference_mode():
                candidate(torch.randn(1, 3, args.size, args.size))
            paths["FP32 torch.compile (frozen)"] = candidate
        except Exception as error:  # a missing compiler is a result worth reporting, not a crash
            notes.append(f"torch.compile failed here: {type(error).__name__}: {str(error).splitlines()[0]}")
            log.warning("%s\n%s", notes[-1], traceback.format_exc())
    paths["INT8 eager"] = quantised
    paths["INT8 TorchScript (frozen)"] = frozen_script(quantised)
    onnx_models = onnx_paths(model, cfg, args.size, torch.get_num_threads())  # maintained paths: ONNX Runtime, PT2E
    paths.update(onnx_models)
    maintained_scores = {name: task.evaluate(path, test) for name, path in onnx_models.items()
                         if name.startswith("INT8")}
    if not args.no_compile:
        try:
            from common.quantization.pt2e_int8 import quantise as pt2e_int8

            pt2e = pt2e_int8(model, list(image_batches(calibration_images(cfg, None, 64, cfg.seed))))
            paths["INT8 PT2E x86 Inductor (torchao)"] = compiled(pt2e)  # scored as timed: compiled
            maintained_scores["INT8 PT2E x86 Inductor (torchao)"] = task.evaluate(
                paths["INT8 PT2E x86 Inductor (torchao)"], test)
        except RuntimeError as error:
            notes.append(f"PT2E not measured: {error}")

    results = {}
    for batch in (1, 8):
        x = torch.randn(batch, 3, args.size, args.size)
        repeats = args.repeats if batch == 1 else max(10, args.repeats // 4)
        log.info("batch %d: %d repetitions of %d paths", batch, repeats, len(paths))
        results[batch] = latencies(paths, x, args.warmup, repeats)

    conv_seconds, op_seconds = time_in_quantised_convolutions(quantised, torch.randn(1, 3, args.size, args.size))
    with quiet_deprecations():
        kernel_fp32, kernel_int8 = convolution_kernel_times(model, args.size)
    fastest = {b: min((v, k) for k, v in r.items() if k.startswith("FP32")) for b, r in results.items()}
    best_int8 = {b: min((v, k) for k, v in r.items() if k.startswith("INT8")) for b, r in results.items()}
    lines = ["# QFedPolyp: INT8 against FP32 on this CPU", "",
             f"Model: final global model of `{checkpoint}` (round {rounds}, trained at "
             f"{cfg.image_size}x{cfg.image_size}, bit-widths {cfg.qfedpolyp.bit_widths}). CPU: {cpu_name()} "
             f"({os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads; "
             f"{cpu_flags() or 'no AVX flags read'}), torch {torch.__version__}, "
             f"quantised engine `{torch.backends.quantized.engine}`.", "",
             "Command: `" + " ".join(["python -m benchmarks.qfedpolyp.int8_speed",
                                     *(argv if argv is not None else sys.argv[1:])]) + "`",
             "", f"## Latency, 3x{args.size}x{args.size} input (median ms per call; batch 8: per call of 8 images)", "",
             "| path | batch 1 ms | speed-up vs fastest FP32 | batch 8 ms | speed-up vs fastest FP32 |",
             "|---|---|---|---|---|"]
    for name in paths:
        cells = [name]
        for batch in (1, 8):
            value = results[batch][name]
            cells += [f"{value * 1e3:.2f}", f"{fastest[batch][0] / value:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Repetitions: {args.repeats} at batch 1, {max(10, args.repeats // 4)} at batch 8, "
              f"after {args.warmup} warm-up calls per path; paths interleaved in a shuffled order.", *notes, "",
              f"## Dice on the same {len(test)} test images ({cfg.image_size}x{cfg.image_size})", "",
              "| model | Dice | IoU | " + " | ".join(f"Dice {s}" for s in test.source_names()) + " |",
              "|---|---|---|" + "---|" * len(test.source_names())]
    for name, scores in (("FP32", fp32_scores), ("INT8 eager (torch.ao)", int8_scores), *maintained_scores.items()):
        lines.append(f"| {name} | {scores['dice']:.4f} | {scores['iou']:.4f} | "
                     + " | ".join(f"{scores[f'dice/{s}']:.4f}" for s in test.source_names()) + " |")
    speedup = fastest[1][0] / best_int8[1][0]
    gap = abs(fp32_scores["dice"] - int8_scores["dice"])
    old_path = min((results[1][k], k) for k in ("INT8 eager", "INT8 TorchScript (frozen)"))  # as exported
    eager = fastest[1][0] / old_path[0]
    maintained_rows = []
    for family in ("INT8 ONNX Runtime", "INT8 PT2E"):  # the fastest form of each maintained path measured
        timed = [(results[1][k], k) for k in maintained_scores if k.startswith(family)]
        if not timed:
            continue
        seconds, name = min(timed)
        maintained_speedup = fastest[1][0] / seconds
        maintained_gap = abs(fp32_scores["dice"] - maintained_scores[name]["dice"])
        maintained_rows += [
            f"| a maintained path ({name}) at least as fast as the eager path's faster form ({old_path[1]}; "
            f"speed-up over the fastest FP32 path at batch 1) | {maintained_speedup:.2f}x vs {eager:.2f}x | "
            f"{'yes' if maintained_speedup >= eager else 'no'} |",
            f"| its Dice within 0.005 of FP32 | {maintained_scores[name]['dice']:.4f} vs {fp32_scores['dice']:.4f} "
            f"(difference {maintained_gap:.4f}) | {'yes' if maintained_gap <= 0.005 else 'no'} |"]
    share = conv_seconds / op_seconds
    lines += ["", f"Pixels where the INT8 and FP32 masks agree: {agreement * 100:.2f} %.", "", "## Goals", "",
              "| goal | measured | met |", "|---|---|---|",
              f"| INT8 >= 4x faster than the fastest FP32 path at batch 1 | {best_int8[1][1]} "
              f"{best_int8[1][0] * 1e3:.2f} ms vs {fastest[1][1]} {fastest[1][0] * 1e3:.2f} ms: {speedup:.2f}x | "
              f"{'yes' if speedup >= 4 else 'no'} |",
              f"| INT8 Dice within 0.005 of FP32 | {int8_scores['dice']:.4f} vs {fp32_scores['dice']:.4f} "
              f"(difference {gap:.4f}) | {'yes' if gap <= 0.005 else 'no'} |",
              *maintained_rows, "",
              "## Where the INT8 time goes (batch 1, torch.profiler on INT8 eager)", "",
              f"Quantised convolution kernels: {conv_seconds * 1e3:.2f} ms of {op_seconds * 1e3:.2f} ms per profiled "
              f"forward ({share * 100:.0f} %). Even if everything else took no time, {old_path[1]} would take "
              f"{old_path[0] * share * 1e3:.2f} ms, {fastest[1][0] / (old_path[0] * share):.2f}x faster than "
              f"{fastest[1][1]}.", "",
              f"The model's {sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())} Conv2d layers, each run "
              f"alone at batch 1 as a float and as a quantised int8 convolution of the same shape: FP32 "
              f"{kernel_fp32 * 1e3:.2f} ms, INT8 {kernel_int8 * 1e3:.2f} ms in all, {kernel_fp32 / kernel_int8:.2f}x. "
              "That ratio is what this CPU's int8 kernels give over its float ones on this network's layers; "
              "convolutions are nearly all of both models' work, so the whole model's INT8 speed-up stays near it. "
              "It is larger on CPUs with int8 dot-product instructions (avx512_vnni, avx_vnni or amx_int8 among the "
              "CPU flags above).", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
