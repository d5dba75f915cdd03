"""The job as the ServerApp sees it: Flower's run config validated before round 1, the run named,
and a resumed run checked against the checkpoint it continues."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from common.config import ConfigError, JobConfig, load_job_config
from common.methods.base import unpack_json

from .checkpoint import checkpoint_dir, find_checkpoint, load_checkpoint

#: Keys that must equal the checkpoint's for a resumed run to continue the same experiment.
MUST_MATCH_ON_RESUME = ("task", "strategy", "seed", "dataset", "data-dir", "partitioner", "fraction-train",
                        "image-size")


def resolve(cfg: JobConfig) -> tuple[JobConfig, dict[str, Any] | None]:
    """Name the run and load the checkpoint to resume from (if any).

    A resumed run keeps the checkpoint's run name (so hospitals find their state) unless
    ``run-name`` is given, and may raise ``num-server-rounds`` to train longer.
    """
    checkpoint = None
    if cfg.resume_from:
        checkpoint = load_checkpoint(cfg.resume_from)
        previous = unpack_json(checkpoint["run/config"])
        for key in MUST_MATCH_ON_RESUME:
            if previous.get(key) != cfg.to_flat().get(key):
                raise ConfigError(f"resume-from: key {key!r} was {previous.get(key)!r} in "
                                  f"{find_checkpoint(cfg.resume_from)}, now {cfg.to_flat().get(key)!r}")
        if not cfg.run_name:
            cfg = cfg.model_copy(update={"run_name": previous["run-name"]})
    if not cfg.run_name:
        cfg = cfg.model_copy(update={"run_name": f"{cfg.task}-{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"})
    return cfg, checkpoint


def check_writable(run_dir: Path) -> None:
    """The run's results and checkpoint folders can be written (checked before round 1, not after it)."""
    for folder in (run_dir, checkpoint_dir(run_dir)):
        probe = folder / f".write-test-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise ConfigError(f"results-dir: cannot write {folder} as uid {os.getuid()} ({error.strerror or error}); "
                              "give this user write access to it or choose another results-dir") from None


def load_run_config(run_config: Mapping[str, Any]) -> tuple[JobConfig, dict[str, Any] | None]:
    """Validate Flower's run config (paths included), resolve the run and check that its folder can be written;
    raises ConfigError."""
    cfg, checkpoint = resolve(load_job_config(run_config, check_paths=True))
    check_writable(cfg.run_dir)
    return cfg, checkpoint
