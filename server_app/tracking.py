"""Experiment tracking: every round of a run in TensorBoard and/or MLflow, logged by the server (docs/tracking.md).

``tracking='tensorboard'`` writes event files to ``<run>/tensorboard`` (``tensorboard --logdir results`` shows every
run side by side); ``tracking='mlflow'`` logs to an MLflow run, in a file store in ``<run>/mlruns`` unless
``tracking-uri`` names a tracking server or database. Both take what the round records hold (the same numbers as
``metrics.jsonl``), under these names, the round as the step:

- ``test/<metric>``: the global model on the server's test set; ``train/<metric>``: the hospitals' weighted means;
- ``hospital/<hospital>/<metric>``: what each aggregated hospital reported (``train-loss``, ``val-<metric>`` of the
  model it received, ``num-examples``, ...);
- ``traffic/<hospital>/up-mb`` and ``down-mb`` (measured message sizes), ``traffic/all/...`` the round's total;
- ``screening/refused``, ``missing``, ``aggregated``, ``chosen`` (counts), ``screening/update-norm-vs-median/<h>``;
  each refusal's reason as text (TensorBoard ``screening/refused``; MLflow a tag ``refused.<hospital>`` and the
  artifact ``refusals/round-NNNNN.md``);
- ``method/...``: the method's state (FedProIn ``method/influence/<h>/<class>`` counts and
  ``method/influence-share/<h>/<class>``, ``method/prototype-usage/<class>/<k>``; QFedPolyp
  ``method/bit-widths/<h>``; FedMEPD ``method/personalised/<h>/all`` and ``method/personalised-mean/<layer>``;
  any other number it records);
- ``best/value`` and ``best/round``: the best round so far by ``select-by``;
- the resolved config (MLflow parameters; TensorBoard text ``config`` and the HParams dashboard), and at the end
  the plots, ``summary.md``, ``metrics.jsonl``, ``config.json`` and the cross-site table (MLflow artifacts;
  TensorBoard images and text).

Trackers work in a thread of their own, so a slow or absent tracking server never holds a round up; a failure is
logged, and a tracker that fails three times running is dropped for the rest of the run, which goes on. In a
deployment only the server logs: hospitals report their metrics to it as always and log nothing themselves.
``tracking.json`` in the run folder remembers what was logged (the MLflow run, the last round), so a resumed run
continues the same MLflow run and TensorBoard discards what it had logged past the checkpoint resumed from.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

from common.config import ConfigError, JobConfig

from .results import _number, _write, better, model_round, parse_selection, record_value

log = logging.getLogger("fedmed")

#: tracker -> (module it needs, pip package, fedmed-hospitals extra)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
            "mlflow": ("mlflow", "mlflow-skinny", "mlflow")}
STATE_FILE = "tracking.json"
MAX_SCALARS = 20_000  #: per round and tracker (1000 hospitals x ~10 numbers each, and the method's)
FAILURES_TO_DROP = 3  #: consecutive failures after which a tracker is left out for the rest of the run
CLOSE_TIMEOUT = 300.0  #: seconds the end of a run waits for the trackers to finish their uploads
#: config keys every TensorBoard HParams row shows (besides those set to other than their default)
HPARAM_KEYS = ("task", "strategy", "dataset", "model", "partitioner", "num-server-rounds", "local-epochs",
               "learning-rate", "batch-size", "seed")
#: keys that say where and how a run is kept, not what it is: never HParams
NOT_HPARAMS = ("run-name", "results-dir", "state-dir", "resume-from", "overwrite-run", "tracking", "tracking-uri",
               "hospital-keys", "keep-checkpoints", "device", "data-dir", "test-dir", "round-timeout",
               "messages-in-flight", "data-workers")
#: a round's bookkeeping numbers, not metrics (the hospitals' weighted mean of a round number means nothing)
NOT_METRICS = ("server-round", "state-from-round")
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :]")  # MLflow's metric/tag names: letters, digits, _ - . space / :


def requested(cfg: JobConfig) -> list[str]:
    return [name for name in cfg.tracking.split(",") if name in TRACKERS]


def check_installed(cfg: JobConfig) -> None:
    """ConfigError naming the extra to install for a tracker whose package this Python lacks (before round 1)."""
    for name in requested(cfg):
        module, package, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"tracking={name!r}: {package} is not installed where the ServerApp runs; install "
                              f"the extra, pip install 'fedmed-hospitals[{extra}]' (or pip install {package}), or "
                              "set tracking='none'")


# --- what is logged: a round record as named numbers and texts -----------------------------------------------------
def _name(*parts: Any) -> str:
    return "/".join(_UNSAFE.sub("_", str(part)) for part in parts)


def _labels(count: int, class_names: list[str] | None) -> list[str]:
    return class_names if class_names and len(class_names) == count else [str(c) for c in range(count)]


def method_scalars(method: dict[str, Any], class_names: list[str] | None = None) -> dict[str, float]:
    """The numbers of a round's method state: FedProIn's influence per hospital and class (counts and the hospital's
    share of the class), prototype usage per class and prototype; FedMEPD's share of personal filters per hospital
    (``personalised/<h>/all``) and per decoder layer, averaged over the hospitals (``personalised-mean/<layer>``;
    its packed masks are left out); every other number by its path (QFedPolyp's ``bit-widths/<h>``), short lists of
    numbers by index, lists of names by their length (``unused-prototypes``)."""
    import numpy as np

    out: dict[str, float] = {}

    def flatten(prefix: tuple, value: Any) -> None:
        if _number(value):
            if math.isfinite(value):
                out[_name(*prefix)] = float(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                flatten((*prefix, key), item)
        elif isinstance(value, (list, tuple)):
            if value and all(isinstance(item, str) for item in value) or not value:
                out[_name(*prefix)] = float(len(value))
            elif len(value) <= 32 and all(_number(item) for item in value):
                for index, item in enumerate(value):
                    flatten((*prefix, index), item)

    for key, value in method.items():
        if key == "masks":
            continue
        if key == "influence" and isinstance(value, dict):
            counts = {}
            for hospital, matrix in value.items():
                try:
                    counts[hospital] = np.asarray(matrix, dtype=np.float64).reshape(len(matrix), -1).sum(axis=1)
                except (TypeError, ValueError):
                    continue
            if counts and len({c.shape for c in counts.values()}) == 1:
                total = sum(counts.values())
                for hospital, per_class in counts.items():
                    for label, count, whole in zip(_labels(len(per_class), class_names), per_class, total):
                        out[_name("method", "influence", hospital, label)] = float(count)
                        if whole > 0:
                            out[_name("method", "influence-share", hospital, label)] = float(count / whole)
            continue
        if key == "personalised" and isinstance(value, dict):
            layers: dict[str, list[float]] = {}
            for hospital, fractions in value.items():
                for layer, fraction in (fractions.items() if isinstance(fractions, dict) else ()):
                    if _number(fraction) and math.isfinite(fraction):
                        if layer == "all":
                            out[_name("method", "personalised", hospital, "all")] = float(fraction)
                        else:
                            layers.setdefault(layer, []).append(float(fraction))
            for layer, fractions in layers.items():
                out[_name("method", "personalised-mean", layer)] = sum(fractions) / len(fractions)
            continue
        if key == "prototype-usage" and isinstance(value, list):
            try:
                usage = np.asarray(value, dtype=np.float64).reshape(len(value), -1)
            except (TypeError, ValueError):
                continue
            for label, row in zip(_labels(len(usage), class_names), usage):
                for k, count in enumerate(row):
                    out[_name("method", "prototype-usage", label, k)] = float(count)
            continue
        flatten(("method", key), value)
    return out


def round_scalars(record: dict[str, Any], class_names: list[str] | None = None) -> dict[str, float]:
    """Every number of a round record the trackers log, by name (see the module's docstring)."""
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        if _number(value) and math.isfinite(value):
            out[name] = float(value)

    for table in ("test", "train"):
        for key, value in (record.get(table) or {}).items():
            if key not in NOT_METRICS:
                put(_name(table, key), value)
    for hospital, metrics in (record.get("hospital_metrics") or {}).items():
        for key, value in metrics.items():
            if key != "server-round":
                put(_name("hospital", hospital, key), value)
    for hospital, traffic in (record.get("traffic") or {}).items():
        put(_name("traffic", hospital, "up-mb"), traffic.get("up", 0) / 1e6)
        put(_name("traffic", hospital, "down-mb"), traffic.get("down", 0) / 1e6)
    put("traffic/all/up-mb", record.get("bytes_up", 0) / 1e6)
    put("traffic/all/down-mb", record.get("bytes_down", 0) / 1e6)
    for what in ("chosen", "aggregated", "missing", "refused", "weight-cut"):
        put(f"screening/{what}", len(record.get(what) or ()))
    for hospital, value in (record.get("update-norm-vs-median") or {}).items():
        put(_name("screening", "update-norm-vs-median", hospital), value)
    put("round/seconds", record.get("seconds"))
    put("round/identity-seconds", record.get("identity-seconds"))
    put("round/skipped", 1.0 if record.get("skipped") else 0.0)
    out.update(method_scalars(record.get("method") or {}, class_names))
    return out


def round_texts(record: dict[str, Any]) -> dict[str, str]:
    """Markdown of what went wrong in a round: refusals with their reasons, hospitals missing, a skipped round."""
    texts = {}
    refused = record.get("refused") or {}
    if refused:
        texts["screening/refused"] = "| hospital | reason |\n|---|---|\n" + "\n".join(
            f"| {hospital} | {str(reason).replace('|', '/')} |" for hospital, reason in sorted(refused.items()))
    if record.get("missing"):
        texts["screening/missing"] = "No reply before the timeout: " + ", ".join(record["missing"])
    if record.get("skipped"):
        texts["screening/skipped"] = str(record["skipped"])
    return texts


def config_table(flat: dict[str, Any]) -> str:
    return "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {str(v).replace('|', '/')} |"
                                                      for k, v in sorted(flat.items()))


def _detach(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of the record as metrics.jsonl holds it (NaN and infinities as None): the round's own dict is the
    engine's, and the worker thread reads it later."""
    from .results import strict_json

    try:
        return json.loads(strict_json(record))
    except (TypeError, ValueError):
        return copy.deepcopy(record)


# --- the two trackers ---------------------------------------------------------------------------------------------
class TensorBoardTracker:
    """Event files in ``<run>/tensorboard``; a resumed run's writer purges the steps from its first round on."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, cfg: JobConfig, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(run_dir) / "tensorboard"
        earlier = self.folder.is_dir() and any(self.folder.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(str(self.folder), purge_step=first_step if earlier else None, flush_secs=30)
        self.cfg = cfg
        self.layout_written = False
        self.hparams_written = False
        self.writer.add_text("config", config_table(cfg.to_flat()), first_step)
        log.info("tracking: TensorBoard event files in %s (tensorboard --logdir %s)", self.folder,
                 Path(run_dir).parent)

    def log_round(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        for name, text in texts.items():
            self.writer.add_text(name, text, step)
        if not self.layout_written:
            self.writer.add_custom_scalars(self.layout(scalars))
            self.layout_written = True
        if not self.hparams_written and any(name.startswith("test/") for name in scalars):
            self.write_hparams(scalars)
        self.writer.flush()

    def layout(self, scalars: dict[str, float]) -> dict[str, dict[str, list]]:
        """Custom Scalars charts: every hospital's curve of a metric in one chart (validation beside the global
        test curve), traffic per hospital, the method's per-hospital state."""
        hospital_keys = sorted({name.rsplit("/", 1)[1] for name in scalars if name.startswith("hospital/")})
        charts: dict[str, dict[str, list]] = {}
        for key in hospital_keys:
            patterns = [rf"^hospital/[^/]+/{re.escape(key)}$"]
            if key.startswith("val-"):
                patterns.append(rf"^test/{re.escape(key[4:])}$")
                charts.setdefault("hospitals: validation vs global test", {})[key] = ["Multiline", patterns]
            else:
                charts.setdefault("hospitals", {})[key] = ["Multiline", patterns]
        charts["traffic per hospital"] = {"up MB": ["Multiline", [r"^traffic/[^/]+/up-mb$"]],
                                          "down MB": ["Multiline", [r"^traffic/[^/]+/down-mb$"]]}
        method: dict[str, list] = {}
        classes = sorted({name.rsplit("/", 1)[1] for name in scalars if name.startswith("method/influence-share/")})
        for label in classes:
            method[f"influence share, class {label}"] = ["Multiline",
                                                         [rf"^method/influence-share/[^/]+/{re.escape(label)}$"]]
        if any(name.startswith("method/bit-widths/") for name in scalars):
            method["bit-widths"] = ["Multiline", [r"^method/bit-widths/"]]
        if any(name.startswith("method/personalised/") for name in scalars):
            method["personal filters (all layers)"] = ["Multiline", [r"^method/personalised/[^/]+/all$"]]
            method["personal filters per layer (hospitals' mean)"] = ["Multiline", [r"^method/personalised-mean/"]]
        if method:
            charts["method"] = method
        return charts

    def write_hparams(self, scalars: dict[str, float]) -> None:
        """The HParams dashboard's row of this run: the core keys and every key set to other than its default,
        with the test metrics (and best/value) as its metrics."""
        from torch.utils.tensorboard.summary import hparams

        flat = self.cfg.to_flat()
        defaults = JobConfig().to_flat()
        chosen = {k: v for k, v in flat.items()
                  if k not in NOT_HPARAMS and (k in HPARAM_KEYS or k not in defaults or defaults[k] != v)}
        values = {k: v for k, v in chosen.items() if isinstance(v, (bool, int, float, str))}
        metrics = {name: 0.0 for name in scalars if name.startswith("test/")}
        if self.cfg.select_by:
            metrics["best/value"] = 0.0
        experiment, start, self.session_end = hparams(values, metrics)
        writer = self.writer._get_file_writer()
        writer.add_summary(experiment)
        writer.add_summary(start)
        self.hparams_written = True

    def finish(self, run_dir: Path, status: str, step: int, files: list[Path]) -> None:
        import numpy as np
        from PIL import Image

        for path in files:
            if path.suffix == ".png":
                with Image.open(path) as image:
                    self.writer.add_image(f"plots/{path.stem}", np.asarray(image.convert("RGB")), step,
                                          dataformats="HWC")
            elif path.suffix == ".md":
                self.writer.add_text(path.stem, path.read_text(), step)
        self.writer.add_text("status", status, step)
        if self.hparams_written and status == "completed":
            self.writer._get_file_writer().add_summary(self.session_end)
        self.close()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """An MLflow run: parameters, metrics with the round as step, tags, artifacts. ``tracking-uri`` empty: a file
    store in ``<run>/mlruns`` (the experiment ``$MLFLOW_EXPERIMENT_NAME``, else ``fedmed``)."""

    name = "mlflow"
    STATUS = {"completed": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}

    def __init__(self, run_dir: Path, cfg: JobConfig, previous: dict[str, Any], resuming: bool):
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_uri(run_dir, cfg.tracking_uri)
        if self.uri.startswith("file:"):  # MLflow 3 keeps its file store but asks to be told it is wanted
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "fedmed"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                experiment_id = self.client.create_experiment(name)
            except Exception:  # another run created it meanwhile
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        else:
            experiment_id = experiment.experiment_id
        self.run_id = None
        if resuming and previous.get("uri") == self.uri and previous.get("run-id"):
            try:
                run = self.client.get_run(previous["run-id"])
                if run.info.lifecycle_stage == "active":
                    self.run_id = run.info.run_id
                    self.client.update_run(self.run_id, status="RUNNING")
            except Exception as error:
                log.warning("tracking: MLflow run %s of the run resumed is not in %s (%s); starting a new one",
                            previous["run-id"], self.uri, error)
        self.continued = self.run_id is not None
        if self.run_id is None:
            tags = {"fedmed.run-name": cfg.run_name, "fedmed.task": cfg.task, "fedmed.strategy": cfg.strategy,
                    "fedmed.dataset": cfg.dataset, "fedmed.run-dir": str(Path(run_dir).resolve())}
            self.run_id = self.client.create_run(experiment_id, run_name=cfg.run_name, tags=tags).info.run_id
        self.log_params(cfg.to_flat())
        log.info("tracking: MLflow run %s (experiment %r) in %s%s", self.run_id, name, self.uri,
                 ", continued" if self.continued else "")

    def state(self) -> dict[str, Any]:
        return {"uri": self.uri, "run-id": self.run_id}

    def log_params(self, flat: dict[str, Any]) -> None:
        """The resolved config as parameters; a resumed run's changed keys (MLflow keeps a parameter's first value)
        as tags ``fedmed.changed-on-resume.<key>``."""
        from mlflow.entities import Param, RunTag

        existing = self.client.get_run(self.run_id).data.params if self.continued else {}
        params, tags = [], []
        for key, value in sorted(flat.items()):
            text = str(value)[:6000]
            if key not in existing:
                params.append(Param(_UNSAFE.sub("_", key), text))
            elif existing[key] != text:
                tags.append(RunTag(_UNSAFE.sub("_", f"fedmed.changed-on-resume.{key}"), f"{existing[key]} -> {text}"))
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        for start in range(0, len(tags), 100):
            self.client.log_batch(self.run_id, tags=tags[start:start + 100])

    def log_round(self, step: int, scalars: dict[str, float], texts: dict[str, str],
                  record: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in scalars.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])
        tags = [RunTag(_name(f"refused.{hospital}"), f"round {step}: {reason}"[:5000])
                for hospital, reason in sorted((record.get("refused") or {}).items())]
        for start in range(0, len(tags), 100):
            self.client.log_batch(self.run_id, tags=tags[start:start + 100])
        if texts:
            self.client.log_text(self.run_id, "\n\n".join(f"## {name}\n\n{text}" for name, text in texts.items()),
                                 f"refusals/round-{step:05d}.md")

    def finish(self, run_dir: Path, status: str, step: int, files: list[Path]) -> None:
        for path in files:
            folder = str(path.parent.relative_to(run_dir)) if path.parent != Path(run_dir) else None
            self.client.log_artifact(self.run_id, str(path), folder)
        self.client.set_tag(self.run_id, "fedmed.status", status)
        self.client.set_terminated(self.run_id, self.STATUS.get(status, "FINISHED"))

    def close(self) -> None:
        pass


def mlflow_uri(run_dir: Path, uri: str) -> str:
    """``tracking-uri`` as MLflow takes it: empty, the file store ``<run>/mlruns``; a plain path, a file store."""
    if not uri:
        return (Path(run_dir) / "mlruns").resolve().as_uri()
    if "://" not in uri and not uri.startswith(("file:", "databricks")):
        return Path(uri).resolve().as_uri()
    return uri


# --- the run's trackers, fed from a thread of their own -------------------------------------------------------------
class Tracking:
    """The trackers of one run. ``prior`` is the history before the first round this process logs (a resumed run's
    rounds): the rounds a tracker has not logged yet are logged first (from ``tracking.json``: a run that turns
    tracking on when it resumes gets its earlier rounds too)."""

    def __init__(self, cfg: JobConfig, prior: list[dict[str, Any]], class_names: list[str] | None = None):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.class_names = class_names
        self.trackers: list[Any] = []
        self.failures: dict[str, int] = {}
        self.best: tuple[int, float] | None = None
        self.last_round = 0
        self.warned_size = False
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="fedmed-tracking", daemon=True)
        self.thread.start()
        self._submit(self._open, [_detach(r) for r in prior])

    # --- called by the ServerApp's round saver ---------------------------------------------------------------
    def log_round(self, record: dict[str, Any]) -> None:
        self._submit(self._log_round, _detach(record))

    def close(self, status: str, timeout: float = CLOSE_TIMEOUT) -> None:
        """Log the end-of-run files and the status, and wait (at most ``timeout`` s) for the trackers to finish."""
        if not self.thread.is_alive():
            return
        self._submit(self._finish, status)
        self.jobs.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("tracking: the trackers were still busy %.0f s after the run ended; what they had not sent "
                        "is not logged", timeout)

    # --- in the worker thread -------------------------------------------------------------------------------
    def _submit(self, job: Callable, *args: Any) -> None:
        self.jobs.put((job, args))

    def _work(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, args = item
            try:
                job(*args)
            except Exception:  # never the run's end
                log.exception("tracking: unexpected error")

    def _call(self, tracker: Any, what: str, action: Callable, *args: Any) -> bool:
        try:
            action(*args)
        except Exception as error:
            count = self.failures.get(tracker.name, 0) + 1
            self.failures[tracker.name] = count
            drop = count >= FAILURES_TO_DROP
            log.error("tracking (%s): %s failed (%s: %s)%s", tracker.name, what, type(error).__name__,
                      str(error)[:500], "; it is left out for the rest of the run" if drop else "")
            if drop:
                self.trackers.remove(tracker)
                try:
                    tracker.close()
                except Exception:
                    pass
            return False
        self.failures[tracker.name] = 0
        return True

    def _read_state(self) -> dict[str, Any]:
        try:
            state = json.loads((self.run_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _save_state(self) -> None:
        state = self._read_state()
        for tracker in self.trackers:
            entry = state.setdefault(tracker.name, {})
            entry["last-round"] = self.last_round
            if hasattr(tracker, "state"):
                entry.update(tracker.state())
        try:
            _write(self.run_dir / STATE_FILE, json.dumps(state, indent=1) + "\n")
        except OSError as error:
            log.warning("tracking: %s not written (%s)", self.run_dir / STATE_FILE, error)

    def _open(self, prior: list[dict[str, Any]]) -> None:
        state = self._read_state()
        done = prior[-1]["round"] if prior else 0
        first_steps = {}
        for name in requested(self.cfg):
            logged = int(state.get(name, {}).get("last-round", 0) or 0)
            try:
                if name == "tensorboard":
                    first = min(logged, done) + 1
                    tracker = TensorBoardTracker(self.run_dir, self.cfg, first)
                else:
                    tracker = MlflowTracker(self.run_dir, self.cfg, state.get(name, {}), resuming=bool(prior))
                    first = min(logged, done) + 1 if tracker.continued else 1
            except Exception as error:
                log.error("tracking (%s): could not start (%s: %s); the run goes on without it", name,
                          type(error).__name__, str(error)[:500])
                continue
            self.trackers.append(tracker)
            first_steps[name] = first
        for record in prior:
            self._log_round(record, only={name for name, first in first_steps.items() if record["round"] >= first},
                            save=False)
        self.last_round = done
        if self.trackers:
            self._save_state()

    def _log_round(self, record: dict[str, Any], only: set[str] | None = None, save: bool = True) -> None:
        step = record["round"]
        if self.cfg.select_by:
            direction, path = parse_selection(self.cfg.select_by)
            value = record_value(record, path)
            scored = model_round(step, path)
            if value is not None and scored >= 1 and better(value, self.best[1] if self.best else None, direction):
                self.best = (scored, value)
        scalars = round_scalars(record, self.class_names)
        if self.best:
            scalars["best/value"], scalars["best/round"] = self.best[1], float(self.best[0])
        if len(scalars) > MAX_SCALARS:
            if not self.warned_size:
                log.warning("tracking: round %d has %d numbers; the first %d of each round are logged", step,
                            len(scalars), MAX_SCALARS)
                self.warned_size = True
            scalars = dict(list(scalars.items())[:MAX_SCALARS])
        texts = round_texts(record)
        for tracker in list(self.trackers):
            if only is not None and tracker.name not in only:
                continue
            if tracker.name == "mlflow":
                self._call(tracker, f"round {step}", tracker.log_round, step, scalars, texts, record)
            else:
                self._call(tracker, f"round {step}", tracker.log_round, step, scalars, texts)
        if save:
            self.last_round = step
            self._save_state()

    def _finish(self, status: str) -> None:
        files = [self.run_dir / name for name in ("summary.md", "metrics.jsonl", "config.json", "cross_site.md",
                                                   "cross_site.json")]
        files += sorted((self.run_dir / "plots").glob("*.png"))
        files = [path for path in files if path.is_file()]
        for tracker in list(self.trackers):
            if self._call(tracker, "the end of the run", tracker.finish, self.run_dir, status, self.last_round, files):
                continue
            try:
                tracker.close()
            except Exception:
                pass
        self.trackers = []
