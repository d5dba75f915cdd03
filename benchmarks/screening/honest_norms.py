"""How far apart honest hospitals' updates are, so the update-norm rule's default refuses none of them.

    flock /tmp/fedmed-cpu.lock python -m benchmarks.screening.honest_norms          # real data, ~30 min on 2 cores
    python -m benchmarks.screening.honest_norms --quick                            # generated data, ~3 min

Each method runs in one process on the benchmarks' own settings (HAM10000 Dir(0.5) at the FedProIn CPU
preset; Kvasir-SEG + CVC-ClinicDB by source at the QFedPolyp CPU preset, mixed bit-widths included; generated
brain volumes for FedMEPD) with the rule off (``screening.update-norm-limit=0``). Every round records each
hospital's update distance (``update-norm``); the table gives, over all rounds, the largest ratio of a
hospital's distance to the median of the others' in its round: the rule refuses above
``screening.update-norm-limit`` (default 10). Written to ``benchmarks/results/screening_honest_norms.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.machine import cpu_name
from common.config import load_job_config
from common.engine.inprocess import run_rounds, simulated_sites
from common.methods.site import HospitalStateStore

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"

HAM = {"dataset": "ham10000", "data-dir": str(DATA / "ham10000"), "image-size": 28, "resnet-width": 0.25,
       "local-epochs": 2, "batch-size": 32, "partitioner": "dirichlet", "dirichlet-alpha": 0.5, "fraction-train": 0.5,
       "val-fraction": 0.125, "evaluate-every": 100}
POLYP = {"task": "polyp-segmentation", "dataset": "image-mask", "data-dir": str(DATA / "polyp"),
         "partitioner": "by-source", "image-size": 32, "local-epochs": 3, "batch-size": 16, "evaluate-every": 100,
         "min-train-hospitals": 5, "min-available-hospitals": 5}
BRAIN = {"task": "brain-tumour-segmentation", "batch-size": 2, "brain.widths": "4,8,16,32", "brain.crop-size": 16,
         "brain.synthetic-size": 24, "brain.synthetic-cases": 24, "evaluate-every": 100, "device": "cpu",
         "fedmepd.warmup-rounds": 2, "fedmepd.patience": 1, "fedmepd.num-anchors": 2}
QUICK_CLASSIFICATION = {"image-size": 16, "synthetic-samples": 400, "model": "small-cnn", "evaluate-every": 100}
QUICK_POLYP = {"task": "polyp-segmentation", "image-size": 16, "synthetic-samples": 100, "batch-size": 8,
               "evaluate-every": 100, "min-train-hospitals": 5, "min-available-hospitals": 5}

#: name -> (job, hospitals, rounds); ``quick`` swaps real data for generated data and shortens the runs.
CASES: dict[str, tuple[dict[str, Any], int, int]] = {
    "FedAvg, HAM10000 Dir(0.5)": ({**HAM, "strategy": "fedavg"}, 10, 10),
    "FedProx, HAM10000 Dir(0.5)": ({**HAM, "strategy": "fedprox"}, 10, 10),
    "MOON, HAM10000 Dir(0.5)": ({**HAM, "strategy": "moon"}, 10, 10),
    "FedProto, HAM10000 Dir(0.5)": ({**HAM, "strategy": "fedproto"}, 10, 10),
    "FedProIn, HAM10000 Dir(0.5)": ({**HAM, "strategy": "fedproin"}, 10, 10),
    "QFedPolyp 32 bits, polyps by source": ({**POLYP, "strategy": "qfedpolyp", "qfedpolyp.bit-widths": "32"}, 5, 10),
    "QFedPolyp 4,8,8,16,32 bits, polyps by source": ({**POLYP, "strategy": "qfedpolyp",
                                                     "qfedpolyp.bit-widths": "4,8,8,16,32"}, 5, 10),
    "QFedPolyp 3 bits, polyps by source": ({**POLYP, "strategy": "qfedpolyp", "qfedpolyp.bit-widths": "3"}, 5, 10),
    "FedMEPD, generated brain volumes": ({**BRAIN, "strategy": "fedmepd",
                                          "brain.hospital-modalities": "t1ce;t2;flair,t1ce;t1,t2"}, 4, 6),
}


def quick(name: str, job: dict[str, Any], hospitals: int, rounds: int) -> tuple[dict[str, Any], int, int]:
    if "HAM10000" in name:
        return {**job, **{k: v for k, v in QUICK_CLASSIFICATION.items()}, "dataset": "synthetic", "data-dir": "",
                "partitioner": "dirichlet"}, 6, 3
    if "polyp" in name:
        return {**{k: v for k, v in job.items() if k not in ("dataset", "data-dir", "partitioner")},
                **QUICK_POLYP}, 5, 3
    return job, hospitals, 3


def largest_ratios(history: list[dict[str, Any]]) -> list[float]:
    """Per round, the largest ratio of a hospital's update distance to the median of the others' distances."""
    ratios = []
    for record in history:
        norms = record.get("update-norm", {})
        for name, distance in norms.items():
            others = [d for other, d in norms.items() if other != name]
            if others and np.median(others) > 0:
                ratios.append(distance / float(np.median(others)))
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="generated data, 3 rounds per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="substrings of case names to run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rows = []
    for name, (job, hospitals, rounds) in CASES.items():
        if args.only and not any(part in name for part in args.only):
            continue
        if args.quick:
            job, hospitals, rounds = quick(name, job, hospitals, rounds)
        elif "data-dir" in job and not Path(job["data-dir"]).exists():
            print(f"skipping {name}: {job['data-dir']} is absent", file=sys.stderr)
            continue
        cfg = load_job_config({**job, "num-server-rounds": rounds, "screening.update-norm-limit": 0.0,
                               "run-name": "norms", "min-available-hospitals": hospitals})
        started = time.time()
        sites = simulated_sites(cfg, hospitals, device=cfg.device)
        for site in sites:
            site.state = HospitalStateStore(None, keep=1)
        history = run_rounds(cfg, sites).history
        ratios = largest_ratios(history)
        rows.append({"case": name, "hospitals": hospitals, "rounds": rounds, "updates": len(ratios),
                     "largest": max(ratios), "p95": float(np.percentile(ratios, 95)),
                     "median": float(np.median(ratios)), "minutes": (time.time() - started) / 60})
        print(json.dumps(rows[-1]), flush=True)
    write_table(rows, args)
    return 0


def write_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The table and its JSON; a rerun of some cases (``--only``) replaces just their rows."""
    suffix = "_quick" if args.quick else ""
    earlier = RESULTS / f"screening_honest_norms{suffix}.json"
    if args.only and earlier.exists():
        fresh = {r["case"]: r for r in rows}
        rows = [fresh.pop(r["case"], r) for r in json.loads(earlier.read_text())] + list(fresh.values())
    cpu = cpu_name()
    command = "python -m benchmarks.screening.honest_norms" + (" --quick" if args.quick else "")
    lines = [f"# Honest hospitals' update distances ({'generated data' if args.quick else 'real data'})", "",
             f"`{command}` on {cpu}, {args.threads} threads.", "",
             "Ratio of a hospital's update distance (L2 distance of its reply from the model it received; FedProto: "
             "from the model it sent last time) to the median of the other hospitals' in the same round; the "
             "update-norm rule refuses above `screening.update-norm-limit` (default 10).", "",
             "| case | hospitals | rounds | updates | largest ratio | 95th pct | median | minutes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['hospitals']} | {r['rounds']} | {r['updates']} | {r['largest']:.2f} | "
              f"{r['p95']:.2f} | {r['median']:.2f} | {r['minutes']:.1f} |" for r in rows]
    (RESULTS / f"screening_honest_norms{suffix}.md").write_text("\n".join(lines) + "\n")
    earlier.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
