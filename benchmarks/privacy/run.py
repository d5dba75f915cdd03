"""What a hospital policy's local DP costs: the same in-process federation (``common.engine.inprocess.run_rounds``)
without local DP and with it at several noise levels, test accuracy and each hospital's epsilon after every round, side
by side (docs/privacy.md).

    python -m benchmarks.privacy.run                              # FedAvg, small-cnn, 4 hospitals, 10 rounds
    python -m benchmarks.privacy.run --sigmas 0.5 2 --clip 0.5 --out benchmarks/privacy/results.md

Every hospital holds the same policy (``common.trust.policy.Policy``: clip-norm C, noise-multiplier sigma, delta) and
its own ledger; the rest of the run is exactly a run without the policy (same data, split, seeds). ``--clip 0`` takes C
as the median update norm of round 1 without DP, measured in the run without DP.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path
from unittest import mock

from benchmarks.machine import cpu_name
from common.config import load_job_config
from common.engine.inprocess import run_rounds, simulated_sites
from common.methods.registry import hospital_class
from common.trust.enforcer import Enforcer, policed
from common.trust.ledger import PrivacyLedger
from common.trust.local_dp import effective_noise_multiplier
from common.trust.policy import LocalDP, Policy


def run(cfg, hospitals: int, policy: Policy | None) -> tuple[list[dict], dict[str, PrivacyLedger]]:
    """The run's round records and each hospital's ledger (empty without a policy)."""
    sites = simulated_sites(cfg, hospitals)
    ledgers: dict[str, PrivacyLedger] = {}
    if policy is None:
        return run_rounds(cfg, sites).history, ledgers

    def enforcer(name: str) -> Enforcer:
        return Enforcer(policy, ledgers.setdefault(name, PrivacyLedger(None)))

    with mock.patch("common.engine.inprocess.hospital_class", lambda method: policed(hospital_class(method), enforcer,
                                                                               cfg.run_name)):
        return run_rounds(cfg, sites).history, ledgers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="fedavg")
    parser.add_argument("--model", default="small-cnn")
    parser.add_argument("--hospitals", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--samples", type=int, default=1200, help="synthetic-samples (training samples in all)")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--clip", type=float, default=0.0, help="C (0: round 1's median update norm without DP)")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.1, 1.0], help="noise multipliers to compare")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write the table to")
    args = parser.parse_args(argv)
    logging.getLogger("fedmed").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    cfg = load_job_config({"run-name": "privacy-benchmark", "strategy": args.strategy, "model": args.model,
                           "num-server-rounds": args.rounds, "synthetic-samples": args.samples,
                           "image-size": args.image_size, "seed": args.seed, "device": "cpu",
                           "min-train-hospitals": 1, "min-available-hospitals": 1})
    started = time.time()
    plain, _ = run(cfg, args.hospitals, None)
    clip = args.clip or statistics.median(plain[0]["update-norm"].values())
    columns = {"no DP": ([r["test"]["accuracy"] for r in plain], None)}
    seconds = {"no DP": time.time() - started}
    for sigma in args.sigmas:
        started = time.time()
        policy = Policy(local_dp=LocalDP(clip_norm=clip, noise_multiplier=sigma, delta=args.delta))
        history, ledgers = run(cfg, args.hospitals, policy)
        z = effective_noise_multiplier(args.strategy, sigma)
        from common.trust.local_dp import epsilon_of

        epsilons = [epsilon_of([z] * rnd, args.delta) for rnd in range(1, args.rounds + 1)]
        assert all(ledger.epsilon(args.delta) == epsilons[-1] for ledger in ledgers.values())  # every round, each
        columns[f"sigma={sigma:g}"] = ([r["test"]["accuracy"] for r in history], epsilons)
        seconds[f"sigma={sigma:g}"] = time.time() - started
    header = ["round"] + [f"{name} accuracy" + ("" if eps is None else f" | {name} epsilon")
                          for name, (_, eps) in columns.items()]
    lines = [f"# Local DP's cost: {args.strategy}, {args.model}, {args.hospitals} hospitals, {args.rounds} rounds",
             "",
             f"`python -m benchmarks.privacy.run --strategy {args.strategy} --model {args.model} --hospitals "
             f"{args.hospitals} --rounds {args.rounds} --samples {args.samples} --image-size {args.image_size} "
             f"--sigmas {' '.join(f'{s:g}' for s in args.sigmas)}{f' --clip {args.clip:g}' if args.clip else ''}`",
             "",
             f"Machine: {cpu_name()} (torch on 1 thread). Generated classification data ({args.samples} training "
             f"samples, {args.image_size}x{args.image_size}), test accuracy of the global model on the server's "
             f"held-out set after each round. Local DP: each hospital's update clipped to C={clip:.4g} "
             f"({'given' if args.clip else 'the median update norm of round 1 without DP'}), Gaussian noise of std "
             f"sigma*C per coordinate; epsilon at delta={args.delta:g} per hospital (each trains every round), for "
             "any change of one sample of its data (RDP accountant of dp-accounting, noise multiplier sigma/2). "
             "Seconds per run: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + ".",
             "",
             "| " + " | ".join(header) + " |",
             "|" + "---|" * (1 + sum(1 if eps is None else 2 for _, eps in columns.values()))]
    for index in range(args.rounds):
        cells = [str(index + 1)]
        for accuracy, eps in columns.values():
            cells.append(f"{accuracy[index]:.3f}")
            if eps is not None:
                cells.append(f"{eps[index]:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
