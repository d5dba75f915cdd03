"""FedMEPD against its baselines on real BraTS cases (or generated ones), in the layout of the paper's table,
in one process.

    python -m benchmarks.fedmepd.run --preset cpu --seeds 0 1 2   # two cores, hours
    python -m benchmarks.fedmepd.run --preset generated-cpu --seeds 0 1 2   # 8 hospitals, generated volumes
    python -m benchmarks.fedmepd.run --preset paper                # for a GPU (and a full BraTS folder)
    python -m benchmarks.fedmepd.run --preset paper --one-step     # build the paper's model, take one step

The server trains on its full-modality cases, the hospitals hold the paper's kinds of modality
subsets (``brain.hospital-modalities``; the first ``--hospitals`` of them), and every method runs on
the same split, rounds, crops and learning rate. The 17 cases of ``../shared/data/brats`` go 3 to the
held-out test set, 2 to the server and 3 to each of 4 hospitals (each seed draws its own split). A
hospital's final score is that of the model it holds after the last round
(``common.engine.inprocess.evaluate_hospitals``) on the test cases restricted to its modalities; the server's is
the global model's on the full-modality test cases.
``generated-cpu`` has 36 generated volumes: 8 test cases, 4 for the server, 3 for each of the paper's
8 hospital kinds, so that a hospital's personal filters are scored on cases it never trained on.
Each finished run is written to ``<out>/runs/<method>-seed<s>.json`` and skipped when the script is
started again; the report (``report.md``, ``rounds.png``) is rebuilt at the end. Long runs belong
under the shared CPU lock: ``flock /tmp/fedmed-cpu.lock python -m benchmarks.fedmepd.run ...``.

The paper preset (80^3 crops, 16-32-64-128 channels, batch 1, 1000 rounds) needs one GPU. ``python -m
benchmarks.gpu_check --sections presets`` measures its seconds per round and peak GPU memory on the machine at hand
(one round on generated data of the preset's sizes); it has not yet run on a GPU, as none was lent to this work, so
no figure is given here.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common.config import load_job_config
from common.engine.inprocess import evaluate_hospitals, run_rounds, simulated_sites
from common.methods.site import HospitalStateStore

from .report import write_report

ROOT = Path(__file__).resolve().parents[2]
BRATS = ROOT.parent / "shared" / "data" / "brats"
log = logging.getLogger("fedmed")

#: The paper's protocol (80^3 crops at full resolution, 16-32-64-128 channels, batch 1, Adam 2e-4 with
#: weight decay 1e-5 and poly decay, 1000 rounds, warm-up 30, P = 10, N_k = 4, EMA 0.999), and a CPU
#: preset with the same structure shrunk to two cores: volumes downsampled 3x, 32^3 crops, halved
#: channels, 20 rounds (warm-up, patience and anchor EMA scaled to the shorter run).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"num-server-rounds": 1000, "batch-size": 1, "learning-rate": 2e-4, "weight-decay": 1e-5,
              "evaluate-every": 50, "brain.widths": "16,32,64,128", "brain.crop-size": 80, "brain.downsample": 1,
              "brain.crops-per-case": 1, "fedmepd.warmup-rounds": 30, "fedmepd.patience": 10,
              "fedmepd.anchor-momentum": 0.999},
    "cpu": {"num-server-rounds": 20, "batch-size": 2, "learning-rate": 2e-3, "weight-decay": 1e-5,
            "evaluate-every": 5, "brain.widths": "8,16,32,64", "brain.crop-size": 32, "brain.downsample": 3,
            "brain.crops-per-case": 4, "fedmepd.warmup-rounds": 2, "fedmepd.patience": 3,
            "fedmepd.anchor-momentum": 0.9},
    # Generated volumes (common/data/synthetic_brats.py: each tumour region visible in some modalities only),
    # enough of them for the paper's 8 hospital kinds with 3 training cases each, the server's 4 and 8 unseen
    # test cases; 24^3 volumes, 16^3 crops and widths 4-8-16-32, so that a run takes minutes on two cores.
    "generated-cpu": {"dataset": "synthetic", "brain.synthetic-cases": 36, "brain.synthetic-size": 24,
                      "test-fraction": 8 / 36, "brain.server-fraction": 4 / 36,
                      "num-server-rounds": 15, "batch-size": 4, "learning-rate": 0.01, "weight-decay": 1e-5,
                      "evaluate-every": 5, "brain.widths": "4,8,16,32", "brain.crop-size": 16, "brain.downsample": 1,
                      "brain.crops-per-case": 4, "fedmepd.warmup-rounds": 2, "fedmepd.patience": 2,
                      "fedmepd.num-anchors": 2, "fedmepd.anchor-momentum": 0.5},
}
#: Simulated hospitals per preset (the 17 real cases: 3 test, 2 server, 3 for each of 4 hospitals).
HOSPITALS = {"cpu": 4, "paper": 4, "generated-cpu": 8}
PROTOCOL = {"task": "brain-tumour-segmentation", "dataset": "brats",
            "test-fraction": 3 / 17, "brain.server-fraction": 2 / 17,
            "local-epochs": 1, "fraction-train": 1.0, "min-train-hospitals": 1, "min-available-hospitals": 1,
            "fedmepd.num-anchors": 4, "device": "auto"}

#: Table rows in the paper's order: name -> (file name of its runs, run-config keys).
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "Local": ("fedmepd-local", {"strategy": "fedmepd-local"}),
    "FedAvg (shared encoder)": ("fedmepd-fedavg", {"strategy": "fedmepd-fedavg"}),
    "Modality encoders + federated decoder": ("fedmepd-federated-decoder", {"strategy": "fedmepd-federated-decoder"}),
    "FedMEPD": ("fedmepd", {"strategy": "fedmepd"}),
    "FedMEPD without LACCA": ("fedmepd-no-lacca", {"strategy": "fedmepd", "fedmepd.lacca": False}),
}
#: Rows run unless --methods names others.
DEFAULT_METHODS = {"cpu": list(METHODS), "paper": list(METHODS)[:4], "generated-cpu": list(METHODS)}


def compact(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round what the report needs: test and hospital-average scores, personalisation, time, traffic."""
    rounds = []
    for record in history:
        method = record.get("method", {})
        rounds.append({"round": record["round"], "seconds": record["seconds"], "bytes_up": record["bytes_up"],
                       "bytes_down": record["bytes_down"], "refused": record["refused"], "test": record.get("test", {}),
                       "hospital-average": method.get("hospital-average", {}),
                       "personalised": {h: v["all"] for h, v in method.get("personalised", {}).items()}})
    return rounds


def run_one(flat: dict[str, Any], hospitals: int) -> dict[str, Any]:
    cfg = load_job_config(flat, check_paths=True)
    sites = simulated_sites(cfg, hospitals, device=cfg.device)
    for site in sites:
        site.state = HospitalStateStore(None, keep=1)  # in memory: a hospital only reads back its last round
    started = time.time()
    engine = run_rounds(cfg, sites)
    final = evaluate_hospitals(cfg, engine, sites)
    return {"seconds": time.time() - started, "config": cfg.to_flat(),
            "hospitals": {s.name: s.properties["modalities"] for s in sites},
            "cases": {s.name: [c.name for c in s.train] for s in sites},
            "test-cases": [c.name for c in engine.test_data],
            "final": final, "server": engine.history[-1].get("test", {}), "history": compact(engine.history)}


def one_step(flat: dict[str, Any]) -> None:
    """Build the preset's model and take one training step on real crops (checks a preset without a GPU)."""
    from common.tasks.brain import BrainTumourTask

    cfg = load_job_config({**flat, "strategy": "fedmepd"}, check_paths=True)
    task = BrainTumourTask(cfg, {"num-classes": 4})
    model = task.build_model(lacca=True)
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu")
    cases = task.load_server_train()[:1]
    started = time.time()
    stats = task.fit(model, cases, device, seed=0)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"one step of the {cfg.brain.widths} model ({parameters / 1e6:.2f} M parameters, LACCA on) on "
          f"{cfg.brain.crop_size}^3 crops of {cases[0].name} {cases[0].image.shape[1:]} on {device}: "
          f"loss {stats['train-loss']:.3f} in {time.time() - started:.1f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--data", type=Path, default=BRATS, help="a folder of BraTS case folders")
    parser.add_argument("--hospitals", type=int, help="simulated hospitals (default: 4 for the real cases, 8 for "
                        "generated-cpu: the paper's 8 kinds of modality subsets)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), metavar="METHOD",
                        help="rows to run (default: the preset's, see DEFAULT_METHODS)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run-config key, e.g. --set num-server-rounds=2 --set brain.crop-size=16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared two-core machine)")
    parser.add_argument("--one-step", action="store_true", help="only build the model and take one training step")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/fedmepd/brats17-<preset> (the 17 cases)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    flat = {**PROTOCOL, **PRESETS[args.preset]}
    if flat.get("dataset") != "synthetic":
        flat["data-dir"] = str(args.data)
    methods = args.methods or DEFAULT_METHODS[args.preset]
    hospitals = args.hospitals or HOSPITALS[args.preset]
    for item in args.set:
        key, _, text = item.partition("=")
        try:
            flat[key] = json.loads(text)
        except ValueError:
            flat[key] = text
    if args.one_step:
        one_step(flat)
        return 0
    out = args.out or ROOT / "benchmarks" / "results" / "fedmepd" / (
        args.preset if args.preset.startswith("generated") else f"brats17-{args.preset}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for name in methods:
            slug, keys = METHODS[name]
            target = out / "runs" / f"{slug}-seed{seed}.json"
            if target.exists():
                continue
            log.info("=== %s, seed %d", name, seed)
            record = {"method": name, "seed": seed,
                      **run_one({**flat, **keys, "seed": seed, "run-name": target.stem}, hospitals)}
            target.write_text(json.dumps(record, indent=1) + "\n")
            log.info("=== %s, seed %d: server %.4f, hospitals %s in %.0fs", name, seed,
                     record["server"].get("dice_mean", float("nan")),
                     {h: round(m["dice_mean"], 4) for h, m in record["final"].items()}, record["seconds"])
    command = "python -m benchmarks.fedmepd.run " + shlex.join(argv if argv is not None else sys.argv[1:])
    data = "generated volumes" if flat.get("dataset") == "synthetic" else "BraTS"
    write_report(out, [n for n in METHODS if n in methods], args.seeds, f"{data}, preset {args.preset}", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
