"""Peak memory of a Flower run's processes, by role (SuperLink, ServerApp, SuperNode, ClientApp, Ray actors).

A thread samples every second the proportional set size (PSS: shared pages split between the processes
that share them, so the parts add up) of every process the benchmark started, found by its launch mark
(``cli.launch``), and keeps the peak of each role and of their sum.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path

from cli.launch import ManagedProcess, marked_processes

#: role -> words of a command line that mark it (first match wins)
ROLES = (("serverapp", ("flwr-serverapp", "server_app")), ("simulation", ("flwr-simulation",)),
         ("ray actor", ("ray::", "default_worker.py")), ("ray", ("raylet", "gcs_server", "ray/", "dashboard")),
         ("clientapp", ("flwr-clientapp",)), ("warm worker", ("client_app.worker",)),
         ("clientapp executor", ("--fedmed-executor",)),  # fedmed-supernode's long-lived ClientApp process
         ("superexec", ("flower-superexec", "flwr-superexec")),
         ("supernode", ("flower-supernode", "fedmed_supernode.py", "fedmed-supernode")),
         ("superlink", ("flower-superlink",)))


def role_of(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    for role, words in ROLES:
        if any(word in command for word in words):
            return role
    return "other"


def pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


class PeakMemory:
    """``with PeakMemory(processes) as peak: ...``; then ``peak.by_role`` (MB) and ``peak.total`` (MB)."""

    def __init__(self, processes: list[ManagedProcess], interval: float = 1.0):
        self.processes, self.interval = processes, interval
        self.by_role: dict[str, float] = {}
        self.total = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        marks = [p.mark for p in self.processes if p.mark]
        now: dict[str, float] = defaultdict(float)
        for pid in marked_processes(marks):
            now[role_of(pid)] += pss_mb(pid)
        for role, mb in now.items():
            self.by_role[role] = max(self.by_role.get(role, 0.0), mb)
        self.total = max(self.total, sum(now.values()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
