"""What a run leaves for people to look at, in ``results/<run-name>/``.

``config.json`` (the resolved config), ``metrics.jsonl`` (one JSON record per round: hospitals
chosen, aggregated, missing and refused, bytes each way per hospital, training and test
metrics, seconds, and ``identity-seconds`` spent finding new hospitals before it), ``summary.md``
(a markdown table) and ``plots/*.png`` (test metrics and traffic over rounds, with each QFedPolyp hospital's
uplink at its bit-width; each hospital's validation curves beside the global test curve; for FedProIn each
hospital's share of every class's prototype influence as a heatmap over rounds; for FedMEPD the share of
personal decoder filters per layer and hospital). All are
rewritten from the full history after every round, atomically, so a resumed run continues the
same files. ``metrics.jsonl`` is strict JSON: a metric that is NaN or infinite is written as ``null``
(read back as ``None``; tables show it as ``n/a``, plots leave a gap).

``status.json`` says whether the run is running (which process, last heartbeat), completed, stopped or failed;
``fedmed runs`` reads it with the other files into a table of a results folder's runs (:func:`list_runs`).
Metrics of the round records are named ``<table>.<key>`` (``test.dice``, ``train.val-accuracy``): what
``select-by`` and ``fedmed runs --metric`` take (:func:`parse_selection`, :func:`record_value`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

SKIP_IN_TABLES = ("num-examples", "hd95_undefined")
#: each task's headline test metric (what ``fedmed runs`` shows unless the run selects by another)
HEADLINE = {"classification": "accuracy", "polyp-segmentation": "dice", "brain-tumour-segmentation": "dice_mean"}
STATUS_FILE = "status.json"


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
        hospitals = f"{len(aggregated_in(record))}/{len(record['chosen'])}"
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
    if config.get("select-by"):
        direction, path = parse_selection(str(config["select-by"]))
        best = best_round(history, f"{direction}:{path}")
        text += [f"## Best round by {path} ({direction})", "",
                 f"round {best[0]}: {_fmt(best[1])} (its model: checkpoints/best.npz)" if best else
                 "no round recorded it yet", ""]
    trouble = [(r["round"], r.get("missing", []), r.get("refused", {})) for r in history
               if r.get("missing") or r.get("refused")]
    if trouble:
        text += ["## Hospitals missing or refused", "", "| round | missing | refused (reason) |", "|---|---|---|"]
        text += [f"| {rnd} | {', '.join(missing)} | {'; '.join(f'{k}: {v}' for k, v in refused.items())} |"
                 for rnd, missing, refused in trouble]
        text.append("")
    return "\n".join(text)


def plot_history(history: list[dict[str, Any]], folder: Path, class_names: list[str] | None = None) -> list[Path]:
    """PNG plots of the test metrics and of the traffic over rounds (with QFedPolyp's bit-widths), each hospital's
    validation curves beside the global test curve, and the method's state (FedProIn's influence, FedMEPD's
    personal filters)."""
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
    curves = hospital_validation_curves(history)
    if curves:
        written.append(plot_hospital_curves(plt, curves, folder / "hospitals.png"))
    personalised = personal_filter_fractions(history)
    if personalised:
        written.append(plot_personalised(plt, personalised, folder / "personalised.png"))
    influence = influence_shares(history)
    if influence:
        written.append(plot_influence(plt, influence, folder / "influence.png", class_names))
    bits = bit_width_traffic(history)
    fig, axes = plt.subplots(1, 2 if bits else 1, figsize=(10 if bits else 5, 3), squeeze=False)
    ax = axes[0][0]
    rounds = [r["round"] for r in history]
    ax.plot(rounds, [r["bytes_up"] / 1e6 for r in history], marker="o", label="to server (up)")
    ax.plot(rounds, [r["bytes_down"] / 1e6 for r in history], marker="s", label="to hospitals (down)")
    ax.set_xlabel("round")
    ax.set_ylabel("MB per round")
    ax.legend()
    ax.grid(alpha=0.3)
    if bits:
        plot_bit_width_traffic(axes[0][1], bits)
    fig.tight_layout()
    written.append(_save(fig, folder / "traffic.png"))
    plt.close(fig)
    return written


# --- each hospital's validation curves beside the global test curve -------------------------------------------
def hospital_validation_curves(history: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """metric -> series -> (model after round, value): each hospital's ``val-<metric>`` and the global model's test
    ``<metric>`` (series ``"global test"``), for the metrics some hospital reported a finite value of.

    A hospital's ``val-*`` in round r scores the model it *received*, the global model after round r-1, so its
    points sit at r-1, beside the test score of that same model (round 1's at 0: the initial model)."""
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for record in history:
        for hospital, metrics in sorted(record.get("hospital_metrics", {}).items()):
            for key, value in metrics.items():
                if key.startswith("val-") and (value is None or _number(value)):
                    curves.setdefault(key[4:], {}).setdefault(hospital, []).append(
                        (record["round"] - 1, math.nan if value is None else float(value)))
    curves = {metric: series for metric, series in curves.items()
              if any(math.isfinite(v) for points in series.values() for _, v in points)}
    for metric, series in curves.items():
        test = [(r["round"], r["test"][metric]) for r in history if metric in r.get("test", {})]
        if test:
            series["global test"] = [(rnd, math.nan if v is None else float(v)) for rnd, v in test]
    return curves


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_hospital_curves(plt, curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> Path:
    """One panel per metric (at most six, those with a test curve first): a thin line per hospital (their median
    and 10-90% band beyond 12 hospitals), the global model's test curve in black."""
    from matplotlib.ticker import MaxNLocator

    order = sorted(curves, key=lambda m: ("global test" not in curves[m], m))[:6]
    fig, axes = plt.subplots(1, len(order), figsize=(3.6 * len(order), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], order):
        hospitals = {h: points for h, points in curves[metric].items() if h != "global test"}
        if len(hospitals) <= 12:
            for hospital, points in hospitals.items():
                ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=0.9, alpha=0.8, label=hospital)
        else:
            import numpy as np

            rounds = sorted({p[0] for points in hospitals.values() for p in points})
            by_round = {rnd: [] for rnd in rounds}
            for points in hospitals.values():
                for rnd, value in points:
                    if math.isfinite(value):
                        by_round[rnd].append(value)
            kept = [rnd for rnd in rounds if by_round[rnd]]
            low, mid, high = (np.array([np.percentile(by_round[r], q) for r in kept]) for q in (10, 50, 90))
            ax.fill_between(kept, low, high, alpha=0.25, label=f"{len(hospitals)} hospitals, 10-90%")
            ax.plot(kept, mid, linewidth=1.2, label="hospitals' median")
        if "global test" in curves[metric]:
            points = curves[metric]["global test"]
            ax.plot([p[0] for p in points], [p[1] for p in points], color="black", linewidth=2.0, marker="o",
                    markersize=3, label="global model, test set")
        ax.set_title(f"{metric}: hospitals' validation")
        ax.set_xlabel("global model after round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    saved = _save(fig, path)
    plt.close(fig)
    return saved


# --- QFedPolyp: each hospital's uplink at its bit-width -----------------------------------------------------------
def bit_width_traffic(history: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, float, float]]]:
    """hospital -> (round, uplink bit-width, MB up, MB down) for the rounds a method recorded bit-widths in."""
    series: dict[str, list[tuple[int, int, float, float]]] = {}
    for record in history:
        bits = record.get("method", {}).get("bit-widths")
        if not isinstance(bits, dict):
            continue
        for hospital, width in sorted(bits.items()):
            traffic = record.get("traffic", {}).get(hospital, {})
            series.setdefault(hospital, []).append((record["round"], int(width), traffic.get("up", 0) / 1e6,
                                                    traffic.get("down", 0) / 1e6))
    return series


def plot_bit_width_traffic(ax, series: dict[str, list[tuple[int, int, float, float]]]) -> None:
    """Uplink MB per round of each hospital labelled with its bit-width (beyond 10 hospitals: the mean of the
    hospitals at each bit-width)."""
    if len(series) <= 10:
        lines = {f"{h} ({'/'.join(str(b) for b in sorted({p[1] for p in points}))}-bit)": points
                 for h, points in series.items()}
        for label, points in lines.items():
            ax.plot([p[0] for p in points], [p[2] for p in points], marker="o", markersize=3, label=label)
    else:
        groups: dict[int, dict[int, list[float]]] = {}
        for points in series.values():
            for rnd, width, up, _ in points:
                groups.setdefault(width, {}).setdefault(rnd, []).append(up)
        for width, by_round in sorted(groups.items()):
            rounds = sorted(by_round)
            count = max(len(v) for v in by_round.values())
            ax.plot(rounds, [sum(by_round[r]) / len(by_round[r]) for r in rounds], marker="o", markersize=3,
                    label=f"{width}-bit ({count} hospitals, mean)")
    ax.set_xlabel("round")
    ax.set_ylabel("MB uploaded per hospital")
    ax.set_title("uplink by bit-width")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)


# --- FedProIn: each hospital's share of each class's prototype influence ------------------------------------------
def influence_shares(history: list[dict[str, Any]]) -> dict[str, Any]:
    """FedProIn: ``{"rounds", "hospitals", "classes", "shares"}``, shares[h, c, j] = hospital h's share of the
    influence counts on class c's prototypes in the j-th round that recorded influence (the weight its prototypes
    had in that class's aggregate; NaN where it was not aggregated or nobody used the class). Empty: no influence."""
    import numpy as np

    records = [r for r in history if isinstance(r.get("method", {}).get("influence"), dict)]
    counts_by_round = []
    for record in records:
        counts = {}
        for hospital, matrix in record["method"]["influence"].items():
            try:
                counts[hospital] = np.asarray(matrix, dtype=np.float64).reshape(len(matrix), -1).sum(axis=1)
            except (TypeError, ValueError):
                continue
        counts_by_round.append(counts)
    sizes = {len(c) for counts in counts_by_round for c in counts.values()}
    if not counts_by_round or len(sizes) != 1:
        return {}
    classes = sizes.pop()
    hospitals = sorted({h for counts in counts_by_round for h in counts})
    shares = np.full((len(hospitals), classes, len(records)), np.nan)
    for j, counts in enumerate(counts_by_round):
        total = sum(counts.values()) if counts else np.zeros(classes)
        for i, hospital in enumerate(hospitals):
            if hospital in counts:
                with np.errstate(invalid="ignore", divide="ignore"):
                    shares[i, :, j] = np.where(total > 0, counts[hospital] / np.where(total > 0, total, 1), np.nan)
    return {"rounds": [r["round"] for r in records], "hospitals": hospitals, "classes": classes, "shares": shares}


def plot_influence(plt, influence: dict[str, Any], path: Path, class_names: list[str] | None = None) -> Path:
    """A heatmap per hospital (the first 16 by name): classes x rounds, the hospital's share of the class's
    prototype influence (blank where it was not aggregated)."""
    hospitals = influence["hospitals"][:16]
    classes = influence["classes"]
    names = class_names if class_names and len(class_names) == classes else [str(c) for c in range(classes)]
    rounds = influence["rounds"]
    columns = min(4, len(hospitals))
    rows = -(-len(hospitals) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(0.9 + 3.2 * columns, 0.8 + (0.9 + 0.22 * classes) * rows),
                             squeeze=False)
    image = None
    for ax, hospital in zip(axes.ravel(), hospitals):
        values = influence["shares"][influence["hospitals"].index(hospital)]
        image = ax.imshow(values, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
        ax.set_title(hospital, fontsize=8)
        ax.set_yticks(range(classes), names, fontsize=6)
        step = max(1, len(rounds) // 8)
        ax.set_xticks(range(0, len(rounds), step), [str(r) for r in rounds[::step]], fontsize=6)
        ax.set_xlabel("round", fontsize=7)
    for ax in axes.ravel()[len(hospitals):]:
        ax.axis("off")
    more = len(influence["hospitals"]) - len(hospitals)
    fig.suptitle("share of each class's prototype influence" + (f" (first 16 hospitals; {more} more)" if more else ""),
                 fontsize=9)
    fig.tight_layout()
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    saved = _save(fig, path)
    plt.close(fig)
    return saved


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


def write_results(run_dir: Path, config: dict[str, Any], history: list[dict[str, Any]], plots: bool = True,
                  class_names: list[str] | None = None) -> None:
    run_dir = Path(run_dir)
    _write(run_dir / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write(run_dir / "metrics.jsonl", "".join(strict_json(r, sort_keys=True) + "\n" for r in history))
    _write(run_dir / "summary.md", render_summary(config, history))
    if plots and history:
        plot_history(history, run_dir / "plots", class_names)


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The round records of ``metrics.jsonl`` (a NaN or infinite metric is None; a file written before they were
    written as null, holding ``NaN``, still reads)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- metrics of the round records by name: select-by, fedmed runs --metric ----------------------------------------
#: metric names that are better low (select-by without max:/min:); every other metric is better high
LOWER_IS_BETTER = ("loss", "hd95", "bytes", "seconds", "error")


def default_direction(path: str) -> str:
    """``"min"`` for losses, HD95, bytes and seconds (the last part of ``path`` names them), else ``"max"``."""
    name = path.rsplit(".", 1)[-1].lower()
    return "min" if any(word in name for word in LOWER_IS_BETTER) else "max"


def parse_selection(text: str) -> tuple[str, str]:
    """``"max:test.dice"`` / ``"test.loss"`` -> (direction, path), the direction from the name when not given."""
    text = text.strip()
    if text.startswith(("max:", "min:")):
        direction, _, path = text.partition(":")
        return direction, path
    return default_direction(text), text


def record_value(record: dict[str, Any], path: str) -> float | None:
    """The number ``path`` names in a round record (``test.dice``, ``hospital_metrics.hospital-00.val-loss``; a key
    may itself hold dots: the longest key that fits is taken), or None where the round has none (not evaluated that
    round, NaN written as null, a hospital not aggregated)."""
    node: Any = record
    rest = path
    while rest:
        if not isinstance(node, dict):
            return None
        key = max((k for k in node if isinstance(k, str) and (rest == k or rest.startswith(k + "."))), key=len,
                  default=None)
        if key is None:
            return None
        node, rest = node[key], rest[len(key) + 1:]
    if not _number(node) or not math.isfinite(node):
        return None
    return float(node)


def scores_received_model(path: str) -> bool:
    """Whether the metric scores the model hospitals *received* in the round it is recorded in (their ``val-*``: the
    global model after the round before), not the round's own model."""
    return path.split(".")[0] in ("train", "hospital_metrics") and path.rsplit(".", 1)[-1].startswith("val-")


def model_round(record_round: int, path: str) -> int:
    """The round whose global model the metric ``path`` of round ``record_round`` scored (0: the initial model)."""
    return record_round - 1 if scores_received_model(path) else record_round


def better(value: float, than: float | None, direction: str) -> bool:
    """Whether ``value`` beats ``than`` (None: nothing yet) in ``direction``; a tie keeps the earlier round."""
    return than is None or (value > than if direction == "max" else value < than)


def aggregated_in(record: dict[str, Any]) -> list[str]:
    """The hospitals whose updates made round ``record``'s model: none in a skipped round (whatever its
    ``aggregated`` says it accepted before the round was given up: those updates were discarded)."""
    return [] if record.get("skipped") else [str(h) for h in record.get("aggregated") or []]


def best_round(history: list[dict[str, Any]], selection: str) -> tuple[int, float] | None:
    """(round, value) of the best model by ``selection`` (``max:``/``min:`` optional): the round whose global model
    scored best (for hospitals' ``val-*``, the round before the one that recorded it); only a model some round
    aggregated is a candidate (not the initial model, nor a skipped round's, which is the one before it), None when
    no such round has it."""
    direction, path = parse_selection(selection)
    trained = {record["round"] for record in history if aggregated_in(record)}
    best: tuple[int, float] | None = None
    for record in history:
        value = record_value(record, path)
        scored = model_round(record["round"], path)
        if value is not None and scored in trained and better(value, best[1] if best else None, direction):
            best = (scored, value)
    return best


# --- a run's status: running (which process), completed, stopped, failed -----------------------------------------
def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux; empty elsewhere): a pid reused later differs."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def this_process() -> dict[str, Any]:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "process-start": _process_start(pid), "boot-id": _boot_id()}


def process_alive(info: dict[str, Any]) -> bool | None:
    """Whether the process ``info`` (from :func:`this_process`) still runs; None when it ran on another host."""
    if info.get("host") != socket.gethostname():
        return None
    if info.get("boot-id") and info["boot-id"] != _boot_id():
        return False
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid: it exists
        pass
    return not info.get("process-start") or _process_start(pid) == info["process-start"]


def write_status(run_dir: Path, status: str, history: list[dict[str, Any]], num_rounds: int, **extra: Any) -> None:
    """``status.json``: ``running`` (with the process and a heartbeat), ``completed``, ``stopped`` or ``failed``."""
    path = Path(run_dir) / STATUS_FILE
    started = time.time()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        previous = json.loads(path.read_text())
        if previous.get("process", {}).get("pid") == os.getpid():  # the same run's earlier heartbeat
            started = float(previous["started"])
    record = {"status": status, "started": started, "updated": time.time(),
              "rounds": history[-1]["round"] if history else 0, "num-server-rounds": num_rounds,
              "process": this_process(), **extra}
    _write(path, strict_json(record, indent=1) + "\n")


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        status = json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def run_state(run_dir: Path, config: dict[str, Any], history: list[dict[str, Any]], now: float | None = None) -> str:
    """completed, running, stopped or failed, from what the folder holds: ``status.json`` (a run that says it is
    running is running while its process lives; on another host, while its heartbeat is recent), else the rounds
    recorded against ``num-server-rounds``."""
    now = time.time() if now is None else now
    done = bool(history) and history[-1].get("round", 0) >= int(config.get("num-server-rounds") or 0)
    status = read_status(run_dir)
    state = status.get("status")
    if state in ("completed", "stopped", "failed"):
        return state
    if state == "running":
        alive = process_alive(status.get("process", {}))
        if alive is None:  # another host (a container): its heartbeat is written after every round
            longest = max([float(r.get("seconds") or 0) for r in history] or [0.0])
            patience = max(3600.0, 3 * longest + float(config.get("round-timeout") or 600))
            alive = now - float(status.get("updated") or 0) < patience
        if alive:
            return "running"
        return "completed" if done else "stopped"
    if done:
        return "completed"
    updated = (Path(run_dir) / "metrics.jsonl").stat().st_mtime if (Path(run_dir) / "metrics.jsonl").exists() else 0
    return "running" if now - updated < 600 else "stopped"  # a run of an older fedmed: no status file


# --- fedmed runs: a results folder's runs, newest first -------------------------------------------------------------
def describe_run(run_dir: Path, metric: str = "") -> dict[str, Any] | None:
    """One row of ``fedmed runs`` (None: not a run folder): method, data, rounds, the best and final value of
    ``metric`` (default: the run's select-by, else its task's headline test metric), traffic, status."""
    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        return None
    try:
        history = read_history(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    except (OSError, ValueError):
        history = []
    selection = metric or config.get("select-by") or f"test.{HEADLINE.get(config.get('task', ''), 'accuracy')}"
    direction, path = parse_selection(selection)
    values = [(r["round"], v) for r in history if (v := record_value(r, path)) is not None]
    best = best_round(history, f"{direction}:{path}")
    stamps = [p.stat().st_mtime for p in (run_dir / "metrics.jsonl", run_dir / STATUS_FILE, run_dir / "config.json")
              if p.exists()]
    state = run_state(run_dir, config, history)
    missing = why_missing(history, path) if not values else "" if best else \
        "no round aggregated an update: every score is of the model it started from"
    error = read_status(run_dir).get("error") if state == "failed" else None
    partitioner = config.get("partitioner", "")
    if partitioner == "dirichlet":
        partitioner += f"({config.get('dirichlet-alpha')})"
    return {"run": run_dir.name, "path": str(run_dir), "status": state,
            "error": str(error or "status.json records no reason") if state == "failed" else "",
            "trained-rounds": sum(1 for r in history if aggregated_in(r)),
            "method": config.get("strategy", "?"), "task": config.get("task", "?"),
            "data": " ".join(str(part) for part in (config.get("dataset", "?"), partitioner) if part),
            "hospitals": len({h for r in history for h in r.get("chosen", [])}),
            "rounds": history[-1]["round"] if history else 0, "num-server-rounds": config.get("num-server-rounds"),
            "metric": f"{direction}:{path}", "best": best[1] if best else None, "best-round": best[0] if best else None,
            "final": values[-1][1] if values else None, "final-round": values[-1][0] if values else None,
            "traffic-mb": sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in history) / 1e6,
            "updated": max(stamps) if stamps else 0.0, "missing": missing}


def number_paths(value: Any, prefix: str = "") -> set[str]:
    """The dotted paths of every finite number in a round record (``test.accuracy``, ``train.val-loss``...)."""
    if isinstance(value, dict):
        return {path for key, item in value.items() if isinstance(key, str)
                for path in number_paths(item, f"{prefix}.{key}" if prefix else key)}
    return {prefix} if _number(value) and math.isfinite(value) else set()


def why_missing(history: list[dict[str, Any]], path: str) -> str:
    """Why no round has a value for ``path``: what the rounds record instead, under its group and by its last word
    (``test.loss`` on a classification run: the server's test metrics hold no loss; ``train.val-loss`` does)."""
    if not history:
        return "no round recorded yet"
    recorded = set().union(*(number_paths(record) for record in history))
    group, _, name = path.partition(".")
    beside = sorted(p.partition(".")[2] for p in recorded if p.partition(".")[0] == group)
    reason = f"no round records {path}"
    reason += (f"; its {group} holds {', '.join(beside[:8])}{', ...' if len(beside) > 8 else ''}" if beside
               else f"; no round has {group} metrics")
    word = (name or group).rsplit(".", 1)[-1].split("-")[-1]
    alike = sorted((p for p in recorded if p != path and p.rsplit(".", 1)[-1].split("-")[-1] == word),
                   key=lambda p: (p.count("."), p))  # the round's own (train.val-loss) before one hospital's
    return reason + (f"; by that name: {', '.join(alike[:4])}" if alike else "")


def list_runs(results_dir: Path, metric: str = "") -> list[dict[str, Any]]:
    """Every run folder directly under ``results_dir``, the most recently updated first."""
    results_dir = Path(results_dir)
    rows = [row for folder in results_dir.iterdir() if folder.is_dir() and (row := describe_run(folder, metric))]
    return sorted(rows, key=lambda row: (-row["updated"], row["run"]))


def render_runs(rows: list[dict[str, Any]]) -> str:
    """The markdown table ``fedmed runs`` prints."""
    header = ["run", "status", "method", "task", "data", "hospitals", "rounds", "metric", "best (round)", "final",
              "traffic MB", "updated"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        best = f"{_fmt(row['best'])} ({row['best-round']})" if row["best"] is not None else "n/a"
        updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["updated"])) if row["updated"] else ""
        cells = [row["run"], row["status"], row["method"], row["task"], row["data"], str(row["hospitals"]),
                 f"{row['rounds']}/{row['num-server-rounds']}", row["metric"], best, _fmt(row["final"]),
                 f"{row['traffic-mb']:.1f}", updated]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {row['run']}: failed: {row['error']}" for row in rows if row.get("error")]
    notes += [f"- {row['run']}: n/a: {row['missing']}" for row in rows if row.get("missing")]
    return "\n".join(lines + ([""] + notes if notes else []))
