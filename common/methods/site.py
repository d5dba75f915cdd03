"""A hospital as the methods see it: its data, its device, its properties and its persistent memory."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger("fedmed")

class HospitalStateStore:
    """What a hospital must remember between the rounds it takes part in, in its own state folder.

    Saved once per round it trains in (``state-r00007.npz``, written atomically). Loading for
    round r returns the newest state saved *before* r, so when the server resumes from an
    earlier checkpoint the hospital replays from the matching state, and a SuperNode restart
    loses nothing. With ``folder=None`` the state lives in memory (tests, in-process runs).
    """

    _PATTERN = re.compile(r"state-r(\d+)\.npz$")

    def __init__(self, folder: str | Path | None, keep: int = 3):
        self.folder = Path(folder) if folder else None
        self.keep = keep
        self._memory: dict[int, dict[str, np.ndarray]] = {}
        self.loaded_round: int | None = None  # the round of the state last loaded, reported to the server

    def rounds(self) -> list[int]:
        if self.folder is None:
            return sorted(self._memory)
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := self._PATTERN.match(p.name)))

    def load(self, before_round: int) -> dict[str, np.ndarray] | None:
        """The newest state saved before ``before_round`` (None: none, the hospital starts from what it received).
        A damaged file (a disk error, a copy cut short) is renamed ``*.damaged`` with a warning naming it, and
        the one before it is used, so one bad file cannot fail every later round."""
        for rnd in reversed([r for r in self.rounds() if r < before_round]):
            if self.folder is None:
                self.loaded_round = rnd
                return dict(self._memory[rnd])
            path = self.folder / f"state-r{rnd:05d}.npz"
            try:
                with np.load(path, allow_pickle=False) as archive:
                    state = {key: archive[key] for key in archive.files}
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
                aside = path.with_name(path.name + ".damaged")
                os.replace(path, aside)
                log.warning("hospital state %s cannot be read (%s: %s); set aside as %s, using the state before it",
                            path, type(error).__name__, error, aside.name)
                continue
            self.loaded_round = rnd
            return state
        return None

    def save(self, rnd: int, arrays: dict[str, np.ndarray]) -> None:
        if self.folder is None:
            self._memory[rnd] = {k: np.array(v, copy=True) for k, v in arrays.items()}
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            target = self.folder / f"state-r{rnd:05d}.npz"
            partial = self.folder / f".state-r{rnd:05d}.{os.getpid()}.tmp.npz"
            np.savez(partial, **arrays)
            os.replace(partial, target)
        for old in self.rounds()[:-self.keep]:
            self._memory.pop(old, None)
            if self.folder is not None:
                (self.folder / f"state-r{old:05d}.npz").unlink(missing_ok=True)


@dataclass
class Site:
    """One hospital: ``train``/``val`` data (any container), device, properties, persistent state."""

    name: str
    train: Any
    val: Any
    device: torch.device = torch.device("cpu")
    properties: dict[str, Any] = field(default_factory=dict)
    state: HospitalStateStore = field(default_factory=lambda: HospitalStateStore(None))
    seed: int = 0

    def round_seed(self, rnd: int) -> int:
        """A seed for this hospital's randomness in round ``rnd``: the same on every rerun or resume."""
        digest = hashlib.sha256(f"{self.seed}|{self.name}|{rnd}".encode()).digest()
        return int.from_bytes(digest[:4], "little")


def build_site(cfg, name: str, *, partition_id: int | None = None, num_partitions: int | None = None,
               data_dir: str | None = None, state_dir: str | Path | None = None, device: str = "auto",
               properties: dict[str, Any] | None = None, node_arguments: str = "") -> Site:
    """Load a hospital's data and wrap it with its device and state folder."""
    from common.tasks import task_class

    seed = int.from_bytes(hashlib.sha256(f"{cfg.seed}|{name}|split".encode()).digest()[:4], "little")
    properties = task_class(cfg.task).hospital_properties(cfg, partition_id, dict(properties or {}))
    train, val = task_class(cfg.task).load_hospital_data(
        cfg, partition_id=partition_id, num_partitions=num_partitions, data_dir=data_dir,
        properties=properties, seed=seed, hospital=name, node_arguments=node_arguments)
    from common.devices import hospital_device

    return Site(name, train, val, hospital_device(device, partition_id), properties, HospitalStateStore(state_dir),
                seed=cfg.seed)
