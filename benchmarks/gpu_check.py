"""The GPU check: one command a GPU machine runs (about 8 minutes on one GPU) that writes a markdown report.

    python -m benchmarks.gpu_check --out benchmarks/results/gpu_check.md
    python -m benchmarks.gpu_check --smoke --sections environment inference     # the script itself, on a CPU

Sections (``--sections``, default all):
- ``environment``: torch, CUDA, the GPUs seen, and which of Flower, Ray, MONAI, ONNX Runtime are installed;
- ``simulation``: a ``flwr run`` simulation of every method with 4 virtual hospitals at 0.25 GPU each
  (``fedmed simulate``'s default on one GPU), 2 rounds on generated data, checking from each round's record that
  every hospital trained on a GPU (``devices``) and that the run completed;
- ``presets``: one round of each benchmark's paper preset (FedProIn, QFedPolyp, FedMEPD) in one process on
  generated data of the preset's sizes: seconds per round and peak GPU memory;
- ``inference``: the polyp U-Net at 128 x 128, batch 1: float32 and bf16 on the GPU, float32 and INT8 (ONNX Runtime)
  on the CPU (the CPU named with its int8 instructions).

Nothing here needs the shared data sets, so the check runs on a bare GPU machine with this checkout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("environment", "simulation", "presets", "inference")
#: the methods the simulation section runs, each with a generated task small enough for 2 rounds in a minute
SIMULATED: dict[str, dict[str, Any]] = {
    "fedavg": {}, "fedprox": {}, "moon": {}, "fedproto": {}, "fedproin": {}, "fedbn": {},
    "qfedpolyp": {"task": "polyp-segmentation", "qfedpolyp.bit-widths": "8"},
    "fedmepd": {"task": "brain-tumour-segmentation", "brain.widths": "8,16,32,64", "brain.crop-size": 32,
                "brain.synthetic-cases": 20, "brain.synthetic-size": 48, "batch-size": 2,
                "brain.hospital-modalities": "t1ce;t2;flair,t1ce;t1,t2", "fedmepd.warmup-rounds": 0},
}
SMALL = {"image-size": 32, "synthetic-samples": 400, "batch-size": 16, "num-server-rounds": 2, "min-partition-size": 5,
         "min-available-hospitals": 4, "min-train-hospitals": 4, "round-timeout": 300.0}


def cpu_name() -> str:
    from benchmarks.machine import cpu_name as name

    return name()


def section_environment(args) -> list[str]:
    lines = ["| item | value |", "|---|---|",
             f"| Python | {platform.python_version()} |", f"| torch | {torch.__version__} |",
             f"| CUDA (torch built with) | {torch.version.cuda} |", f"| CUDA available | {torch.cuda.is_available()} |",
             f"| CPU | {cpu_name()} |"]
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        lines.append(f"| cuda:{index} | {props.name}, {props.total_memory / 2**30:.1f} GiB, bf16 "
                     f"{torch.cuda.is_bf16_supported()} |")
    for package in ("flwr", "ray", "monai", "onnxruntime", "pydantic", "nibabel"):
        try:
            module = importlib.import_module(package)
            lines.append(f"| {package} | {getattr(module, '__version__', 'installed')} |")
        except ImportError:
            lines.append(f"| {package} | **missing** |")
    return lines


def section_simulation(args) -> list[str]:
    from cli.launch import (
        FlowerHome,
        free_port,
        run_log,
        simulation_resources,
        start_superlink,
        submit_run,
        wait_for_run,
    )
    from server_app.results import read_history

    lines = ["| method | status | rounds | hospitals' devices (round 2) | seconds |", "|---|---|---|---|---|"]
    methods = list(SIMULATED)[:2] if args.smoke else list(SIMULATED)
    with tempfile.TemporaryDirectory() as work:
        home = FlowerHome(Path(work) / "flwr-home")
        superlink = start_superlink(home, free_port(), simulation=True)
        try:
            for method in methods:
                run_config = {**SMALL, "strategy": method, **SIMULATED[method], "run-name": f"gpu-{method}",
                              "results-dir": str(Path(work) / "results"), "state-dir": str(Path(work) / "state")}
                if args.smoke:
                    run_config.update({"image-size": 16, "synthetic-samples": 80, "model": "small-cnn"})
                started = time.time()
                run_id = submit_run(home, "local", run_config, simulation_resources(4, {}))
                status = wait_for_run(home, "local", run_id, 600.0)
                history = read_history(Path(work) / "results" / f"gpu-{method}")
                devices = history[-1].get("devices", {}) if history else {}
                on_gpu = devices and all(d.startswith("cuda") for d in devices.values())
                verdict = "" if on_gpu or not torch.cuda.is_available() else " **(not on a GPU)**"
                lines.append(f"| {method} | {status} | {len(history)} | "
                             f"{', '.join(f'{h}: {d}' for h, d in sorted(devices.items()))}{verdict} | "
                             f"{time.time() - started:.0f} |")
                if status != "finished:completed":
                    lines.append(f"| | log tail: `{run_log(home, 'local', run_id)[-300:]!r}` | | | |")
        finally:
            superlink.stop()
    return lines


def one_round(label: str, build: Callable[[], Any]) -> str:
    """``build()`` returns (cfg, sites); one round in process, its seconds and the peak GPU memory."""
    from common.engine.inprocess import run_rounds

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    cfg, sites = build()
    started = time.time()
    engine = run_rounds(cfg, sites, last_round=1)
    seconds = time.time() - started
    memory = f"{torch.cuda.max_memory_allocated() / 2**30:.2f}" if torch.cuda.is_available() else "-"
    test = engine.history[-1].get("test", {})
    headline = next((f"{k}={v:.3f}" for k, v in test.items() if k in ("accuracy", "dice", "dice_mean")), "-")
    return f"| {label} | {seconds:.1f} | {memory} | {engine.history[-1]['aggregated']} | {headline} |"


def section_presets(args) -> list[str]:
    from benchmarks.fedmepd.run import PRESETS as BRAIN
    from benchmarks.fedmepd.run import PROTOCOL as BRAIN_PROTOCOL
    from benchmarks.fedproin.run import PRESETS as PROIN
    from benchmarks.fedproin.run import PROTOCOL as PROIN_PROTOCOL
    from benchmarks.qfedpolyp.table1 import PRESETS as POLYP
    from benchmarks.qfedpolyp.table1 import PROTOCOL as POLYP_PROTOCOL
    from common.config import JobConfig, load_job_config
    from common.engine.inprocess import simulated_sites

    lines = ["| paper preset, one round (generated data of its sizes) | seconds | peak GPU GiB | aggregated | "
             "test |", "|---|---|---|---|---|"]

    def fedproin():
        job = {**PROIN_PROTOCOL, **PROIN["paper"]["job"], "strategy": "fedproin", "dataset": "synthetic",
               "synthetic_samples": 200 if args.smoke else 4000, "num_classes": 7}
        if args.smoke:
            job.update(image_size=32, resnet_width=0.25, batch_size=16, local_epochs=1)
        cfg = JobConfig(**job)
        return cfg, simulated_sites(cfg, 10)

    def qfedpolyp():
        job = {**POLYP_PROTOCOL, **POLYP["paper"], "dataset": "synthetic", "data_dir": "", "partitioner": "iid",
               "synthetic_samples": 100 if args.smoke else 1000}
        if args.smoke:
            job.update(image_size=16, local_epochs=1)
        cfg = JobConfig(**job)
        return cfg, simulated_sites(cfg, 5)

    def fedmepd():
        flat = {**BRAIN_PROTOCOL, **BRAIN["paper"], "strategy": "fedmepd", "dataset": "synthetic",
                "brain.synthetic-cases": 24, "brain.synthetic-size": 96, "test-fraction": 4 / 24,
                "brain.server-fraction": 4 / 24}
        if args.smoke:
            flat.update({"brain.widths": "4,8,16,32", "brain.crop-size": 16, "brain.synthetic-size": 24})
        cfg = load_job_config(flat)
        return cfg, simulated_sites(cfg, 4)

    for label, build in (("FedProIn (HAM10000 preset: 128 x 128, ResNet-18, 10 hospitals, E = 5)", fedproin),
                         ("QFedPolyp (128 x 128, E = 5, 5 hospitals)", qfedpolyp),
                         ("FedMEPD (80^3 crops, 16-32-64-128, 4 hospitals + server)", fedmepd)):
        try:
            lines.append(one_round(label, build))
        except Exception as error:  # report, go on with the next preset
            lines.append(f"| {label} | failed: {type(error).__name__}: {str(error)[:200]} | | | |")
            traceback.print_exc()
    return lines


def timed(call: Callable[[], Any], repeats: int, synchronise: bool = False) -> float:
    for _ in range(3):
        call()
    if synchronise:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    if synchronise:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats * 1000


def section_inference(args) -> list[str]:
    from common.models.unet2d import PolypUNet
    from common.quantization.onnx_int8 import OnnxSegmenter, export_int8

    size = 32 if args.smoke else 128
    repeats = 5 if args.smoke else 50
    model = PolypUNet().eval()
    x = torch.randn(1, 3, size, size)
    lines = ["| path | ms per image (batch 1) |", "|---|---|"]
    with torch.no_grad():
        lines.append(f"| float32, CPU ({cpu_name()}) | {timed(lambda: model(x), repeats):.2f} |")
        if torch.cuda.is_available():
            gpu, xg = model.cuda(), x.cuda()
            lines.append(f"| float32, {torch.cuda.get_device_name(0)} | {timed(lambda: gpu(xg), repeats, True):.2f} |")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lines.append(f"| bf16 autocast, GPU | {timed(lambda: gpu(xg), repeats, True):.2f} |")
            model = model.cpu()
    with tempfile.TemporaryDirectory() as work:
        path = export_int8(model, [torch.randn(4, 3, size, size) for _ in range(4)], Path(work) / "u.onnx",
                           {"image-size": size})
        session = OnnxSegmenter(path)
        lines.append(f"| INT8, ONNX Runtime, CPU | {timed(lambda: session(x), repeats):.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.md")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script itself on a CPU")
    args = parser.parse_args(argv)
    started = time.time()
    command = "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
    report = ["# GPU check", "", f"`{command}` on {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}"
              + (" (smoke: tiny sizes)" if args.smoke else ""), ""]
    results: dict[str, str] = {}
    for name in args.sections:
        report += [f"## {name}", ""]
        try:
            report += globals()[f"section_{name}"](args)
            results[name] = "ok"
        except Exception as error:  # one section's failure is reported, the others still run
            report.append(f"failed: {type(error).__name__}: {error}")
            results[name] = f"failed: {type(error).__name__}"
            traceback.print_exc()
        report.append("")
    report.append(f"Total {time.time() - started:.0f} s.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(report) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(report))
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
