"""The run folder (results-dir/run-name) held by one strategy while its run lives (``common/engine/run_lock.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

from common.engine.run_lock import claim_run_name, release

log = logging.getLogger("fedmed")


class RunFolder:
    """The run folder one strategy holds (the reply store, the audit log, checkpoints): ``path``, None while it holds
    none. A run name ``chosen_for_it`` (a timestamp, not the user's) moves to the next free one where another run
    holds it; one the user chose is refused. ``HospitalStrategy.run_folder``."""

    def __init__(self, chosen_for_it: bool = False):
        self.chosen_for_it = chosen_for_it
        self.path: Path | None = None

    def claim(self, results_dir: str | Path, name: str) -> str:
        """Hold ``results_dir/name`` for this run, before round 1 (ConfigError where another run holds a name the user
        chose); the run name held, which the run then goes by. Held already: the name it holds."""
        if self.path is None:
            held = claim_run_name(Path(results_dir), name, self.chosen_for_it)
            if held != name:
                log.warning("run %s is in progress in %s: this run is %s", name, results_dir, held)
            self.path = Path(results_dir) / held
        return self.path.name

    def release(self) -> None:
        """Let the folder go (the lock goes with the last claim in this process)."""
        if self.path is not None:
            release(self.path)
            self.path = None
