"""What each way of coding a QFedPolyp update keeps of it, per bit on the wire: why 1-bit signs at 64x trail 32 bits.

    python -m benchmarks.qfedpolyp.frontier --rounds 5 --seed 42 \
        --out benchmarks/results/qfedpolyp_codec_frontier.md

Runs the ``cpu`` preset with 32-bit updates (``quantise='update'``: each hospital's exact change of the weights) for
``--rounds`` rounds in one process and keeps what every hospital sent. Each round's updates are then coded with each
configuration by the codecs hospitals use (``encode_sparse``, ``encode_model``), decoded, and compared with the
updates, rounds 2 on (round 1 starts from random weights):

- bits per parameter: the encoded arrays' bytes x 8 / the weights' entries (Flower's framing and the BatchNorm
  statistics, which travel beside, not counted);
- kept, own: 1 - |u - D(u)|^2 / |u|^2 for a hospital's update u (mean over hospitals);
- kept, mean: the same for what the server adds up, the mean of the decoded updates against the mean of the updates:
  what one round's step carries; error feedback sends the rest in later rounds, which is where a compressed run
  falls behind.

And the updates themselves: how much of a hospital's update is shared with the others (|mean u|^2 / mean |u_i|^2)
and how alike a hospital's consecutive updates are (cosine), which says whether predicting an update from the last
round could save bits.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.qfedpolyp.table1 import NUM_HOSPITALS, PRESETS, PROTOCOL, job_config
from common.engine.inprocess import run_rounds, simulated_sites
from common.quantization.codec import decode_model, encode_model
from common.quantization.low_rank import decode_low_rank, encode_low_rank
from common.quantization.sparse import decode_sparse, encode_sparse
from strategies.qfedpolyp.messages import PACKED

ROOT = Path(__file__).resolve().parents[2]
#: bit-width[/top<p>[/block<B>]]: signs at the 64x rows' sparsity and a few neighbours at about the same bits, the
#: 32x rows (2 bits, and dense signs), floats of the same blocks (what the positions alone keep), and low-rank factors
#: at the 64x and 32x budgets
CONFIGS = ("1/top0.3/block8", "1/top0.4/block16", "1/top0.25/block4", "1/top0.35/block8", "2/top0.2/block8",
           "2/top0.35/block8", "1", "32/top0.3/block8", "8/rank0.45", "6/rank0.45", "4/rank0.45", "8/rank0.9")
log = logging.getLogger("fedmed")

Updates = dict[int, dict[str, dict[str, np.ndarray]]]  # round -> hospital -> tensor -> change


def parse(config: str) -> tuple[int, float, int, float]:
    """``'1/top0.3/block8'`` -> (bits 1, sparsity 0.3, block 8, no low rank); ``'2'`` -> (2, 1.0, 1, 0.0);
    ``'8/rank0.45'`` -> (8, 1.0, 1, 0.45): low-rank factors at 8 bits taking at most 0.45 bits per entry."""
    bits, *options = config.split("/")
    sparsity, block, rank_bits = 1.0, 1, 0.0
    for option in options:
        if option.startswith("top"):
            sparsity = float(option[3:])
        elif option.startswith("block"):
            block = int(option[5:])
        elif option.startswith("rank"):
            rank_bits = float(option[4:])
        else:
            raise SystemExit(f"configuration {config!r}: unknown option {option!r} (top<p>, block<B>, rank<x>)")
    return int(bits), sparsity, block, rank_bits


def record_updates(seed: int, rounds: int, data_dir: str, out: Path) -> tuple[Updates, list[float]]:
    """Every hospital's exact update of each round of a 32-bit run (cpu preset), and the run's test Dice."""
    base = {**PROTOCOL, **PRESETS["cpu"], "seed": seed, "num_server_rounds": rounds, "data_dir": data_dir}
    cfg = job_config(base, "32,32,32,32,32/update", out)
    updates: Updates = {}

    def keep(rnd: int, hospital: str, _downlink, reply) -> None:
        updates.setdefault(rnd, {})[hospital] = decode_model(reply.arrays[PACKED], expected_bits=32,
                                                             expected_content="update")

    engine = run_rounds(cfg, simulated_sites(cfg, NUM_HOSPITALS, device="cpu"), on_reply=keep)
    return updates, [float(h["test"].get("dice", float("nan"))) for h in engine.history]


def coded(update: dict[str, np.ndarray], bits: int, sparsity: float, block: int,
          rank_bits: float) -> tuple[dict[str, np.ndarray], int]:
    """(what the receiver decodes, bytes of the encoded arrays) of one update."""
    if rank_bits:
        encoded = encode_low_rank(update, bits, rank_bits)
        decoded = decode_low_rank(encoded, update, bits, rank_bits)
    elif sparsity < 1.0:
        encoded = encode_sparse(update, bits, sparsity, "top-k", content="update", block=block)
        decoded = decode_sparse(encoded, reference=update)
    else:
        encoded = encode_model(update, bits, content="update")
        decoded = decode_model(encoded, reference=update)
    return decoded, sum(int(a.nbytes) for a in encoded.values())


def flat(arrays: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in arrays.values()])


def kept(original: np.ndarray, decoded: np.ndarray) -> float:
    """1 - |original - decoded|^2 / |original|^2: the share of the update's energy the code keeps."""
    return float(1.0 - np.square(original - decoded).sum() / np.square(original).sum())


def measure(updates: Updates, configs: list[str]) -> list[dict[str, Any]]:
    """Per configuration, the means over rounds 2.. of bits per parameter, kept (own) and kept (mean)."""
    rounds = sorted(updates)[1:]
    rows = []
    for config in configs:
        bits, sparsity, block, rank_bits = parse(config)
        per_round = []
        for rnd in rounds:
            hospitals = sorted(updates[rnd])
            originals = [flat(updates[rnd][h]) for h in hospitals]
            results = [coded(updates[rnd][h], bits, sparsity, block, rank_bits) for h in hospitals]
            decodeds = [flat(d) for d, _ in results]
            per_round.append((np.mean([8 * n / o.size for (_, n), o in zip(results, originals)]),
                              np.mean([kept(o, d) for o, d in zip(originals, decodeds)]),
                              kept(np.mean(originals, axis=0), np.mean(decodeds, axis=0))))
        bits_per, own, mean = np.mean(per_round, axis=0)
        rows.append({"config": config, "bits-per-parameter": float(bits_per), "kept-own": float(own),
                     "kept-mean": float(mean)})
        log.info("%s: %.3f bits/parameter, kept %.3f own, %.3f of the mean", config, bits_per, own, mean)
    return rows


def structure(updates: Updates) -> list[dict[str, float]]:
    """Per round: the share of a hospital's update that is shared (|mean|^2 / mean |u_i|^2) and the mean cosine of
    each hospital's update with its previous one."""
    rows, previous = [], None
    for rnd in sorted(updates):
        current = {h: flat(u) for h, u in updates[rnd].items()}
        mean = np.mean(list(current.values()), axis=0)
        row = {"round": rnd, "shared": float(np.square(mean).sum() / np.mean([np.square(u).sum()
                                                                            for u in current.values()]))}
        if previous is not None:
            row["cosine-with-last"] = float(np.mean([
                u @ previous[h] / np.linalg.norm(u) / np.linalg.norm(previous[h])
                for h, u in current.items() if h in previous]))
        rows.append(row)
        previous = current
    return rows


def table(rows: list[dict[str, Any]], shape: list[dict[str, float]], dice: list[float], args: argparse.Namespace,
          cpu: str) -> str:
    lines = ["# QFedPolyp: what each code keeps of an update, per bit", "",
             "Command: `python -m benchmarks.qfedpolyp.frontier " + " ".join(sys.argv[1:]) + "`", "",
             f"cpu preset, seed {args.seed}, {args.rounds} rounds at 32-bit updates ({NUM_HOSPITALS} hospitals; test "
             f"Dice by round {', '.join(f'{d:.3f}' for d in dice)}); every round's updates from round 2 on coded "
             f"by each configuration and decoded. CPU: {cpu}.", "",
             "| configuration | bits/parameter | kept, a hospital's update | kept, the mean the server adds |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['config']} | {r['bits-per-parameter']:.3f} | {r['kept-own']:.3f} | {r['kept-mean']:.3f} |"
              for r in rows]
    lines += ["", "Bits per parameter: the encoded arrays (header, ranges, data) x 8 / the weights' entries, without "
              "Flower's framing and the BatchNorm statistics (about 0.05 more at 8-bit statistics). Kept: "
              "1 - |u - D(u)|^2 / |u|^2, mean over rounds.", "",
              "| round | shared share of an update, abs(mean u)^2 / mean abs(u_i)^2 | cosine with the hospital's "
              "previous update |", "|---:|---:|---:|"]
    lines += [f"| {r['round']} | {r['shared']:.3f} | "
              f"{r['cosine-with-last']:.3f} |" if "cosine-with-last" in r else
              f"| {r['round']} | {r['shared']:.3f} | |" for r in shape]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--data-dir", default=PROTOCOL["data_dir"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "frontier")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "qfedpolyp_codec_frontier.md")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (round 1 is left out)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    for config in args.configs:
        parse(config)
    from common.machine import cpu_name

    updates, dice = record_updates(args.seed, args.rounds, args.data_dir, args.work / f"seed{args.seed}")
    text = table(measure(updates, args.configs), structure(updates), dice, args, cpu_name())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
