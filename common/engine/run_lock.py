"""A run folder (``results-dir/run-name``) is one run's while that run lives: its reply store (``.round-<n>``), audit
log, checkpoints and result files are written by one ServerApp only.

Two runs of one name at once used to share ``<run>/.round-<n>/``: each round's reply store removed the other's
folder, and one run ended in FileNotFoundError. Now a run holds an exclusive lock on ``<run>/.run.lock`` (``flock``:
released by the kernel when the process ends, however it ends) from before round 1; a second run finds it held and is
refused before round 1, or, where the run name was chosen for it (a timestamp), takes the next free name."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from common.settings import ConfigError

LOCK_FILE = ".run.lock"
_HELD: dict[Path, list[int]] = {}  # run folder -> [lock fd, claims in this process]


class RunFolderBusy(ConfigError):
    """Another process holds the run folder; the message names it (pid, host, when it started)."""


def claim(run_dir: Path) -> None:
    """Hold ``run_dir`` for this process (again: counted, one lock); RunFolderBusy when another process holds it."""
    key = Path(run_dir).resolve()
    if key in _HELD:
        _HELD[key][1] += 1
        return
    key.mkdir(parents=True, exist_ok=True)
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode(errors="replace")
        os.close(fd)
        raise RunFolderBusy(f"{key} is in use by a run in progress ({describe(holder)})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    _HELD[key] = [fd, 1]


def release(run_dir: Path) -> None:
    """One claim of ``run_dir`` less; the lock goes with the last."""
    key = Path(run_dir).resolve()
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        del _HELD[key]
        os.close(held[0])  # closing the descriptor drops the flock


def claim_run_name(results_dir: Path, name: str, chosen_for_it: bool) -> str:
    """The run name this run may use in ``results_dir``, claimed: ``name`` itself, or where it was ``chosen_for_it``
    (a timestamp, not the user's) and in use, the next free ``name-2``, ``name-3``...; a name the user chose that
    another run holds is refused (ConfigError), before round 1."""
    for attempt in range(1, 1000):
        candidate = name if attempt == 1 else f"{name}-{attempt}"
        try:
            claim(Path(results_dir) / candidate)
            return candidate
        except RunFolderBusy as busy:
            if not chosen_for_it:
                raise ConfigError(f"run-name {name!r}: {busy}. Two runs at once would share its reply store, audit "
                                  "log and checkpoints: choose another run-name, or wait for that run to end") from None
    raise ConfigError(f"run-name: {name!r} and 998 more names after it are in use in {results_dir}")


def describe(holder: str) -> str:
    """The holder a lock file names, in words."""
    try:
        info = json.loads(holder)
        return f"process {info['pid']} on {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "another process"
