"""The ServerApp: validate the job, build the method's strategy from it, run the rounds, save after each one
(checkpoint, best model, result files, status, trackers: ``RoundSaver``).

fedmed's ServerApp is one user of the strategies in ``strategies/``: the validated run config becomes
the strategy's constructor arguments (``strategies.strategy_arguments``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.config import ConfigError, JobConfig
from common.engine.round_engine import RoundEngine
from common.methods.registry import strategy_class
from strategies import strategy_arguments
from strategies.base import NoHospitalAggregated

from .checkpoint import (
    CheckpointError,
    best_path,
    checkpoint_dir,
    list_checkpoints,
    read_best,
    read_checkpoint,
    save_best,
    save_checkpoint,
)
from .evaluation import HEADLINE, render_cross_site, write_cross_site
from .results import (
    better,
    finite_or_none,
    model_round,
    parse_selection,
    record_value,
    render_summary,
    scores_received_model,
    write_results,
    write_status,
)
from .run_config import load_run_config
from .tracking import Tracking, check_installed, requested

log = logging.getLogger("fedmed")
app = ServerApp()


def setup_logging() -> None:
    if not any(getattr(h, "_fedmed", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s fedmed %(levelname)s: %(message)s", "%H:%M:%S"))
        handler._fedmed = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class RoundSaver:
    """After every round: a checkpoint first, the best round's model (``select-by``), then the result files rebuilt
    from the history, the run's status heartbeat, and the round to the trackers (``tracking``).

    Plots take about a second to draw, so they are redrawn at most every ``plot_interval`` seconds
    (and after the last round), which keeps them off the critical path of short rounds. One saver may serve several
    runs one after another (in-process benchmarks): what it keeps is by run folder. :meth:`start` opens a run before
    its first round (the ServerApp calls it; otherwise the first round does), :meth:`close` ends it.
    """

    def __init__(self, plot_interval: float = 30.0):
        self.plot_interval = plot_interval
        self.last_plot = 0.0
        self.started: set[Path] = set()
        self.tracking: dict[Path, Tracking] = {}
        self.class_names: dict[Path, list[str] | None] = {}
        self.warned: set[tuple[Path, str]] = set()

    def start(self, engine: RoundEngine, prior: list[dict] | None = None) -> None:
        """The run's status ``running``, its trackers opened (ConfigError when one is not installed), the best model
        of the run it resumes carried over. ``prior``: the rounds recorded before (default: the engine's history)."""
        cfg = engine.cfg
        key = Path(cfg.run_dir).resolve()
        if key in self.started:
            return
        self.started.add(key)
        prior = engine.history if prior is None else prior
        spec = getattr(getattr(engine.method, "task", None), "spec", None) or {}
        names = spec.get("class-names")
        self.class_names[key] = names.split(",") if isinstance(names, str) and names else None
        self.status(cfg, prior, "running")
        if cfg.select_by and cfg.resume_from:
            carry_best(cfg, prior)
        if requested(cfg):
            check_installed(cfg)
            self.tracking[key] = Tracking(cfg, prior, self.class_names[key])

    def __call__(self, engine: RoundEngine, record: dict) -> None:
        """A write that fails (disk full, permissions changed) is logged and the run goes on: the checkpoints
        already written stay whole, and the next round tries again. So does a tracker that fails."""
        cfg = engine.cfg
        key = Path(cfg.run_dir).resolve()
        if key not in self.started:
            try:
                self.start(engine, engine.history[:-1])
            except ConfigError as error:  # a tracker not installed, found only now: the rounds go on without it
                log.error("%s", error)
        state = engine.state_dict()
        try:
            save_checkpoint(cfg.run_dir, record["round"], state, keep=cfg.keep_checkpoints)
        except OSError as error:
            log.error("round %d: checkpoint not written to %s (%s); the earlier checkpoints are kept",
                      record["round"], cfg.run_dir, error)
        if cfg.select_by:
            self.keep_best(engine, record, state)
        plots = record["round"] == cfg.num_server_rounds or time.time() - self.last_plot > self.plot_interval
        try:
            write_results(cfg.run_dir, cfg.to_flat(), engine.history, plots=plots,
                          class_names=self.class_names.get(key))
        except OSError as error:
            log.error("round %d: result files not written to %s (%s)", record["round"], cfg.run_dir, error)
        else:
            if plots:
                self.last_plot = time.time()
        self.status(cfg, engine.history, "running")
        if key in self.tracking:
            self.tracking[key].log_round(record)

    def keep_best(self, engine: RoundEngine, record: dict, state: dict) -> None:
        """``checkpoints/best.npz`` holds the model the round's ``select-by`` metric scored when it beats the best
        one's: this round's, or for hospitals' ``val-*`` (they score the model they received) the round before's,
        read from its checkpoint."""
        cfg = engine.cfg
        direction, path = parse_selection(cfg.select_by)
        metric = f"{direction}:{path}"
        value = record_value(record, path)
        scored = model_round(record["round"], path)
        if value is None:
            table = record.get(path.split(".")[0])
            if isinstance(table, dict) and table and path.split(".")[0] != "hospital_metrics":
                self.warn_once(cfg, "select-by", f"select-by {cfg.select_by!r}: round {record['round']} records no "
                               f"such number ({path.split('.')[0]} holds {', '.join(sorted(table)[:12])}); no best "
                               "model is kept until a round does")
            return
        if scored < 1:  # round 1's val-* score the initial model, which has no checkpoint
            return
        current = read_best(cfg.run_dir)
        if current is not None and not best_still_holds(current, metric, engine.history, scored):
            log.warning("%s (round %d, %s=%s) is not of this run's history before round %d; replaced",
                        current["file"], current["round"], current["metric"], current["value"], scored)
            current = None
        if current is not None and not better(value, current["value"], direction):
            return
        try:
            if scored != record["round"]:
                state = read_checkpoint(checkpoint_dir(cfg.run_dir) / f"round-{scored:05d}.npz")
            save_best(cfg.run_dir, scored, state, metric, value)
        except (OSError, CheckpointError) as error:
            log.error("round %d: best model (round %d's, %s=%.6g) not written to %s (%s)", record["round"], scored,
                      path, value, cfg.run_dir, error)
            return
        log.info("round %d: best so far by %s (%.6g): round %d's model, %s", record["round"], path, value, scored,
                 best_path(cfg.run_dir))

    def warn_once(self, cfg: JobConfig, what: str, message: str) -> None:
        if (Path(cfg.run_dir), what) not in self.warned:
            self.warned.add((Path(cfg.run_dir), what))
            log.warning("%s", message)

    def status(self, cfg: JobConfig, history: list[dict], status: str, **extra) -> None:
        try:
            write_status(cfg.run_dir, status, history, cfg.num_server_rounds, **extra)
        except OSError as error:
            self.warn_once(cfg, "status", f"{cfg.run_dir / 'status.json'} not written ({error})")

    def close(self, cfg: JobConfig, history: list[dict], status: str, **extra) -> None:
        """The run's end: its status (completed, stopped, failed), and the trackers given the end-of-run files."""
        key = Path(cfg.run_dir).resolve()
        self.status(cfg, history, status, **extra)
        tracking = self.tracking.pop(key, None)
        if tracking is not None:
            tracking.close(status)
        self.started.discard(key)


def best_still_holds(best: dict, metric: str, history: list[dict], rnd: int) -> bool:
    """Whether a ``best.npz`` is of this run's models before round ``rnd``: the same metric, an earlier round, the
    value its round's record holds (not a round of a run resumed from an earlier checkpoint, later replaced)."""
    if best["metric"] != metric or not 0 < best["round"] < rnd:
        return False
    path = metric.split(":", 1)[1]
    recorded_in = best["round"] + (1 if scores_received_model(path) else 0)
    recorded = next((r for r in history if r.get("round") == recorded_in), None)
    value = record_value(recorded, path) if recorded else None
    return value is not None and math.isclose(value, best["value"], rel_tol=1e-9, abs_tol=1e-12)


def carry_best(cfg: JobConfig, prior: list[dict]) -> None:
    """A run resumed into another folder takes the best model of the run it continues, when that one is of the
    rounds it resumes from."""
    if read_best(cfg.run_dir) is not None or not prior:
        return
    source = Path(cfg.resume_from)
    folder = source.parent.parent if source.is_file() else source
    found = read_best(folder)
    if found is None or found["file"].resolve() == best_path(cfg.run_dir).resolve():
        return
    direction, path = parse_selection(cfg.select_by)
    if not best_still_holds(found, f"{direction}:{path}", prior, model_round(prior[-1]["round"], path) + 1):
        return
    target = best_path(cfg.run_dir)
    partial = target.with_name(f".{target.stem}.{os.getpid()}.tmp.npz")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found["file"], partial)
        os.replace(partial, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        log.error("the best model of %s (round %d) not copied to %s (%s)", folder, found["round"], target, error)
        return
    log.info("best model so far: round %d of %s (%s=%.6g), copied to %s", found["round"], folder, path,
             found["value"], target)


save_round = RoundSaver(plot_interval=0.0)  # for in-process runs that want every round drawn


@app.main()
def main(grid: Grid, context: Context) -> None:
    setup_logging()
    cfg, checkpoint = load_run_config(context.run_config)  # a bad config stops here, before round 1
    check_installed(cfg)  # so does a tracker that is not installed
    log.info("run %s: results in %s", cfg.run_name, cfg.run_dir)
    strategy_type = strategy_class(cfg.strategy)
    saver = RoundSaver()
    strategy = strategy_type(**strategy_arguments(strategy_type, cfg), on_round_end=saver)
    if checkpoint is not None:
        strategy.resume(checkpoint)
    saver.start(strategy.engine)
    closed_on_exit(saver, cfg, strategy.engine)
    try:
        strategy.start(grid)
        if strategy.nothing_aggregated:  # a Result for a user's own ServerApp; a failed run for ours
            raise NoHospitalAggregated(strategy.nothing_aggregated)
    except BaseException as error:
        stopped = not isinstance(error, Exception)  # KeyboardInterrupt, SystemExit: stopped, not failed
        saver.close(cfg, strategy.engine.history, "stopped" if stopped else "failed",
                    error=f"{type(error).__name__}: {error}"[:2000])
        raise
    finish(cfg, strategy.engine.history, strategy.cross_site, saver)


def closed_on_exit(saver: RoundSaver, cfg: JobConfig, engine: RoundEngine) -> None:
    """Flower ends a ServerApp whose SuperLink no longer knows its task (the SuperLink restarted) or that was told to
    stop through its exit handlers, and forces the exit a few seconds later (``os._exit``): before that, a run still
    open is marked ``stopped`` (interrupted) in status.json, not left ``running``."""
    from flwr.supercore.exit import add_exit_handler

    def interrupted() -> None:
        if Path(cfg.run_dir).resolve() in saver.started:
            saver.close(cfg, engine.history, "stopped", error="interrupted: Flower ended the ServerApp before the "
                        "run's last round (its SuperLink restarted or lost the run, or the run was stopped)")

    add_exit_handler(interrupted, run_before_force_exit=True)


def finish(cfg: JobConfig, history: list[dict], cross_site: dict | None, saver: RoundSaver | None = None) -> None:
    """The result files once more after the last round, and the cross-site table; then the run's status and its
    trackers' end (``saver``). A results folder that became
    read-only or full since round 1 does not fail the run: the rounds it completed stay (the checkpoints already
    written, the result files of the last round that could be written), the error is logged naming the folder,
    and the summary and the cross-site scores still go to the log."""
    try:
        finish_files(cfg, history, cross_site, saver)
    finally:
        status = "completed" if history and history[-1]["round"] >= cfg.num_server_rounds else "stopped"
        (saver or RoundSaver()).close(cfg, history, status)


def finish_files(cfg: JobConfig, history: list[dict], cross_site: dict | None, saver: RoundSaver | None) -> None:
    class_names = saver.class_names.get(Path(cfg.run_dir).resolve()) if saver else None
    try:
        write_results(cfg.run_dir, cfg.to_flat(), history, class_names=class_names)
    except OSError as error:
        try:
            written = [p.name for p in list_checkpoints(cfg.run_dir)]
        except OSError:
            written = []
        log.error("the final result files (metrics.jsonl, summary.md, plots) could not be written to %s (%s); the "
                  "checkpoints already written are kept there (%s)", cfg.run_dir, error,
                  ", ".join(written) if written else "none")
    log.info("finished %s\n%s", cfg.run_name, render_summary(cfg.to_flat(), history))
    if cross_site is None:
        return
    record = finite_or_none(cross_site)  # strict JSON: a score that is NaN is written as null
    where = cfg.run_dir / "cross_site.md"
    try:
        text = write_cross_site(cfg.run_dir, record, cfg.task)
    except OSError as error:
        log.error("the cross-site evaluation could not be written to %s (%s); its table follows here only",
                  cfg.run_dir, error)
        text, where = render_cross_site(record, HEADLINE[cfg.task]), "not written"
    log.info("cross-site evaluation (%s):\n%s", where, text)
