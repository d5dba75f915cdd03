"""Are a compressed QFedPolyp run's BatchNorm statistics why it trails 32 bits? Scores each run's final global model
on held-out images three ways: as saved, with its statistics sent at 8 bits and back (``stats8`` rows), and with its
statistics recomputed on other images by a forward pass (the weights unchanged).

    python -m benchmarks.qfedpolyp.statistics_check <run> [<run> ...] --data <q>/heldout --recompute-on <q>/pool \
        --out benchmarks/results/qfedpolyp_statistics_check.md

If the low-bit rows lost Dice through their statistics (sent at 8 bits, or the hospitals' statistics of models the
global weights lag behind), the second or the third score would close the gap to 32 bits; if not, it is the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common.config import JobConfig
from common.machine import cpu_name
from common.methods.base import unpack_json
from common.methods.registry import server_class
from common.quantization.codec import decode_model
from common.tasks import get_task, task_class
from server_app.checkpoint import find_checkpoint, load_checkpoint
from strategies.qfedpolyp.messages import is_statistic, pack_statistics


def global_model(run: Path, data: Path, statistics_bits: int = 32):
    """The run's final global model (its statistics through ``statistics_bits`` if below 32), its task and the
    labelled images in ``data``."""
    state = load_checkpoint(find_checkpoint(run))
    cfg = JobConfig.model_validate(unpack_json(state["run/config"]))
    cfg = cfg.model_copy(update={"dataset": "image-mask", "test_dir": str(data), "data_dir": ""})
    kind = task_class(cfg.task)
    images = kind.load_test(cfg)
    task = get_task(cfg, {**kind.describe(images), **unpack_json(state["run/model-spec"])})
    arrays = {k.removeprefix("method/"): v for k, v in state.items() if k.startswith("method/")}
    if statistics_bits < 32:
        statistics = {k: v for k, v in arrays.items() if k.startswith("global/") and is_statistic(k)}
        arrays.update(decode_model(pack_statistics(statistics, statistics_bits), reference=statistics))
    method = server_class(cfg.strategy)(cfg, task)
    method.initialize()
    method.load_state_dict(arrays)
    return method.evaluation_model(None), task, images


@torch.no_grad()
def recompute_statistics(model: torch.nn.Module, task, images) -> None:
    """Every BatchNorm layer's running mean and variance as the plain average over ``images`` (weights unchanged)."""
    for layer in model.modules():
        if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
            layer.reset_running_stats()
            layer.momentum = None  # cumulative average
    model.train()
    for x, _ in task.batches(images, 32, torch.device("cpu"), None, train=False):
        model(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--data", type=Path, required=True, help="labelled images the scores are on")
    parser.add_argument("--recompute-on", type=Path, required=True, help="images the statistics are recomputed on")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = " ".join(["python -m benchmarks.qfedpolyp.statistics_check", *(sys.argv[1:] if argv is None else argv)])
    lines = ["# QFedPolyp: the global model's BatchNorm statistics and its Dice", "", f"Command: `{command}`",
             "", f"Final global model of each run, Dice on `{args.data}`; CPU: {cpu_name()}.", "",
             "| run | as saved | statistics at 8 bits | statistics recomputed |", "|---|---:|---:|---:|"]
    for run in args.runs:
        model, task, images = global_model(run, args.data)
        saved = task.evaluate(model, images)["dice"]
        model8, _, _ = global_model(run, args.data, statistics_bits=8)
        at8 = task.evaluate(model8, images)["dice"]
        _, _, calibration = global_model(run, args.recompute_on)
        recompute_statistics(model, task, calibration)
        recomputed = task.evaluate(model, images)["dice"]
        lines.append(f"| {run.parent.parent.name}/{run.name} | {saved:.4f} | {at8:.4f} | {recomputed:.4f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
