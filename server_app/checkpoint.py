"""Round checkpoints: the global model and all strategy state as named arrays in one ``.npz`` file.

Written to a temporary file and renamed, so a checkpoint on disk is always whole; loading never
unpickles anything. ``checkpoints/round-00007.npz`` holds the state after round 7.

With ``select-by``, ``checkpoints/best.npz`` holds the state after the best round so far by that metric, in the
same form (so ``fedmed evaluate``, ``export-int8`` and ``resume-from`` read it as any checkpoint), with
``best/round``, ``best/metric`` (``max:test.dice``) and ``best/value`` beside it. ``keep-checkpoints`` never
removes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import zipfile
from pathlib import Path

import numpy as np

log = logging.getLogger("fedmed")
_PATTERN = re.compile(r"round-(\d+)\.npz$")
BEST = "best.npz"


class CheckpointError(ValueError):
    """A checkpoint that cannot be found or read; the message names the file."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _save_whole(target: Path, state: dict[str, np.ndarray]) -> Path:
    """``state`` into ``target`` through a temporary file and a rename: the file on disk is always whole."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.stem}.{os.getpid()}.tmp.npz")
    try:
        np.savez(partial, **state)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):  # (a folder made read-only: the write's own error is the one to report)
            partial.unlink(missing_ok=True)  # the previous checkpoints stay as they were
        raise
    return target


def save_checkpoint(run_dir: Path, rnd: int, state: dict[str, np.ndarray], keep: int = 2) -> Path:
    target = _save_whole(checkpoint_dir(run_dir) / f"round-{rnd:05d}.npz", state)
    for old in list_checkpoints(run_dir)[:-(keep + 1)]:
        try:
            old.unlink(missing_ok=True)
        except OSError as error:  # the new checkpoint is written all the same
            log.warning("%s: an old checkpoint could not be removed (%s)", old, error)
    return target


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or the latest checkpoint of a run folder."""
    path = Path(path)
    if path.is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: no checkpoints (expected {checkpoint_dir(path)}/round-NNNNN.npz)")
    return found[-1]


def read_checkpoint(file: Path) -> dict[str, np.ndarray]:
    """One checkpoint file's arrays, every float finite (CheckpointError naming the file otherwise)."""
    try:
        with np.load(file, allow_pickle=False) as archive:
            state = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        raise CheckpointError(f"{file}: cannot read checkpoint ({error})") from None
    for key, value in state.items():
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise CheckpointError(f"{file}: {key} holds NaN or Inf")
    return state


def load_checkpoint(path: str | Path) -> dict[str, np.ndarray]:
    """A checkpoint file, or a run folder's latest readable checkpoint: a damaged latest one (a crash while
    the disk filled, a copy cut short) falls back to the one before it, with a warning."""
    path = Path(path)
    if path.is_file():
        return read_checkpoint(path)
    candidates = list(reversed(list_checkpoints(path))) or [find_checkpoint(path)]
    problems = []
    for file in candidates:
        try:
            state = read_checkpoint(file)
        except CheckpointError as error:
            problems.append(str(error))
            continue
        if problems:
            log.warning("%s; resuming from the checkpoint before it, %s", "; ".join(problems), file)
        return state
    raise CheckpointError("; ".join(problems))


# --- the best round's model (select-by) ---------------------------------------------------------------------------
def best_path(run_dir: Path) -> Path:
    return checkpoint_dir(run_dir) / BEST


def save_best(run_dir: Path, rnd: int, state: dict[str, np.ndarray], metric: str, value: float) -> Path:
    """``checkpoints/best.npz``: ``state`` (a round checkpoint's arrays) with the round, the metric
    (``max:test.dice``) and its value; written whole or not at all."""
    extra = {"best/round": np.asarray(rnd, dtype=np.int64), "best/value": np.asarray(value, dtype=np.float64),
             "best/metric": np.frombuffer(metric.encode(), dtype=np.uint8)}
    return _save_whole(best_path(run_dir), {**state, **extra})


def read_best(path: Path) -> dict | None:
    """``{"round", "metric", "value", "file"}`` of a run folder's ``best.npz`` (or of that file), None when there is
    none or it cannot be read (a warning says why)."""
    path = Path(path)
    file = path if path.is_file() else best_path(path)
    if not file.is_file():
        return None
    try:
        with np.load(file, allow_pickle=False) as archive:
            return {"round": int(archive["best/round"]), "metric": archive["best/metric"].tobytes().decode(),
                    "value": float(archive["best/value"]), "file": file}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as error:
        log.warning("%s: not a readable best-model checkpoint (%s)", file, error)
        return None


def find_best(run: str | Path) -> Path:
    """A run folder's ``checkpoints/best.npz`` (CheckpointError saying why there is none)."""
    run = Path(run)
    if run.is_file():
        raise CheckpointError(f"--best: {run} is a file; give the run folder (its checkpoints/{BEST} is taken)")
    if read_best(run) is None:
        raise CheckpointError(f"--best: {run} has no best model ({best_path(run)}); the run must select one with "
                              "select-by, e.g. select-by='test.dice' or 'train.val-dice'")
    return best_path(run)
