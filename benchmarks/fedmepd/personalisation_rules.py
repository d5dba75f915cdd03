"""FedMEPD's personalisation rule, piece by piece: the public code's rule against each of this project's first
choices, on generated volumes where each tumour region shows in only some modalities (as the test
``test_fedmepd_beats_fedavg_for_hospitals_that_miss_modalities``: three hospitals with one modality each).

    python -m benchmarks.fedmepd.personalisation_rules            # about 6 minutes on two cores

Rows: the public code's rule (default), the first rule of this project (all three departures), each departure
alone, and FedAvg (shared encoder) as the reference. Hospital score: mean Dice of WT/TC/ET of each hospital's
final model on its own modalities, averaged over the hospitals; personal: the share of decoder filters that
ended personal, per hospital. Writes ``benchmarks/results/fedmepd/personalisation_rules.md``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

from common.config import load_job_config
from common.inprocess import evaluate_hospitals, run_rounds, simulated_sites

RESULTS = Path(__file__).resolve().parent.parent / "results" / "fedmepd" / "personalisation_rules.md"
JOB = {"task": "brain-tumour-segmentation", "batch-size": 4, "brain.widths": "4,8,16,32", "brain.crop-size": 16,
       "brain.synthetic-size": 24, "brain.synthetic-cases": 10, "brain.crops-per-case": 8, "device": "cpu",
       "learning-rate": 0.01, "fedmepd.warmup-rounds": 2, "fedmepd.patience": 2, "fedmepd.num-anchors": 2,
       "fedmepd.anchor-momentum": 0.5, "num-server-rounds": 8, "evaluate-every": 100, "min-train-hospitals": 1,
       "test-fraction": 0.2, "brain.server-fraction": 0.2, "brain.hospital-modalities": "t1ce;t2;flair"}
RULES = {
    "public code's rule (default)": {},
    "this project's first rule (all three)": {"fedmepd.server-change-from": "aggregated",
                                              "fedmepd.initial-weight": "share",
                                              "fedmepd.filter-vector": "kernel-and-bias"},
    "delta_s from the aggregate": {"fedmepd.server-change-from": "aggregated"},
    "weights start at the sample share": {"fedmepd.initial-weight": "share"},
    "cosine on kernel and bias": {"fedmepd.filter-vector": "kernel-and-bias"},
    "FedAvg (shared encoder)": {"strategy": "fedmepd-fedavg"},
}


def score(overrides: dict, seed: int, state: Path) -> tuple[float, dict[str, float]]:
    cfg = load_job_config({**JOB, "strategy": "fedmepd", "seed": seed, **overrides})
    sites = simulated_sites(cfg, 3, state)
    engine = run_rounds(cfg, sites)
    scores = evaluate_hospitals(cfg, engine, sites)
    personal = {h: v["all"] for h, v in engine.history[-1]["method"].get("personalised", {}).items()}
    return float(np.mean([s["dice_mean"] for s in scores.values()])), personal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = ["# FedMEPD: the personalisation rule, piece by piece", "",
             f"`python -m benchmarks.fedmepd.personalisation_rules --seeds {' '.join(map(str, args.seeds))}`: "
             "generated volumes (24^3, each tumour region visible only in some modalities), three hospitals with "
             "T1c, T2 and FLAIR alone, a server with all four, 8 rounds, warm-up 2, patience 2; widths 4-8-16-32.",
             "", "| rule | hospital mean Dice (mean over seeds) | personal decoder filters at the end |",
             "|---|---:|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RULES.items():
            results = [score(overrides, seed, Path(tmp) / f"{len(lines)}-{seed}") for seed in args.seeds]
            dice = float(np.mean([r[0] for r in results]))
            personal = results[-1][1]
            shown = ", ".join(f"{h} {v:.0%}" for h, v in sorted(personal.items())) or "-"
            lines.append(f"| {name} | {dice:.3f} | {shown} |")
            print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
