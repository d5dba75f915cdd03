"""Uplink to reach 32 bits' Dice: compressed rows trail 32 bits by a few rounds (docs/qfedpolyp.md, "Past 64x"), so
besides the Dice at equal rounds, how many rounds, and how many bytes, does a row need to reach what 32 bits reaches?

    python -m benchmarks.qfedpolyp.table1 --preset cpu --set num_server_rounds=30 --configs 32,32,32,32,32 ... --out q
    python -m benchmarks.qfedpolyp.to_target q/runs/32-32-32-32-32 q/runs/<row> ... --at 20 --table target.md

Target: the 32-bit run's mean test Dice over its rounds ``at - 4 .. at`` (the last 5 rounds of the preset). A row
reaches it at the first round whose mean over that round and the 4 before is at least the target; its uplink until
then is its serialised reply messages of one round (``uplink_bytes`` in the ``table1.json`` beside the run folder, as
Table 1 counts them) times those rounds, against the 32-bit run's until round ``at``. The gap at a row's last round:
the 32-bit run's mean Dice over the same 5 rounds minus the row's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.qfedpolyp.table1 import run_name
from server_app.results import read_history

WINDOW = 5


def curve(run: Path) -> np.ndarray:
    """Test Dice by round of one run folder; ValueError naming the folder where a round lacks it."""
    rounds = [r for r in read_history(run) if "round" in r]
    if not rounds:
        raise ValueError(f"{run}: metrics.jsonl holds no rounds")
    missing = [r["round"] for r in rounds if (r.get("test") or {}).get("dice") is None]
    if missing:
        raise ValueError(f"{run}: rounds {missing} have no test Dice")
    return np.array([r["test"]["dice"] for r in rounds])


def uplink_per_round(run: Path) -> int:
    """The run's serialised reply messages of one round, all hospitals, from ``table1.json`` two folders up."""
    table = run.parent.parent / "table1.json"
    if not table.exists():
        raise ValueError(f"{run}: no {table} (this reads run folders of benchmarks.qfedpolyp.table1's output)")
    for row in json.loads(table.read_text()):
        if run_name(row["config"]) == run.name:
            return int(row["uplink_bytes"])
    raise ValueError(f"{table} has no row for the run {run.name}")


def target(dice: np.ndarray, at: int) -> float:
    """The mean test Dice over rounds ``at - 4 .. at``."""
    if len(dice) < at or at < WINDOW:
        raise ValueError(f"the 32-bit run has {len(dice)} rounds; --at {at} needs at least {max(at, WINDOW)}")
    return float(dice[at - WINDOW:at].mean())


def first_round_reaching(dice: np.ndarray, goal: float) -> int | None:
    """The first round (1-based) whose mean test Dice over it and the 4 rounds before is at least ``goal``."""
    means = np.convolve(dice, np.ones(WINDOW) / WINDOW, mode="valid")
    reached = np.flatnonzero(means >= goal)
    return int(reached[0]) + WINDOW if reached.size else None


def rows(reference: Path, others: list[Path], at: int) -> list[dict]:
    dice, per_round = curve(reference), uplink_per_round(reference)
    goal = target(dice, at)
    out = []
    for run in others:
        row_dice, row_per_round = curve(run), uplink_per_round(run)
        reached = first_round_reaching(row_dice, goal)
        out.append({"run": run.name, "rounds": len(row_dice), "target": goal, "reached": reached,
                    "uplink_ratio_per_round": per_round / row_per_round,
                    "uplink_ratio_to_target": per_round * at / (row_per_round * reached) if reached else None,
                    "dice_at": float(row_dice[at - WINDOW:at].mean()) if len(row_dice) >= at else None,
                    "gap_last": (float(dice[len(row_dice) - WINDOW:len(row_dice)].mean() - row_dice[-WINDOW:].mean())
                                 if len(dice) >= len(row_dice) >= WINDOW else None)})
    return out


def render(reference: Path, table: list[dict], at: int, command: str) -> str:
    goal = table[0]["target"] if table else float("nan")
    lines = ["# QFedPolyp: uplink to reach 32 bits' Dice", "", f"Command: `{command}`", "",
             f"Target: the 32-bit run's ({reference.name}) mean test Dice over rounds {at - WINDOW + 1}-{at}: "
             f"{goal:.3f}. Reached: the first round whose mean over it and the {WINDOW - 1} rounds before is at "
             f"least the target. Uplink: all hospitals' serialised reply messages until then, against the 32-bit run's "
             f"until round {at}.", "",
             f"| run | mean Dice, rounds {at - WINDOW + 1}-{at} | rounds run | reaches the target at round "
             "| uplink per round vs 32-bit | uplink to the target vs 32-bit | gap to 32 bits, its last 5 rounds |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        reached = str(row["reached"]) if row["reached"] else f"not by round {row['rounds']}"
        to_target = f"{row['uplink_ratio_to_target']:.1f}x" if row["uplink_ratio_to_target"] else "-"
        at_dice = f"{row['dice_at']:.3f}" if row["dice_at"] is not None else "-"
        gap = f"{row['gap_last']:+.3f}" if row["gap_last"] is not None else "-"
        lines.append(f"| {row['run']} | {at_dice} | {row['rounds']} | {reached} | "
                     f"{row['uplink_ratio_per_round']:.1f}x | {to_target} | {gap} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path, help="the 32-bit run folder (metrics.jsonl)")
    parser.add_argument("runs", type=Path, nargs="+", help="compressed rows' run folders")
    parser.add_argument("--at", type=int, default=20, help="the round whose last-5 mean is the target (default 20)")
    parser.add_argument("--table", type=Path, help="write the Markdown table here")
    args = parser.parse_args(argv)
    try:
        table = rows(args.reference, args.runs, args.at)
    except (ValueError, OSError) as error:
        raise SystemExit(str(error)) from None
    command = "python -m benchmarks.qfedpolyp.to_target " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(args.reference, table, args.at, command)
    if args.table:
        args.table.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
