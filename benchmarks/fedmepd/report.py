"""The FedMEPD benchmark's report: the paper's table (mean Dice of WT, TC and ET for each hospital,
their average and the server), Dice per region with HD95, cost, and the scores over rounds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

MODALITY_NAMES = {"flair": "FLAIR", "t1ce": "T1c", "t1": "T1", "t2": "T2"}
#: The paper's BraTS 2018 test scores (mDSC %) for the hospital kinds the CPU benchmark has, their
#: average over all 8 hospitals, and the server.
PAPER = {"Local": {"T1c": 42.37, "T2": 48.13, "FLAIR+T1c": 87.74, "T1+T2": 64.93, "average": 66.95, "server": 82.56},
         "FedAvg": {"T1c": 18.46, "T2": 42.12, "FLAIR+T1c": 82.11, "T1+T2": 59.59, "average": 59.04, "server": 80.10},
         "FedMEPD": {"T1c": 58.87, "T2": 59.35, "FLAIR+T1c": 93.73, "T1+T2": 75.83, "average": 75.70, "server": 84.98}}


def modality_label(modalities: str) -> str:
    return "+".join(MODALITY_NAMES[m] for m in modalities.split(","))


def cell(values: list[float], scale: float = 100.0) -> str:
    """Mean (and spread over seeds) of finite values, as the paper prints them."""
    values = [v * scale for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    return f"{np.mean(values):.2f}" + (f" ± {np.std(values):.2f}" if len(values) > 1 else "")


def load_runs(out: Path, names: list[str], seeds: list[int]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((out / "runs").glob("*.json")):
        record = json.loads(path.read_text())
        if record["method"] in names and record["seed"] in seeds:
            runs.setdefault(record["method"], []).append(record)
    return {name: runs[name] for name in names if name in runs}


def hospital_mean(record: dict[str, Any], key: str) -> float:
    return float(np.nanmean([m[key] for m in record["final"].values()]))


def write_report(out: Path, names: list[str], seeds: list[int], title: str, command: str) -> Path:
    runs = load_runs(out, names, seeds)
    if not runs:
        raise SystemExit(f"{out}/runs holds no finished runs of {names}")
    first = next(iter(runs.values()))[0]
    hospitals = first["hospitals"]
    config = first["config"]
    heads = [f"{h} ({modality_label(m)})" for h, m in hospitals.items()]
    volumes = ("generated volumes of " + f"{config['brain.synthetic-size']}^3" if config["dataset"] == "synthetic"
               else f"volumes downsampled {config['brain.downsample']}x")
    text = [f"# FedMEPD and its baselines ({title})", "", f"`{command}`", "",
            f"{len(first['test-cases'])} test cases ({', '.join(first['test-cases'])}), the server trains on its own "
            f"full-modality cases, hospitals: " + "; ".join(f"{h} {modality_label(m)} ({', '.join(first['cases'][h])})"
                                                         for h, m in hospitals.items()) + ".",
            f"{config['num-server-rounds']} rounds, crops {config['brain.crop-size']}^3 of {volumes}, "
            f"channels {config['brain.widths']}, lr {config['learning-rate']}, "
            f"batch {config['batch-size']}, {config['brain.crops-per-case']} crops per case per epoch; "
            f"seeds {', '.join(map(str, seeds))}.", "",
            "## Mean Dice of WT, TC and ET (%), each hospital's final model on its own modalities", "",
            "| method | " + " | ".join(heads) + " | hospital average | server |", "|---" * (len(heads) + 3) + "|"]
    for name, records in runs.items():
        row = [cell([r["final"][h]["dice_mean"] for r in records]) for h in hospitals]
        row += [cell([hospital_mean(r, "dice_mean") for r in records]),
                cell([r["server"].get("dice_mean") for r in records])]
        text.append(f"| {name} | " + " | ".join(row) + " |")
    text += ["", "## Per region: Dice (%) and HD95 (voxels)", "",
             "| method | hospitals WT | TC | ET | HD95 | server WT | TC | ET | HD95 |", "|---" * 9 + "|"]
    for name, records in runs.items():
        row = [cell([hospital_mean(r, f"dice_{k}") for r in records]) for k in ("WT", "TC", "ET")]
        row.append(cell([hospital_mean(r, "hd95_mean") for r in records], 1.0))
        row += [cell([r["server"].get(f"dice_{k}") for r in records]) for k in ("WT", "TC", "ET")]
        row.append(cell([r["server"].get("hd95_mean") for r in records], 1.0))
        text.append(f"| {name} | " + " | ".join(row) + " |")
    text += ["", "## Cost", "",
             "| method | minutes | MB up per round | MB down per round | personal decoder filters at the end |",
             "|---|---|---|---|---|"]
    for name, records in runs.items():
        last = [r["history"][-1] for r in records]
        personal = [np.mean(list(rec["personalised"].values())) for rec in last if rec["personalised"]]
        text.append(f"| {name} | {np.mean([r['seconds'] for r in records]) / 60:.1f} | "
                    f"{np.mean([h['bytes_up'] for r in records for h in r['history']]) / 1e6:.2f} | "
                    f"{np.mean([h['bytes_down'] for r in records for h in r['history']]) / 1e6:.2f} | "
                    f"{cell(personal) + ' %' if personal else '-'} |")
    text += paired_comparison(runs, seeds) + personalisation_over_rounds(runs, hospitals)
    kinds = [modality_label(m) for m in hospitals.values()]
    if all(k in PAPER["FedMEPD"] for k in kinds):
        text += ["", "## The paper's BraTS 2018 test scores for the same hospital kinds "
                 "(mDSC %, 285 cases, 1000 rounds)", "",
                 "| method | " + " | ".join(kinds) + " | average of its 8 hospitals | server |",
                 "|---" * (len(kinds) + 3) + "|"]
        text += [f"| {name} | " + " | ".join(f"{scores[k]:.2f}" for k in kinds) +
                 f" | {scores['average']:.2f} | {scores['server']:.2f} |" for name, scores in PAPER.items()]
    plot_rounds(runs, out / "rounds.png")
    text += ["", "![scores over rounds](rounds.png)", ""]
    target = out / "report.md"
    target.write_text("\n".join(text))
    return target


def paired_comparison(runs: dict[str, list[dict[str, Any]]], seeds: list[int]) -> list[str]:
    """Hospital average per seed for every row, and each row's paired difference to FedMEPD's (same seed: same split,
    same cases, same start), so that "beyond the seed spread" is a statement about the differences."""
    by_seed = {name: {r["seed"]: hospital_mean(r, "dice_mean") for r in records} for name, records in runs.items()}
    shown = [s for s in seeds if any(s in v for v in by_seed.values())]
    lines = ["", "## Hospital average per seed (mean Dice %), and the paired difference to FedMEPD", "",
             "| method | " + " | ".join(f"seed {s}" for s in shown) + " | FedMEPD minus it, per seed | "
             "mean ± std of the differences | FedMEPD ahead on |", "|---" * (len(shown) + 4) + "|"]
    reference = by_seed.get("FedMEPD", {})
    for name, values in by_seed.items():
        cells = [f"{values[s] * 100:.2f}" if s in values else "-" for s in shown]
        paired = [reference[s] - values[s] for s in shown if s in values and s in reference]
        if name == "FedMEPD" or not paired:
            lines.append(f"| {name} | " + " | ".join(cells) + " | - | - | - |")
            continue
        spread = f" ± {np.std(paired) * 100:.2f}" if len(paired) > 1 else ""
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + ", ".join(f"{d * 100:+.2f}" for d in paired)
                     + f" | {np.mean(paired) * 100:+.2f}{spread} | {sum(d > 0 for d in paired)} of {len(paired)} |")
    return lines


def personalisation_over_rounds(runs: dict[str, list[dict[str, Any]]], hospitals: dict[str, str]) -> list[str]:
    """FedMEPD's share of personal decoder filters per hospital kind over the rounds (mean over seeds)."""
    records = runs.get("FedMEPD", [])
    if not records:
        return []
    names = list(hospitals)
    rounds = [h["round"] for h in records[0]["history"]]
    lines = ["", "## FedMEPD: share of personal decoder filters over rounds (%, mean over seeds)", "",
             "| round | " + " | ".join(f"{h} ({modality_label(m)})" for h, m in hospitals.items()) + " |",
             "|---" * (len(names) + 1) + "|"]
    step = max(1, len(rounds) // 10)
    for index in list(range(0, len(rounds), step)) + ([len(rounds) - 1] if (len(rounds) - 1) % step else []):
        cells = []
        for position, _ in enumerate(names):
            values = []
            for record in records:
                shares = record["history"][index]["personalised"]
                ordered = [shares[h] for h in sorted(shares)]
                if position < len(ordered):
                    values.append(ordered[position])
            cells.append(f"{np.mean(values) * 100:.1f}" if values else "-")
        lines.append(f"| {rounds[index]} | " + " | ".join(cells) + " |")
    return lines


def plot_rounds(runs: dict[str, list[dict[str, Any]]], target: Path) -> None:
    """Hospital average and server mean Dice at each evaluation round, per method (first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for name, records in runs.items():
        history = records[0]["history"]
        for ax, key in zip(axes, ("hospital-average", "test")):
            points = [(h["round"], h[key]["dice_mean"]) for h in history if "dice_mean" in h.get(key, {})]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    for ax, title in zip(axes, ("hospital average (own modalities)", "server (all modalities)")):
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean Dice of WT, TC, ET")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
