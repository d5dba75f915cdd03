"""What a run leaves for people to look at, in ``results/<run-name>/``.

``config.json`` (the resolved config), ``metrics.jsonl`` (one JSON record per round: hospitals
chosen, aggregated, missing and refused, bytes each way per hospital, training and test
metrics, seconds, and ``identity-seconds`` spent finding new hospitals before it), ``summary.md``
(a markdown table) and ``plots/*.png`` (metrics and traffic over rounds; for FedMEPD the share of
personal decoder filters per layer and hospital). All are
rewritten from the full history after every round, atomically, so a resumed run continues the
same files. ``metrics.jsonl`` is strict JSON: a metric that is NaN or infinite is written as ``null``
(read back as ``None``; tables show it as ``n/a``, plots leave a gap).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

SKIP_IN_TABLES = ("num-examples", "hd95_undefined")


def _write(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all: a write that fails (disk full, folder made read-only) leaves the
    previous file as it was and no partial file beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise


def finite_or_none(value: Any) -> Any:
    """``value`` with every float that is NaN or infinite replaced by None, in nested dicts, lists and tuples: what
    strict JSON can carry (Python's json would write ``NaN``/``Infinity``, which other readers refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """JSON that any reader takes: NaN and infinities as ``null`` (``allow_nan=False`` checks nothing slipped)."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


def headline_metrics(history: list[dict[str, Any]]) -> list[str]:
    """Overall test metrics (no per-source or per-region breakdowns), in first-seen order."""
    names: list[str] = []
    for record in history:
        for key, value in record.get("test", {}).items():
            numeric = value is None or isinstance(value, (int, float))  # None: NaN or inf, read back from the file
            if "/" not in key and key not in SKIP_IN_TABLES and numeric and key not in names:
                names.append(key)
    return names


def _fmt(value: Any) -> str:
    if value is None:  # a NaN or infinite metric, as metrics.jsonl holds it
        return "n/a"
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
            ax.plot([p[0] for p in points], [math.nan if p[1] is None else p[1] for p in points], marker="o")
            ax.set_title(metric)
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, folder / "test_metrics.png"))
        plt.close(fig)
    personalised = personal_filter_fractions(history)
    if personalised:
        written.append(plot_personalised(plt, personalised, folder / "personalised.png"))
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


def personal_filter_fractions(history: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """FedMEPD: hospital -> decoder layer (and 'all') -> (round, share of its filters that are personal)."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for record in history:
        for hospital, layers in record.get("method", {}).get("personalised", {}).items():
            for layer, fraction in layers.items():
                series.setdefault(hospital, {}).setdefault(layer, []).append(
                    (record["round"], math.nan if fraction is None else fraction))
    return series


def plot_personalised(plt, series: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> Path:
    """One panel per hospital: the share of personal filters per decoder layer over rounds ('all' in black)."""
    hospitals = sorted(series)
    columns = min(4, len(hospitals))
    rows = -(-len(hospitals) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 2.8 * rows), squeeze=False, sharey=True)
    for ax, hospital in zip(axes.ravel(), hospitals):
        for layer, points in sorted(series[hospital].items()):
            style = {"color": "black", "linewidth": 2.0, "label": "all"} if layer == "all" else \
                {"linewidth": 0.8, "alpha": 0.6, "label": layer.removeprefix("decoder.")}
            ax.plot([p[0] for p in points], [p[1] for p in points], **style)
        ax.set_title(hospital)
        ax.set_xlabel("round")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(hospitals):]:
        ax.axis("off")
    axes[0][0].set_ylabel("personal filters")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if len(labels) <= 12:
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=6)
        fig.subplots_adjust(bottom=0.25)
    fig.tight_layout(rect=(0, 0.12 if len(labels) <= 12 else 0, 1, 1))
    saved = _save(fig, path)
    plt.close(fig)
    return saved


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(partial, dpi=110)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise
    return path


def write_results(run_dir: Path, config: dict[str, Any], history: list[dict[str, Any]], plots: bool = True) -> None:
    run_dir = Path(run_dir)
    _write(run_dir / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write(run_dir / "metrics.jsonl", "".join(strict_json(r, sort_keys=True) + "\n" for r in history))
    _write(run_dir / "summary.md", render_summary(config, history))
    if plots and history:
        plot_history(history, run_dir / "plots")


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The round records of ``metrics.jsonl`` (a NaN or infinite metric is None; a file written before they were
    written as null, holding ``NaN``, still reads)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
