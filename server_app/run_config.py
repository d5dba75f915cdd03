"""The job as the ServerApp sees it: Flower's run config validated before round 1, the run named,
and a resumed run checked against the checkpoint it continues."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

from common.config import ConfigError, JobConfig, fedmed_keys_of, flatten, load_job_config, upgrade_keys
from common.engine.run_lock import claim_run_name
from common.methods.base import unpack_json

from .checkpoint import CheckpointError, checkpoint_dir, load_checkpoint

log = logging.getLogger("fedmed")


def same_folder(cfg: JobConfig) -> bool:
    """Whether the run resumes in the folder its checkpoint came from (checkpoint file or run folder)."""
    source = Path(cfg.resume_from).resolve()
    run_dir = source.parent.parent if source.is_file() else source
    return run_dir == cfg.run_dir.resolve()

#: Keys a resumed run may change; every other key (data, split, model, method) must equal the checkpoint's,
#: or the run would continue another experiment than the one its history records.
MAY_CHANGE_ON_RESUME = frozenset({"run-name", "num-server-rounds", "round-timeout", "resume-from", "results-dir",
                                  "state-dir", "keep-checkpoints", "device", "evaluate-every", "message-arrays",
                                  "overwrite-run", "hospital-keys", "min-available-hospitals",
                                  "messages-in-flight", "tracking", "tracking-uri", "select-by", "audit-log"})
def comparable(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat run config with the task's default network named (``model=''`` and ``model='resnet18'`` build the same
    classifier), so that a resume compares networks, not spellings."""
    from common.models.networks import TASK_DEFAULT

    task = flat.get("task", "classification")
    return {**flat, "model": flat.get("model") or TASK_DEFAULT.get(task, "")}


RESULT_FILES = ("metrics.jsonl", "summary.md", "config.json", "checkpoints", "plots", "tensorboard", "mlruns",
                "status.json", "tracking.json")


def resolve(cfg: JobConfig) -> tuple[JobConfig, dict[str, Any] | None]:
    """Name the run and load the checkpoint to resume from (if any).

    A resumed run keeps the checkpoint's run name (so hospitals find their state) unless
    ``run-name`` is given, and may raise ``num-server-rounds`` to train longer.
    """
    checkpoint = None
    if cfg.resume_from:
        try:
            checkpoint = load_checkpoint(cfg.resume_from)
            previous = unpack_json(checkpoint["run/config"])
        except (CheckpointError, KeyError, ValueError) as error:
            raise ConfigError(f"resume-from: {error}") from None
        previous, now = comparable(upgrade_keys(flatten(previous))), comparable(cfg.to_flat())
        changed = [key for key in sorted(previous)  # keys added to fedmed since the checkpoint are not compared
                   if key not in MAY_CHANGE_ON_RESUME and previous[key] != now.get(key)]
        if changed:
            raise ConfigError("resume-from: " + "; ".join(
                f"key {key!r} was {previous.get(key)!r} in {cfg.resume_from}, now {now.get(key)!r}" for key in changed)
                + " (a resumed run must keep the data, split, model and method of the run it continues)")
        if not cfg.run_name:
            cfg = cfg.model_copy(update={"run_name": previous["run-name"]})
    if not cfg.run_name:
        cfg = cfg.model_copy(update={"run_name": f"{cfg.task}-{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"})
    return cfg, checkpoint


def claim_run_folder(cfg: JobConfig, resuming: bool) -> None:
    """A new run never writes over an earlier run's results: its folder must hold none, unless the run resumes
    (it continues its own history there) or ``overwrite-run`` says to replace them (they are removed first, so
    old checkpoints cannot be mistaken for the new run's)."""
    found = [name for name in RESULT_FILES if (cfg.run_dir / name).exists()]
    if not found or resuming:
        return
    if not cfg.overwrite_run:
        raise ConfigError(f"run-name: {cfg.run_dir} already holds the results of a run ({', '.join(found)}); "
                          "choose another run-name, resume it with resume-from, or set overwrite-run=true "
                          "(fedmed simulate --overwrite) to replace them")
    for name in found:
        target = cfg.run_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    log.warning("overwrite-run: removed %s from %s", ", ".join(found), cfg.run_dir)


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
    """Validate Flower's run config (paths included), resolve the run, check that its folder can be written and hold
    it for this run (another run of the same name in progress: refused, or for a name chosen for it the next free
    one); raises ConfigError. Keys that are not fedmed's are the app's own (a ClientApp of the hospitals' may read
    them): left alone; a near-miss of one of ours is refused (``common.config.fedmed_keys_of``)."""
    given = load_job_config(fedmed_keys_of(run_config), check_paths=True)
    cfg, checkpoint = resolve(given)
    try:
        name = claim_run_name(Path(cfg.results_dir), cfg.run_name, not given.run_name and checkpoint is None)
    except OSError:
        check_writable(cfg.run_dir)  # says which folder cannot be written, as whom
        raise
    # held until this ServerApp's process ends (common/engine/run_lock.py)
    cfg = cfg.model_copy(update={"run_name": name})
    claim_run_folder(cfg, resuming=checkpoint is not None and same_folder(cfg))
    check_writable(cfg.run_dir)
    return cfg, checkpoint
