"""A py-spy profile (``py-spy record --format raw --subprocesses``) in a few lines: which processes were busy,
and in each the functions most often on the stack (inclusive) and at its top (self).

Raw lines are ``process PID:"command";func (file.py:line);...;func (file.py:line) COUNT``, root first, a child
process's stack below its parents' process frames; py-spy leaves idle threads out, so the samples are where
CPU time went.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

from .memory import ROLES

FRAME = re.compile(r"^(?P<function>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def process_kind(frame: str) -> str:
    for role, words in ROLES:
        if any(word in frame for word in words):
            return role
    return "other"


def function_of(frame: str) -> str:
    """``train (/a/b/client_app/hospital.py:12)`` -> ``hospital.train``."""
    match = FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    return f"{Path(match['file']).stem}.{match['function']}"


def summarise_profile(path: Path, top: int = 6) -> dict:
    per_kind: Counter[str] = Counter()
    functions: dict[str, Counter[str]] = defaultdict(Counter)
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # a child's stack hangs below its parents' process frames: the last one is the process sampled
        own = max((i for i, frame in enumerate(frames) if frame.startswith("process ")), default=-1)
        kind = process_kind(frames[own]) if own >= 0 else "main"
        frames = frames[own + 1:]
        per_kind[kind] += int(count)
        if frames:
            leaves[kind][function_of(frames[-1])] += int(count)
        for name in {function_of(f) for f in frames if not f.startswith("thread ")}:
            functions[kind][name] += int(count)
    total = sum(per_kind.values()) or 1
    processes = []
    for kind, samples in per_kind.most_common():
        ranked = [(name, n / samples) for name, n in functions[kind].most_common() if n < 0.9 * samples][:top]
        own = [(name, n / samples) for name, n in leaves[kind].most_common(top)]
        processes.append({"process": kind, "share": samples / total, "top": ranked, "self": own})
    return {"samples": total, "processes": processes}
