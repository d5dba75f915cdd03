"""What a results folder says, for the consortium's lead: its runs (``fedmed runs``' rows), and per run each round's
hospitals (asked, answered, refused, aggregated) with bytes, the metric curves, the best round and its checkpoint,
the cross-site table, the server's audit chain, and where the run's TensorBoard or MLflow record is.

Read with ``server_app.results`` (``describe_run``, ``read_history``, ``best_round``, ``run_state``),
``server_app.checkpoint.read_best`` and ``common.trust.audit.verify``: the page says what the CLI says. Nothing is
written; a file that cannot be read is a problem named on the page.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server_app.results import HEADLINE, aggregated_in, best_round, describe_run, headline_metrics, parse_selection

from .hospital_view import Check, audit_chain

#: the run-config keys the page shows about a run (the rest are in its config.json)
SHOWN_KEYS = ("task", "strategy", "model", "dataset", "partitioner", "num-server-rounds", "local-epochs",
              "min-train-hospitals", "fraction-train", "seed", "select-by", "tracking", "secure-aggregation.enabled",
              "cross-site-evaluation")


def is_run_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def run_folders(results: Path) -> dict[str, Path]:
    """run name -> folder: ``results`` itself when it is one run's folder, else each sub-folder holding a
    ``config.json`` (what ``fedmed runs`` lists). Only folders inside ``results`` are ever listed."""
    results = Path(results)
    if is_run_folder(results):
        return {results.name: results}
    return {sub.name: sub for sub in sorted(results.iterdir())
            if sub.is_dir() and not sub.is_symlink() and is_run_folder(sub)}


def list_run_rows(results: Path) -> list[dict[str, Any]]:
    """``fedmed runs``' rows for every run folder, the most recently updated first."""
    rows = [row for folder in run_folders(results).values() if (row := describe_run(folder))]
    return sorted(rows, key=lambda row: (-row["updated"], row["run"]))


@dataclass
class RoundRow:
    round: int
    asked: list[str]
    answered: list[str]
    missing: list[str]
    refused: dict[str, str]
    aggregated: list[str]  #: whose updates made the round's model (none in a skipped round)
    discarded: list[str]  #: accepted, then given up with the round
    bytes_up: int
    bytes_down: int
    seconds: float | None
    skipped: str
    traffic: dict[str, dict[str, int]]
    test: dict[str, Any]
    secure: dict[str, Any]


@dataclass
class Best:
    metric: str
    round: int | None
    value: float | None
    checkpoint: Path | None
    note: str


@dataclass
class CrossSite:
    after_round: Any
    headline: str
    models: list[str]
    rows: list[tuple[str, list[float | None]]]
    failed: dict[str, str]
    missing: list[str]


@dataclass
class TrackerLink:
    name: str
    where: str
    command: str
    href: str


@dataclass
class RunView:
    name: str
    folder: Path
    row: dict[str, Any]
    config: dict[str, Any]
    rounds: list[RoundRow]
    curves: dict[str, list[tuple[int, float | None]]]
    validation: dict[str, list[tuple[int, float | None]]]
    best: Best | None
    cross_site: CrossSite | None
    trackers: list[TrackerLink]
    chain: Check
    problems: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.row.get("status", "?")

    @property
    def live(self) -> bool:
        return self.status == "running"

    @property
    def secure(self) -> bool:
        return bool(self.config.get("secure-aggregation.enabled"))

    @property
    def error(self) -> str:
        """Why the run failed (status.json's error), empty unless it did."""
        return str(self.row.get("error") or "")

    def table(self) -> tuple[list[str], list[tuple[int, list[float | None]]]]:
        """The numbers behind the curves, one row per round: each test metric, each validation mean (of the model
        after the round before), MB each way."""
        columns = [f"test {k}" for k in self.curves] + [f"hospitals' {k}" for k in self.validation] + \
            ["MB to the server", "MB to the hospitals"]
        by_round: dict[int, list[float | None]] = {}
        series = list(self.curves.values()) + list(self.validation.values()) + \
            [[(r.round, r.bytes_up / 1e6) for r in self.rounds], [(r.round, r.bytes_down / 1e6) for r in self.rounds]]
        for index, points in enumerate(series):
            for x, y in points:
                by_round.setdefault(int(x), [None] * len(series))[index] = y
        return columns, sorted(by_round.items())


def read_run(folder: Path) -> RunView:
    """Everything the coordinator's run page shows, from one run folder."""
    folder = Path(folder)
    problems: list[str] = []
    config = _json(folder / "config.json", problems)
    if not isinstance(config, dict):
        config = {}
    history: list[dict[str, Any]] = []
    metrics_path = folder / "metrics.jsonl"
    if metrics_path.is_file():
        try:
            for number, line in enumerate(metrics_path.read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    problems.append(f"{metrics_path} line {number} is not JSON (a round record cut short or edited); "
                                    "it is left out")
                    continue
                if isinstance(record, dict) and isinstance(record.get("round"), int):
                    history.append(record)
        except OSError as error:
            problems.append(f"{metrics_path} cannot be read: {error.strerror or error}")
    else:
        problems.append(f"{metrics_path}: no round recorded yet")
    row = describe_run(folder) or {"run": folder.name, "status": "?", "rounds": 0}
    rounds = [round_row(record) for record in history]
    curves = {metric: [(r["round"], _number(r.get("test", {}).get(metric))) for r in history if "test" in r]
              for metric in headline_metrics(history)}
    validation: dict[str, list[tuple[int, float | None]]] = {}
    for record in history:
        for key, value in (record.get("train") or {}).items():
            if key.startswith("val-") and (value is None or isinstance(value, (int, float))):
                validation.setdefault(key, []).append((record["round"] - 1, _number(value)))
    return RunView(name=folder.name, folder=folder, row=row, config=config, rounds=rounds, curves=curves,
                   validation=validation, best=best_of(folder, config, history), cross_site=cross_site_of(folder,
                                                                                                            config,
                                                                                                            problems),
                   trackers=trackers_of(folder, config), chain=audit_chain(_server_log(folder)),
                   problems=problems)


def _json(path: Path, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        problems.append(f"{path} cannot be read: {error.strerror or error}")
    except ValueError as error:
        problems.append(f"{path} is not JSON ({error})")
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _server_log(folder: Path) -> Path:
    """The run's server audit log: ``audit.jsonl`` in its folder (a log the run config put elsewhere is not read:
    the console reads only the folders it was given)."""
    return folder / "audit.jsonl"


def round_row(record: dict[str, Any]) -> RoundRow:
    """One round record of metrics.jsonl in the words of the page: asked (chosen), answered (chosen and not
    missing), refused with reasons, aggregated, bytes."""
    asked = [str(h) for h in record.get("chosen", [])]
    missing = [str(h) for h in record.get("missing", [])]
    refused = record.get("refused") or {}
    from .hospital_view import refusal_words

    return RoundRow(round=record["round"], asked=asked, answered=[h for h in asked if h not in missing],
                    missing=missing, refused={str(k): refusal_words(str(v)) for k, v in refused.items()},
                    aggregated=aggregated_in(record),
                    discarded=[str(h) for h in (record.get("discarded") or
                                                (record.get("aggregated") if record.get("skipped") else None) or [])],
                    bytes_up=int(record.get("bytes_up") or 0), bytes_down=int(record.get("bytes_down") or 0),
                    seconds=_number(record.get("seconds")), skipped=str(record.get("skipped") or ""),
                    traffic={str(h): {k: int(v or 0) for k, v in t.items()} for h, t in
                             (record.get("traffic") or {}).items() if isinstance(t, dict)},
                    test={k: v for k, v in (record.get("test") or {}).items() if "/" not in k},
                    secure=record.get("secure-aggregation") or {})


def best_of(folder: Path, config: dict[str, Any], history: list[dict[str, Any]]) -> Best | None:
    """The best round by the run's ``select-by`` (its ``checkpoints/best.npz``), else by its task's headline test
    metric (the round's checkpoint, where ``keep-checkpoints`` kept it)."""
    from server_app.checkpoint import checkpoint_dir, read_best

    selection = str(config.get("select-by") or f"test.{HEADLINE.get(str(config.get('task', '')), 'accuracy')}")
    direction, path = parse_selection(selection)
    if config.get("select-by"):
        kept = read_best(folder)
        if kept is not None:
            return Best(kept["metric"], kept["round"], kept["value"], Path(kept["file"]),
                        "kept by select-by")
    found = best_round(history, f"{direction}:{path}")
    if found is None:
        why = "no round aggregated an update, so no model was trained" if history and \
            not any(aggregated_in(r) for r in history) else "no round recorded it yet"
        return Best(f"{direction}:{path}", None, None, None, why) if history else None
    checkpoint = checkpoint_dir(folder) / f"round-{found[0]:05d}.npz"
    return Best(f"{direction}:{path}", found[0], found[1], checkpoint if checkpoint.is_file() else None,
                "the round's checkpoint" if checkpoint.is_file() else
                "Its checkpoint was not kept (keep-checkpoints); select-by keeps the best round's model")


def cross_site_of(folder: Path, config: dict[str, Any], problems: list[str]) -> CrossSite | None:
    path = folder / "cross_site.json"
    if not path.is_file():
        return None
    record = _json(path, problems)
    if not isinstance(record, dict) or not isinstance(record.get("scores"), dict):
        problems.append(f"{path} does not hold a cross-site table")
        return None
    headline = HEADLINE.get(str(config.get("task", "")), "accuracy")
    scores = record["scores"]
    models = sorted({model for by_model in scores.values() if isinstance(by_model, dict) for model in by_model})
    rows = [(hospital, [_number((by_model.get(model) or {}).get(headline)) for model in models])
            for hospital, by_model in sorted(scores.items()) if isinstance(by_model, dict)]
    return CrossSite(record.get("after-round"), headline, models, rows, dict(record.get("failed") or {}),
                     list(record.get("missing") or []))


def trackers_of(folder: Path, config: dict[str, Any]) -> list[TrackerLink]:
    """Where the run's TensorBoard events and MLflow run are, the command that shows them, and a link to it."""
    links = []
    tracking = str(config.get("tracking") or "")
    events = folder / "tensorboard"
    if "tensorboard" in tracking or events.is_dir():
        links.append(TrackerLink("TensorBoard", str(events), f"tensorboard --logdir {events}",
                                 "http://127.0.0.1:6006/"))
    state: dict[str, Any] = {}
    try:
        loaded = json.loads((folder / "tracking.json").read_text())
        state = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    mlflow = state.get("mlflow") if isinstance(state.get("mlflow"), dict) else {}
    if "mlflow" in tracking or mlflow:
        uri, run_id = str(mlflow.get("uri") or ""), str(mlflow.get("run-id") or "")
        if uri.startswith(("http://", "https://")):
            links.append(TrackerLink("MLflow", uri, f"MLflow run {run_id}", uri.rstrip("/") + "/"))
        else:
            store = uri or f"file://{folder / 'mlruns'}"
            experiment = next((p.parent.name for p in (folder / "mlruns").glob(f"*/{run_id}")), "") if run_id else ""
            href = f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{run_id}" if experiment else \
                "http://127.0.0.1:5000/"
            prefix = "MLFLOW_ALLOW_FILE_STORE=true " if store.startswith("file:") else ""
            links.append(TrackerLink("MLflow", store, f"{prefix}mlflow ui --backend-store-uri {store}", href))
    return links
