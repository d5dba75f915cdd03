"""Helpers for tests that start real Flower processes; each process is stopped afterwards, with its whole process
tree (by PID, and by the launch mark its descendants inherit: see cli.launch)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from cli.launch import FlowerHome, ManagedProcess, free_port, run_log, start_superlink, submit_run, wait_for_run

TINY_JOB = {"synthetic-samples": 120, "image-size": 16, "batch-size": 16, "min-partition-size": 5,
            "round-timeout": 300.0}


@contextlib.contextmanager
def stopped_at_exit(*processes: ManagedProcess) -> Iterator[list[ManagedProcess]]:
    started = list(processes)
    try:
        yield started
    finally:
        left = {}
        for process in reversed(started):  # each with all it spawned (SuperExec, Ray, ClientApp processes)
            if outlived := process.stop():
                left[process.name] = outlived
        assert not any(p.running() for p in started)
        assert not left, f"processes outlived SIGKILL: {left}"


@contextlib.contextmanager
def simulation_superlink(tmp_path: Path) -> Iterator[FlowerHome]:
    home = FlowerHome(tmp_path / "flwr-home")
    with stopped_at_exit(start_superlink(home, free_port(), simulation=True)):
        yield home


def run_to_completion(home: FlowerHome, run_config: dict, federation_config: dict | None = None,
                      connection: str = "local", timeout: float = 420.0) -> int:
    run_id = submit_run(home, connection, run_config, federation_config)
    status = wait_for_run(home, connection, run_id, timeout)
    assert status == "finished:completed", f"run {run_id} ended {status}:\n{run_log(home, connection, run_id)[-4000:]}"
    return run_id
