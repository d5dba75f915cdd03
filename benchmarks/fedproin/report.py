"""The benchmark's outputs, rebuilt from the per-run files: a markdown table in the layout of the
FedProIn paper's Table 1 (methods x {IID, Dir(0.5)} x {Acc, W-F1, MCC}, mean +- std over seeds) and
a plot of test accuracy (and MCC) over rounds per method (mean over seeds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

PARTITION_TITLES = {"iid": "IID", "dirichlet": "Dir(0.5)"}
REFERENCES = ("SOLO", "Centralised")  # trained round(rounds * fraction) rounds: round r is worth r / fraction


def load_runs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def final_test(run: dict[str, Any]) -> dict[str, float]:
    return next(r["test"] for r in reversed(run["history"]) if r.get("test"))


#: evaluated rounds averaged in the second table: at the CPU preset a global model's MCC swings by up to 0.25
#: between evaluated rounds, so the final round's ordering of close methods is largely chance
LATE_ROUNDS = 3


def late_test(run: dict[str, Any], count: int = LATE_ROUNDS) -> dict[str, float]:
    """Test metrics averaged over the run's last ``count`` evaluated rounds (fewer where it has fewer)."""
    tested = [r["test"] for r in run["history"] if r.get("test")][-count:]
    return {key: float(np.mean([t[key] for t in tested])) for key in ("accuracy", "f1_weighted", "mcc")}


def unused_prototypes(run: dict[str, Any]) -> int | None:
    """How many prototypes no aggregated hospital's samples chose in the run's last aggregated round
    (None: the method has no prototype usage)."""
    usage = next((r["method"]["prototype-usage"] for r in reversed(run["history"])
                  if "prototype-usage" in r.get("method", {})), None)
    return None if usage is None else int((np.asarray(usage) == 0).sum())


def mean_std(values: list[float], scale: float, digits: int) -> str:
    if not values:
        return "-"
    array = np.asarray(values) * scale
    text = f"{array.mean():.{digits}f}"
    return f"{text} ± {array.std():.{digits}f}" if len(array) > 1 else text


def table(runs: list[dict[str, Any]], methods: list[str], partitions: list[str], score=final_test) -> str:
    """Accuracy (%), weighted F1 (%) and MCC of ``score`` (default: the final round), mean ± std (population)
    over the seeds run."""
    header = ["method"]
    for partition in partitions:
        title = PARTITION_TITLES.get(partition, partition)
        header += [f"{title} Acc (%)", f"{title} W-F1 (%)", f"{title} MCC"]
    header += ["unused prototypes, last round (" + " / ".join(PARTITION_TITLES.get(p, p) for p in partitions) + ")",
               "seeds", "minutes / run"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for method in methods:
        row = [method]
        seeds: set[int] = set()
        minutes, unused = [], []
        for partition in partitions:
            chosen = [r for r in runs if r["method"] == method and r["partition"] == partition]
            seeds |= {r["seed"] for r in chosen}
            minutes += [r["seconds"] / 60 for r in chosen]
            finals = [score(r) for r in chosen]
            counts = [n for n in map(unused_prototypes, chosen) if n is not None]
            unused.append(f"{np.mean(counts):.1f}" if counts else "-")
            row += [mean_std([f["accuracy"] for f in finals], 100, 1),
                    mean_std([f["f1_weighted"] for f in finals], 100, 1),
                    mean_std([f["mcc"] for f in finals], 1, 3)]
        row += [" / ".join(unused) if any(u != "-" for u in unused) else "-",
                ",".join(str(s) for s in sorted(seeds)) or "-", f"{np.mean(minutes):.1f}" if minutes else "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def curves(runs: list[dict[str, Any]], method: str, partition: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, mean of ``metric`` over seeds) on the federated round scale."""
    chosen = [r for r in runs if r["method"] == method and r["partition"] == partition]
    if not chosen:
        return np.zeros(0), np.zeros(0)
    fraction = float(chosen[0]["config"].get("fraction-train", 1.0))
    per_round: dict[float, list[float]] = {}
    for run in chosen:
        for record in run["history"]:
            if record.get("test"):
                x = record["round"] / fraction if method in REFERENCES else record["round"]
                per_round.setdefault(x, []).append(record["test"][metric])
    rounds = np.array(sorted(per_round))
    return rounds, np.array([np.mean(per_round[x]) for x in rounds])


def plot(runs: list[dict[str, Any]], methods: list[str], partitions: list[str], path: Path, title: str) -> None:
    """Test accuracy (top) and MCC (bottom) over rounds, one column per partition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("accuracy", "test accuracy (%)", 100), ("mcc", "test MCC", 1))
    fig, axes = plt.subplots(len(metrics), len(partitions), figsize=(6 * len(partitions), 8), squeeze=False)
    for column, partition in enumerate(partitions):
        for row, (metric, label, scale) in enumerate(metrics):
            ax = axes[row][column]
            for method in methods:
                rounds, values = curves(runs, method, partition, metric)
                if len(rounds):
                    ax.plot(rounds, scale * values, "--" if method in REFERENCES else "-", marker="o", markersize=3,
                            label=method, linewidth=2.5 if method == "FedProIn" else 1.3)
            ax.set_title(f"{title}: {PARTITION_TITLES.get(partition, partition)}")
            ax.set_xlabel("round (references: equal compute)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def paired_differences(runs: list[dict[str, Any]], method: str, reference: str, partition: str,
                       metric: str) -> list[float]:
    """``method`` minus ``reference`` in the final round, seed by seed (seeds both have run)."""
    finals = {(r["method"], r["seed"]): final_test(r)[metric] for r in runs if r["partition"] == partition}
    return [finals[(method, seed)] - finals[(reference, seed)] for m, seed in sorted(finals)
            if m == method and (reference, seed) in finals]


def ablation_table(runs: list[dict[str, Any]], variants: list[str], partitions: list[str],
                   reference: str = "FedProIn") -> str:
    """Each variant's final W-F1 and MCC, and its difference from ``reference`` on the same seeds: one
    seed's table rows differ by the seed-to-seed spread, a paired difference does not."""
    header = ["variant"]
    for partition in partitions:
        title = PARTITION_TITLES.get(partition, partition)
        header += [f"{title} W-F1 (%)", f"{title} MCC", f"{title} Δ W-F1 (points)", f"{title} Δ MCC", f"{title} seeds"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for variant in variants:
        row = [variant]
        for partition in partitions:
            chosen = [r for r in runs if r["method"] == variant and r["partition"] == partition]
            finals = [final_test(r) for r in chosen]
            row += [mean_std([f["f1_weighted"] for f in finals], 100, 1), mean_std([f["mcc"] for f in finals], 1, 3),
                    mean_std(paired_differences(runs, variant, reference, partition, "f1_weighted"), 100, 1),
                    mean_std(paired_differences(runs, variant, reference, partition, "mcc"), 1, 3),
                    ",".join(str(r["seed"]) for r in sorted(chosen, key=lambda r: r["seed"])) or "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def shift_table(runs: list[dict[str, Any]], before: list[dict[str, Any]], methods: list[str],
                partitions: list[str]) -> str:
    """How far each row moved from ``before`` (the same benchmark on another split or code), run for run: the final
    W-F1 (%) and MCC of the seeds both have, before and now, and the mean ± std of the paired differences."""
    earlier = {(r["method"], r["partition"], r["seed"]): final_test(r) for r in before}
    lines = ["| method | split | seeds | W-F1 before | W-F1 now | Δ W-F1 | MCC before | MCC now | Δ MCC |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method in methods:
        for partition in partitions:
            pairs = [(earlier[(method, partition, r["seed"])], final_test(r)) for r in runs
                     if r["method"] == method and r["partition"] == partition
                     and (method, partition, r["seed"]) in earlier]
            if not pairs:
                continue
            seeds = sorted(r["seed"] for r in runs if r["method"] == method and r["partition"] == partition
                           and (method, partition, r["seed"]) in earlier)
            cells = [method, PARTITION_TITLES.get(partition, partition), ", ".join(map(str, seeds))]
            for metric, scale, digits in (("f1_weighted", 100, 1), ("mcc", 1, 3)):
                cells += [mean_std([b[metric] for b, _ in pairs], scale, digits),
                          mean_std([n[metric] for _, n in pairs], scale, digits),
                          mean_std([n[metric] - b[metric] for b, n in pairs], scale, digits)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(out: Path, methods: list[str], variants: list[str], title: str, default_command: str,
                 before: Path | None = None) -> str:
    """``table.md`` and ``accuracy.png`` from every run in ``out/runs``: the Table-1 rows (``methods``, in that
    order, where run), then FedProIn's ablations and choices (``variants``) against FedProIn on the same seeds, and
    with ``before`` (another result folder of the same benchmark) how far each row moved from it."""
    runs = load_runs(out)
    present = {r["method"] for r in runs}
    partitions = [p for p in PARTITION_TITLES if any(r["partition"] == p for r in runs)]
    rows = [m for m in methods if m in present]
    variant_rows = [v for v in variants if v in present]
    commands = sorted({r.get("command", default_command) for r in runs})
    parts = [f"# FedProIn benchmark: {title}", "", "Made by (a rerun skips the runs already in `runs/`):", "",
             *[f"    {c}" for c in commands], "",
             "Final-round test metrics of the global model (SOLO and FedProto: mean over the hospitals' own "
             "models), mean ± std over seeds.", "", table(runs, rows, partitions), "",
             f"The same runs, each scored by the mean of its last {LATE_ROUNDS} evaluated rounds (fewer where a run "
             "has fewer: SOLO is scored once, FedProto twice). A global model's MCC swings by up to 0.25 between "
             "evaluated rounds at the CPU preset, so this ordering is the steadier one.", "",
             table(runs, rows, partitions, score=late_test), ""]
    if variant_rows:
        parts += ["## FedProIn's ablations and choices", "",
                  "One change each from FedProIn's defaults (`benchmarks/fedproin/run.py` `ABLATIONS`); Δ is the "
                  "variant minus FedProIn on the same seeds and split, mean ± std over those seeds.", "",
                  ablation_table(runs, variant_rows, partitions), ""]
    if before is not None:
        parts += [f"## Against `{before.name}`", "", f"The same rows in `{before}`, seed for seed (final round).", "",
                  shift_table(runs, load_runs(before), rows + variant_rows, partitions), ""]
    parts += ["![accuracy and MCC over rounds](accuracy.png)", ""]
    text = "\n".join(parts)
    (out / "table.md").write_text(text)
    plot(runs, rows, partitions, out / "accuracy.png", title)
    return text
