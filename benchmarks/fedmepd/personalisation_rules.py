"""FedMEPD's personalisation rule, piece by piece: the public code's rule against each of this project's first
choices, on generated volumes where each tumour region shows in only some modalities (as the test
``test_fedmepd_hospitals_that_miss_modalities_gain_from_federation``: three hospitals with one modality each).

    python -m benchmarks.fedmepd.personalisation_rules --seeds 0 1 2 3   # about 4 minutes a seed, one core

Rows: the public code's rule (default), the first rule of this project (all three departures), each departure
alone, and FedAvg (shared encoder) and Local training as the references. Hospital score: mean Dice of WT/TC/ET
of each hospital's final model on its own modalities, averaged over the hospitals; personal: the share of decoder
filters that ended personal, per hospital. Writes ``benchmarks/results/fedmepd/personalisation_rules.md``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

from benchmarks.machine import cpu_name
from common.config import load_job_config
from common.engine.inprocess import evaluate_hospitals, run_rounds, simulated_sites

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
    "Local (every hospital alone)": {"strategy": "fedmepd-local"},
}


def score(overrides: dict, seed: int, rounds: int, state: Path) -> tuple[float, float, dict[str, float]]:
    """Hospital mean Dice (mean of WT/TC/ET), hospital mean TC Dice, and each hospital's share of personal filters."""
    cfg = load_job_config({**JOB, "strategy": "fedmepd", "seed": seed, "num-server-rounds": rounds, **overrides})
    sites = simulated_sites(cfg, 3, state)
    engine = run_rounds(cfg, sites)
    scores = list(evaluate_hospitals(cfg, engine, sites).values())
    personal = {h: v["all"] for h, v in engine.history[-1]["method"].get("personalised", {}).items()}
    return float(np.mean([s["dice_mean"] for s in scores])), float(np.mean([s["dice_TC"] for s in scores])), personal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--only", nargs="+", default=[], help="Rows whose name contains one of these words.")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rules = {name: o for name, o in RULES.items() if not args.only or any(w in name for w in args.only)}
    if not rules:
        parser.error(f"--only {' '.join(args.only)}: no row matches; rows: {', '.join(RULES)}")
    command = " ".join(["python -m benchmarks.fedmepd.personalisation_rules --seeds", *map(str, args.seeds)]
                       + (["--rounds", str(args.rounds)] if args.rounds != 8 else [])
                       + (["--only", *(repr(w) for w in args.only)] if args.only else []))
    torch.set_num_threads(1)
    lines = ["# FedMEPD: the personalisation rule, piece by piece", "",
             f"`{command}` on {cpu_name()}, one thread: generated volumes (24^3, each tumour region visible only "
             "in some modalities), three hospitals with T1c, T2 and FLAIR alone, a server with all four, "
             f"{args.rounds} rounds, warm-up 2, patience 2; widths 4-8-16-32.",
             "", "| rule | hospital mean Dice (mean ± std over seeds) | by seed | hospital mean TC Dice by seed "
             "| personal decoder filters at the end (last seed) |", "|---|---:|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in rules.items():
            results = [score(overrides, seed, args.rounds, Path(tmp) / f"{len(lines)}-{seed}") for seed in args.seeds]
            dice = [r[0] for r in results]
            personal = results[-1][2]
            shown = ", ".join(f"{h} {v:.0%}" for h, v in sorted(personal.items())) or "-"
            by_seed = ", ".join(f"{d:.3f}" for d in dice)
            tc = ", ".join(f"{r[1]:.2f}" for r in results)
            lines.append(f"| {name} | {np.mean(dice):.3f} ± {np.std(dice):.3f} | {by_seed} | {tc} | {shown} |")
            print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
