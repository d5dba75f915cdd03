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

from common.round_engine import RoundEngine
from strategies import strategy_arguments
from strategies.registry import strategy_class

from .checkpoint import save_checkpoint
from .evaluation import write_cross_site
from .results import render_summary, write_results
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
    write_results(cfg.run_dir, cfg.to_flat(), strategy.engine.history)
    log.info("finished %s\n%s", cfg.run_name, render_summary(cfg.to_flat(), strategy.engine.history))
    if strategy.cross_site is not None:
        log.info("cross-site evaluation (%s):\n%s", cfg.run_dir / "cross_site.md",
                 write_cross_site(cfg.run_dir, strategy.cross_site, cfg.task))
