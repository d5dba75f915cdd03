"""The run folder (results-dir/run-name) held by one strategy while its run lives (``common/engine/run_lock.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

from common.engine.run_lock import claim_run_name, release

log = logging.getLogger("fedmed")

class RunFolder:
    def claim_run_folder(self) -> None:
        """Hold the run folder (results-dir/run-name: the reply store, the audit log, checkpoints) for this run, before
        round 1 (common/engine/run_lock.py): a run name chosen for it moves to the next free one where another run holds
        it, one the user chose is refused (ConfigError)."""
        if self._run_folder is not None:
            return
        name = claim_run_name(Path(self.job.results_dir), self.job.run_name, self._name_chosen_for_it)
        if name != self.job.run_name:
            log.warning("run %s is in progress in %s: this run is %s", self.job.run_name, self.job.results_dir, name)
            self.change_job(run_name=name)
        self._run_folder = self.job.run_dir

    def release_run_folder(self) -> None:
        if self._run_folder is not None:
            release(self._run_folder)
            self._run_folder = None
