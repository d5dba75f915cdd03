"""The ServerApp: validate the job, build the method's strategy from it, run the rounds, save after each one.

fedmed's ServerApp is one user of the strategies in ``strategies/``: the validated run config becomes
the strategy's constructor arguments (``strategies.strategy_arguments``).
"""

from __future__ import annotations

import logging
import sys
import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.config import JobConfig
from common.round_engine import RoundEngine
from strategies import strategy_arguments
from strategies.registry import strategy_class

from .checkpoint import list_checkpoints, save_checkpoint
from .evaluation import HEADLINE, render_cross_site, write_cross_site
from .results import finite_or_none, render_summary, write_results
from .run_config import load_run_config

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
    """After every round: a checkpoint first, then the result files rebuilt from the history.

    Plots take about a second to draw, so they are redrawn at most every ``plot_interval`` seconds
    (and after the last round), which keeps them off the critical path of short rounds.
    """

    def __init__(self, plot_interval: float = 30.0):
        self.plot_interval = plot_interval
        self.last_plot = 0.0

    def __call__(self, engine: RoundEngine, record: dict) -> None:
        """A write that fails (disk full, permissions changed) is logged and the run goes on: the checkpoints
        already written stay whole, and the next round tries again."""
        cfg = engine.cfg
        try:
            save_checkpoint(cfg.run_dir, record["round"], engine.state_dict(), keep=cfg.keep_checkpoints)
        except OSError as error:
            log.error("round %d: checkpoint not written to %s (%s); the earlier checkpoints are kept",
                      record["round"], cfg.run_dir, error)
        plots = record["round"] == cfg.num_server_rounds or time.time() - self.last_plot > self.plot_interval
        try:
            write_results(cfg.run_dir, cfg.to_flat(), engine.history, plots=plots)
        except OSError as error:
            log.error("round %d: result files not written to %s (%s)", record["round"], cfg.run_dir, error)
            return
        if plots:
            self.last_plot = time.time()


save_round = RoundSaver(plot_interval=0.0)  # for in-process runs that want every round drawn


@app.main()
def main(grid: Grid, context: Context) -> None:
    setup_logging()
    cfg, checkpoint = load_run_config(context.run_config)  # a bad config stops here, before round 1
    log.info("run %s: results in %s", cfg.run_name, cfg.run_dir)
    strategy_type = strategy_class(cfg.strategy)
    strategy = strategy_type(**strategy_arguments(strategy_type, cfg), on_round_end=RoundSaver())
    if checkpoint is not None:
        strategy.resume(checkpoint)
    strategy.start(grid)
    finish(cfg, strategy.engine.history, strategy.cross_site)


def finish(cfg: JobConfig, history: list[dict], cross_site: dict | None) -> None:
    """The result files once more after the last round, and the cross-site table. A results folder that became
    read-only or full since round 1 does not fail the run: the rounds it completed stay (the checkpoints already
    written, the result files of the last round that could be written), the error is logged naming the folder,
    and the summary and the cross-site scores still go to the log."""
    try:
        write_results(cfg.run_dir, cfg.to_flat(), history)
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
