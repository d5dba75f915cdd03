"""What distributed DP costs against the other ways a consortium can add noise, on the same federation: no DP, a
hospital's local DP, central DP (Flower's ``DifferentialPrivacyServerSideFixedClipping``: the server adds the
noise) and distributed DP under secure aggregation (each hospital adds its share), all with the same clipping bound
C, final test accuracy and epsilon per run (docs/privacy.md, "What distributed DP costs").

    python -m benchmarks.privacy.distributed --data demo --out benchmarks/results/distributed_dp_demo.md
    python -m benchmarks.privacy.distributed --data blood --out benchmarks/results/distributed_dp_blood.md

Every run is FedAvg over FakeGrid (``tests/fake_grid.py``: fedmed's own ClientApp at each hospital, in this
process), the same data, split and seeds; C is the median update norm of round 1 without DP. Epsilon is record-level
(any one image of a hospital replaced by another), at delta 1e-5, over all rounds:

- local DP: each hospital's own ledger (noise sigma C on its update; a Gaussian of multiplier sigma / 2);
- central DP: noise z C on the sum (Flower adds z C / n to the mean), the Gaussian of multiplier z / 2 per round,
  counted here as the server would have to report it;
- distributed DP: each hospital's own ledger (``[distributed-dp]`` in its policy, all hospitals of the round counted
  honest): the Skellam sum of variance (z C)^2, the same noise as central DP, no party seeing a less noisy value.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import cpu_name

ROOT = Path(__file__).resolve().parents[2]
DATA = {
    "demo": {"dataset": "synthetic", "synthetic-samples": 1200, "image-size": 32, "partitioner": "dirichlet",
             "dirichlet-alpha": 0.5},
    "blood": {"dataset": "npz", "data-dir": str(ROOT.parent / "shared" / "data" / "blood" / "pbc_blood_28.npz"),
              "image-size": 28, "partitioner": "dirichlet", "dirichlet-alpha": 0.5},
}
DELTA = 1e-5


def job(data: str, hospitals: int, rounds: int, seed: int, folder: Path, name: str, **extra) -> dict[str, Any]:
    return {**DATA[data], "model": "small-cnn", "strategy": "fedavg", "num-server-rounds": rounds, "seed": seed,
            "batch-size": 32, "learning-rate": 1e-3, "local-epochs": 1, "device": "cpu", "run-name": name,
            "min-train-hospitals": hospitals, "min-available-hospitals": hospitals,
            "state-dir": str(folder / name / "state"), "results-dir": str(folder / name / "results"),
            "audit-log": "none", **extra}


def reads_from(config: dict[str, Any]) -> str:
    """The policy line that lets a hospital read the benchmark's data file (a path the run config names must lie in
    the hospital's own folders: common/trust/argument_gate.py)."""
    where = config.get("data-dir")
    return f"argument-folders = [{json.dumps(str(Path(where).parent))}]\n" if where else ""


def hospitals_of(config: dict[str, Any], count: int, policy: Path | None):
    from tests.fake_grid import FakeGrid, simulated_hospitals

    return FakeGrid(simulated_hospitals(config, count, **({"policy-file": str(policy)} if policy else {})))


def accuracy(strategy) -> float:
    return float(strategy.engine.history[-1]["test"]["accuracy"])


def ledger_epsilon(config: dict[str, Any]) -> float:
    """The largest epsilon any hospital's ledger holds after the run."""
    from common.trust.ledger import PrivacyLedger

    folders = sorted(Path(config["state-dir"]).iterdir())
    return max(PrivacyLedger(folder).epsilon(DELTA) for folder in folders if (folder / "privacy-ledger.json").exists())


def run_plain(config: dict[str, Any], count: int):
    from strategies import FedAvgStrategy

    strategy = FedAvgStrategy(min_train_nodes=count, min_available_nodes=count, run_config=config)
    strategy.start(hospitals_of(config, count, None), num_rounds=config["num-server-rounds"])
    return strategy


def run_local(config: dict[str, Any], count: int, clip: float, sigma: float, folder: Path) -> tuple[float, float]:
    from strategies import FedAvgStrategy

    policy = folder / f"local-{sigma:g}.toml"
    policy.write_text(f"{reads_from(config)}[local-dp]\nclip-norm = {clip}\nnoise-multiplier = {sigma}\n"
                      f"delta = {DELTA}\n")
    strategy = FedAvgStrategy(min_train_nodes=count, min_available_nodes=count, run_config=config)
    strategy.start(hospitals_of(config, count, policy), num_rounds=config["num-server-rounds"])
    return accuracy(strategy), ledger_epsilon(config)


def run_central(config: dict[str, Any], count: int, clip: float, z: float) -> tuple[float, float]:
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from common.trust.local_dp import epsilon_of
    from strategies import FedAvgStrategy

    strategy = FedAvgStrategy(min_train_nodes=count, min_available_nodes=count,
                              run_config={**config, "message-arrays": "per-tensor"})
    wrapper = DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier=z, clipping_norm=clip,
                                                         num_sampled_clients=count)
    wrapper.start(hospitals_of(config, count, None), initial_arrays=strategy.initial_arrays(),
                  num_rounds=config["num-server-rounds"])
    return accuracy(strategy), epsilon_of([z / 2] * config["num-server-rounds"], DELTA)  # local DP's accountant


def run_distributed(config: dict[str, Any], count: int, clip: float, z: float, folder: Path) -> tuple[float, float]:
    from benchmarks.secure_aggregation.run import signed_nodes
    from strategies import FedAvgStrategy
    from strategies.secure_aggregation import with_secure_aggregation
    from tests.fake_grid import FakeGrid, hospital_node

    # each hospital counts every hospital of the sum as honest: it holds the consortium's keys, each pinned in its
    # policy (a hospital whose peers are not pinned counts its own noise alone)
    keys = folder / f"keys-{count}-{z:g}"
    nodes = signed_nodes(keys, count)
    policy = keys / "policy.toml"
    policy.write_text(f"min-hospitals-per-sum = {count}\n{reads_from(config)}[distributed-dp]\n"
                      f"min-noise-multiplier = 0.001\nmax-dropped-or-colluding = 0\ndelta = {DELTA}\n\n"
                      f"{policy.read_text()}")
    config = {**config, "secure-aggregation.distributed-dp": "skellam", "secure-aggregation.noise-multiplier": z,
              "secure-aggregation.update-norm-bound": clip, "hospital-keys": str(keys)}
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=count, min_available_nodes=count,
                                                       run_config=config)
    strategy.start(FakeGrid({node_id: hospital_node(config, node, node_id) for node_id, node in nodes.items()}),
                   num_rounds=config["num-server-rounds"])
    skipped = [r["skipped"] for r in strategy.engine.history if "skipped" in r]
    if skipped:
        raise RuntimeError(f"a distributed-DP round was skipped: {skipped[0]}")
    return accuracy(strategy), ledger_epsilon(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=sorted(DATA), default="demo")
    parser.add_argument("--hospitals", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3, 1.0],
                        help="noise multipliers: sigma for local DP, z for central and distributed DP")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    logging.getLogger("fedmed").setLevel(logging.ERROR)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    rows: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        for count in args.hospitals:
            name = f"{args.data}-{count}"
            plain = run_plain(job(args.data, count, args.rounds, args.seed, folder, f"{name}-plain"), count)
            clip = float(statistics.median(plain.engine.history[0]["update-norm"].values()))
            rows.append({"hospitals": count, "kind": "no DP", "noise": None, "accuracy": accuracy(plain),
                         "epsilon": None, "clip": clip})
            print(json.dumps(rows[-1]), flush=True)
            for noise in args.noise:
                for kind, measure in (
                        ("local DP", lambda c: run_local(c, count, clip, noise, folder)),
                        ("central DP", lambda c: run_central(c, count, clip, noise)),
                        ("distributed DP", lambda c: run_distributed(c, count, clip, noise, folder))):
                    config = job(args.data, count, args.rounds, args.seed, folder,
                                 f"{name}-{kind.split()[0]}-{noise:g}")
                    score, eps = measure(config)
                    rows.append({"hospitals": count, "kind": kind, "noise": noise, "accuracy": score,
                                 "epsilon": eps, "clip": clip})
                    print(json.dumps(rows[-1]), flush=True)
    text = table(args, rows, time.time() - started)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu_name(), "rows": rows}, indent=1) + "\n")
    return 0


def table(args, rows: list[dict[str, Any]], seconds: float) -> str:
    command = (f"python -m benchmarks.privacy.distributed --data {args.data} --hospitals "
               f"{' '.join(map(str, args.hospitals))} --rounds {args.rounds} --noise "
               f"{' '.join(f'{n:g}' for n in args.noise)} --seed {args.seed}")
    lines = [f"# Distributed DP against local and central DP: {args.data} data", "", f"`{command}`", "",
             f"Machine: {cpu_name()} (torch on 1 thread), {seconds / 60:.0f} minutes. FedAvg, small-cnn, "
             f"{args.rounds} rounds of one local epoch, Dirichlet(0.5) split, final test accuracy of the global model "
             f"on the server's held-out set; epsilon at delta={DELTA:g}, record-level, over the {args.rounds} "
             "rounds (for local and distributed DP the largest a hospital's own ledger holds; distributed DP counts "
             "every hospital of the round honest). The noise column is sigma (local: per hospital, std sigma C on "
             "its update) or z (central and distributed: std z C on the sum). C: round 1's median update norm "
             "without DP.", "",
             "| hospitals | C | method | noise | accuracy | epsilon |", "|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        eps = "-" if row["epsilon"] is None else ("inf" if row["epsilon"] == float("inf") else f"{row['epsilon']:.3g}")
        noise = "-" if row["noise"] is None else f"{row['noise']:g}"
        lines.append(f"| {row['hospitals']} | {row['clip']:.3g} | {row['kind']} | {noise} | {row['accuracy']:.3f} | "
                     f"{eps} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
