"""INT8 against FP32 for QFedPolyp's global model: CPU latency at batch 1 and 8, Dice on the same test images, file
sizes, and which engine ``fedmed export-int8`` picks here.

    flock /tmp/fedmed-cpu.lock python -m benchmarks.qfedpolyp.int8_speed --run results/q/runs/32-32-32-32-32 \
        --threads 2 --repeats 60

The model is a run's final global model (its latest checkpoint). Every INT8 model is the file ``fedmed export-int8``
writes for that engine (PT2E; ONNX Runtime QDQ and QOperator; OpenVINO), calibrated on the same 64 of the run's training
images and run as ``fedmed segment`` runs it; ``export-int8`` itself (engine auto) is run too, timing its candidates
at the benchmark's input size, and its choice is the model the goals judge. Latency is measured in one process on
3x<size>x<size> inputs (default 128, the paper's), for every path: FP32 eager, frozen TorchScript, torch.compile with
frozen weights, ONNX Runtime and OpenVINO (in FP32, where installed), the INT8 files, and the deprecated eager INT8
path as a reference (eager_int8.py).
After a warm-up the paths take turns in a shuffled order every repetition; the table gives medians. Timing starts
only once the 1-minute load average is below ``--max-load`` (both loads are in the results). The goal's yardstick
is this CPU's own int8/fp32 ratio: the model's convolutions run alone as float and as int8 kernels.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.qfedpolyp.eager_int8 import frozen_script, int8_model, quiet_deprecations
from cli.int8_export import calibration_images, image_batches, model_from_checkpoint
from common.data.sources import server_test_set
from common.machine import cpu_flags, cpu_name
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


def load_average() -> float:
    """The 1-minute load average (0.0 where it cannot be read)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def wait_for_quiet(limit: float, poll: float = 30.0) -> float:
    """Block until the 1-minute load is below ``limit`` (timings on a busy machine measure the other jobs);
    returns the load seen."""
    while (load := load_average()) >= limit:
        log.info("1-minute load %.2f >= %.2f: waiting for a quiet machine", load, limit)
        time.sleep(poll)
    return load


def int8_files(model: torch.nn.Module, batches: list[torch.Tensor], work: Path, image_size: int) -> dict[str, Path]:
    """Every INT8 model ``fedmed export-int8`` chooses from, built as it builds them."""
    from common.quantization.int8 import CANDIDATES, SUFFIXES, build_candidate, installed_engines

    engines = installed_engines("auto")
    return {label: build_candidate(label, model, batches, work / f"int8-{label}{SUFFIXES[engine]}",
                                   {"image-size": image_size})
            for label, (engine, _) in CANDIDATES.items() if engine in engines}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="run folder (latest checkpoint) or checkpoint file")
    parser.add_argument("--size", type=int, default=128, help="input edge for the latency runs (paper: 128)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-load", type=float, default=0.6,
                        help="wait until the 1-minute load average is below this before timing")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "qfedpolyp_int8.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    import tempfile

    from cli.int8_export import export_int8
    from common.quantization.int8 import SUFFIXES, installed_engines, load_deployment
    from common.quantization.onnx_int8 import OnnxSegmenter, export_float_model
    from common.quantization.openvino_int8 import OpenVinoSegmenter
    from server_app.checkpoint import find_checkpoint, load_checkpoint

    checkpoint = find_checkpoint(args.run)
    state = load_checkpoint(checkpoint)
    cfg, model, rounds = model_from_checkpoint(state)
    batches = list(image_batches(calibration_images(cfg, None, 64, cfg.seed)))
    work = Path(tempfile.mkdtemp(prefix="int8-speed-"))
    float_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    files = {"FP32 ONNX Runtime": export_float_model(model, batches[0], work / "float.onnx", {}),
             **{f"INT8 {label}": path for label, path in int8_files(model, batches, work, cfg.image_size).items()}}
    reference = int8_model(model, batches)  # the deprecated eager path, as fedmed exported it before

    paths: dict[str, Callable] = {"FP32 eager": model, "FP32 TorchScript (frozen)": frozen_script(model),
                                  "FP32 torch.compile (frozen)": compiled(model)}
    paths["FP32 ONNX Runtime"] = OnnxSegmenter(files["FP32 ONNX Runtime"], torch.get_num_threads())
    if "openvino" in installed_engines("auto"):  # the same float file, run by OpenVINO in FP32
        paths["FP32 OpenVINO"] = OpenVinoSegmenter(files["FP32 ONNX Runtime"], torch.get_num_threads())
    paths["INT8 eager (reference)"] = reference
    paths["INT8 TorchScript (frozen, reference)"] = frozen_script(reference)
    for name, path in files.items():
        if name.startswith("INT8"):
            paths[name] = load_deployment(path, torch.get_num_threads())[0]  # as `fedmed segment` runs it

    task = get_task(cfg, {"in-channels": 3})
    test = server_test_set(cfg)
    scores = {name: task.evaluate(paths[name], test) for name in ("FP32 eager", "INT8 eager (reference)",
                                                                  *[n for n in files if n.startswith("INT8")])}
    fp32_masks = task.predict_masks(model, test, torch.device("cpu"))

    load_before = wait_for_quiet(args.max_load)
    _, default = export_int8(state, work / "default", engine="auto", timing_size=args.size)
    chosen = f"INT8 {default['engine-choice']['chosen']}"
    log.info("export-int8 chose %s", chosen)
    agreement = float((fp32_masks == task.predict_masks(paths[chosen], test, torch.device("cpu"))).mean())
    results = {}
    for batch in (1, 8):
        x = torch.randn(batch, 3, args.size, args.size)
        repeats = args.repeats if batch == 1 else max(10, args.repeats // 4)
        log.info("batch %d: %d repetitions of %d paths", batch, repeats, len(paths))
        results[batch] = latencies(paths, x, args.warmup, repeats)
    conv_seconds, op_seconds = time_in_quantised_convolutions(reference, torch.randn(1, 3, args.size, args.size))
    with quiet_deprecations():
        kernel_fp32, kernel_int8 = convolution_kernel_times(model, args.size)
    load_after = load_average()

    ratio = kernel_fp32 / kernel_int8
    fastest = {b: min((v, k) for k, v in r.items() if k.startswith("FP32")) for b, r in results.items()}
    lines = ["# QFedPolyp: INT8 against FP32 on this CPU", "",
             f"Model: final global model of `{checkpoint}` (round {rounds}, trained at "
             f"{cfg.image_size}x{cfg.image_size}, bit-widths {cfg.qfedpolyp.bit_widths}). CPU: {cpu_name()} "
             f"({os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads; "
             f"{cpu_flags() or 'no AVX flags read'}), torch {torch.__version__}. 1-minute load average "
             f"{load_before:.2f} when the timing began, {load_after:.2f} when it ended (timed only below "
             f"{args.max_load}).", "",
             "Command: `" + " ".join(["python -m benchmarks.qfedpolyp.int8_speed",
                                     *(argv if argv is not None else sys.argv[1:])]) + "`", "",
             f"`fedmed export-int8` (engine auto), run in this process, timed its candidates at 3x{args.size}x"
             f"{args.size} and chose **{chosen}** (its own medians, ms at batch 1 and 8: "
             + ", ".join(f"{k} {v[0]:.2f} / {v[1]:.2f}" for k, v in
                         default["engine-choice"]["median-ms-batch-1-and-8"].items()) + ").", "",
             f"## Latency, 3x{args.size}x{args.size} input (median ms per call; batch 8: per call of 8 images)", "",
             "| path | batch 1 ms | speed-up vs fastest FP32 | batch 8 ms | speed-up vs fastest FP32 |",
             "|---|---|---|---|---|"]
    for name in paths:
        cells = [f"**{name}** (export-int8's choice)" if name == chosen else name]
        for batch in (1, 8):
            value = results[batch][name]
            cells += [f"{value * 1e3:.2f}", f"{fastest[batch][0] / value:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Repetitions: {args.repeats} at batch 1, {max(10, args.repeats // 4)} at batch 8, after "
              f"{args.warmup} warm-up calls per path; the paths take turns in 5 blocks of consecutive calls, in a "
              "shuffled order each block, every block after one untimed call (never call by call: ONNX Runtime's "
              "threads spin after a call and slowed the next path). INT8 models are the "
              "files `fedmed export-int8` writes for each engine (calibrated on the same 64 training images), run as "
              "`fedmed segment` runs them; the eager INT8 path (deprecated) is the reference.", "",
              f"## Dice on the same {len(test)} test images ({cfg.image_size}x{cfg.image_size})", "",
              "| model | Dice | IoU | " + " | ".join(f"Dice {s}" for s in test.source_names()) + " |",
              "|---|---|---|" + "---|" * len(test.source_names())]
    for name, value in scores.items():
        lines.append(f"| {name} | {value['dice']:.4f} | {value['iou']:.4f} | "
                     + " | ".join(f"{value[f'dice/{s}']:.4f}" for s in test.source_names()) + " |")
    lines += ["", f"Pixels where the masks of {chosen} and FP32 agree: {agreement * 100:.2f} %.", "",
              "## File sizes", "", "| file | bytes | of the FP32 model |", "|---|---:|---:|",
              f"| FP32 model (parameters and buffers) | {float_bytes:,} | 100 % |"]
    lines += [f"| {name} ({path.suffix}) | {path.stat().st_size:,} | {path.stat().st_size / float_bytes * 100:.1f} % |"
              for name, path in files.items()]
    chosen_file = work / f"default{SUFFIXES[default['engine']]}"
    speedups = [fastest[b][0] / results[b][chosen] for b in (1, 8)]
    gap = abs(scores["FP32 eager"]["dice"] - scores[chosen]["dice"])
    largest = max(p.stat().st_size for n, p in files.items() if n.startswith("INT8"))
    lines += ["", "## Goals", "", "| goal | measured | met |", "|---|---|---|"]
    for batch, speedup in zip((1, 8), speedups):
        lines.append(f"| export-int8's INT8 model at batch {batch} >= 0.8 x this CPU's int8/fp32 convolution ratio "
                     f"({ratio:.2f}x, so {0.8 * ratio:.2f}x) faster than the fastest FP32 path ({fastest[batch][1]}) "
                     f"| {speedup:.2f}x | {'yes' if speedup >= 0.8 * ratio else 'no'} |")
    lines += [f"| its Dice within 0.005 of FP32 | {scores[chosen]['dice']:.4f} vs {scores['FP32 eager']['dice']:.4f} "
              f"(difference {gap:.4f}) | {'yes' if gap <= 0.005 else 'no'} |",
              f"| every INT8 file at most a third of the FP32 model | largest {largest:,} bytes, "
              f"{largest / float_bytes * 100:.1f} % (export-int8's: {chosen_file.stat().st_size:,}) | "
              f"{'yes' if largest <= float_bytes / 3 else 'no'} |", "",
              "## This CPU's int8 and float convolutions", "",
              f"The model's {sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())} Conv2d layers, each run "
              f"alone at batch 1 as a float and as a quantised int8 convolution of the same shape (torch's kernels): "
              f"FP32 {kernel_fp32 * 1e3:.2f} ms, INT8 {kernel_int8 * 1e3:.2f} ms in all, {ratio:.2f}x. "
              f"Inside the eager INT8 model, quantised convolutions take {conv_seconds * 1e3:.2f} ms of "
              f"{op_seconds * 1e3:.2f} ms per forward ({conv_seconds / op_seconds * 100:.0f} %, torch.profiler).", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
