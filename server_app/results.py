"""What a run leaves for people to look at, in ``results/<run-name>/``.

``config.json`` (the resolved config), ``metrics.jsonl`` (one JSON record per round: hospitals
chosen, aggregated, missing and refused, bytes each way per hospital, training and test
metrics), ``summary.md`` (a markdown table) and ``plots/*.png`` (metrics and traffic over
rounds). All are rewritten from the full history after every round, atomically, so a resumed run
continues the same files.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

SKIP_IN_TABLES = ("num-examples", "hd95_undefined")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    os.replace(partial, path)


def headline_metrics(history: list[dict[str, Any]]) -> list[str]:
    """Overall test metrics (no per-source or per-region breakdowns), in first-seen order."""
    names: list[str] = []
    for record in history:
        for key, value in record.get("test", {}).items():
            if "/" not in key and key not in SKIP_IN_TABLES and isinstance(value, (int, float)) and key not in names:
                names.append(key)
    return names


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def summary_table(history: list[dict[str, Any]]) -> str:
    """Markdown table, one row per round."""
    metrics = headline_metrics(history)
    header = ["round", "hospitals", *metrics, "up MB", "down MB", "seconds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in history:
        test = record.get("test", {})
        hospitals = f"{len(record['aggregated'])}/{len(record['chosen'])}"
        row = [str(record["round"]), hospitals, *[_fmt(test[m]) if m in test else "" for m in metrics],
               f"{record['bytes_up'] / 1e6:.2f}", f"{record['bytes_down'] / 1e6:.2f}", f"{record['seconds']:.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render_summary(config: dict[str, Any], history: list[dict[str, Any]]) -> str:
    last_test = next((r["test"] for r in reversed(history) if "test" in r), {})
    text = [f"# {config.get('run-name')}", "",
            f"task `{config.get('task')}`, strategy `{config.get('strategy')}`, data `{config.get('dataset')}`, "
            f"seed {config.get('seed')}, {len(history)} of {config.get('num-server-rounds')} rounds", "",
            summary_table(history), ""]
    if last_test:
        text += ["## Final test metrics", "", "| metric | value |", "|---|---|"]
        text += [f"| {k} | {_fmt(v)} |" for k, v in last_test.items()]
        text.append("")
    trouble = [(r["round"], r.get("missing", []), r.get("refused", {})) for r in history
               if r.get("missing") or r.get("refused")]
    if trouble:
        text += ["## Hospitals missing or refused", "", "| round | missing | refused (reason) |", "|---|---|---|"]
        text += [f"| {rnd} | {', '.join(missing)} | {'; '.join(f'{k}: {v}' for k, v in refused.items())} |"
                 for rnd, missing, refused in trouble]
        text.append("")
    return "\n".join(text)


def plot_history(history: list[dict[str, Any]], folder: Path) -> list[Path]:
    """PNG plots of the test metrics and of the traffic over rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    metrics = headline_metrics(history)
    if metrics:
        fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3), squeeze=False)
        for ax, metric in zip(axes[0], metrics):
            points = [(r["round"], r["test"][metric]) for r in history if metric in r.get("test", {})]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
            ax.set_title(metric)
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, folder / "test_metrics.png"))
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3))
    rounds = [r["round"] for r in history]
    ax.plot(rounds, [r["bytes_up"] / 1e6 for r in history], marker="o", label="to server (up)")
    ax.plot(rounds, [r["bytes_down"] / 1e6 for r in history], marker="s", label="to hospitals (down)")
    ax.set_xlabel("round")
    ax.set_ylabel("MB per round")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, folder / "traffic.png"))
    plt.close(fig)
    return written


def _save(fig, path: Path) -> Path:
    partial = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    fig.savefig(partial, dpi=110)
    os.replace(partial, path)
    return path


def write_results(run_dir: Path, config: dict[str, Any], history: list[dict[str, Any]], plots: bool = True) -> None:
    run_dir = Path(run_dir)
    _write(run_dir / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write(run_dir / "metrics.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in history))
    _write(run_dir / "summary.md", render_summary(config, history))
    if plots and history:
        plot_history(history, run_dir / "plots")


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
