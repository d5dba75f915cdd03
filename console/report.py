"""``fedmed console --report FILE``: one hospital's participation over a period as one static, self-contained HTML
page (no script, no link it needs, inline style) for its data-protection officer to sign and archive: the runs that
reached it, what left, epsilon against its budget, its refusals, and its audit chain's state with the head hashes
and the SHA-256 of every file read, so that what was checked can be checked again later.

Read as the page reads it (``console.hospital_view.read_hospital``), in a fresh process: the audit log is verified
whole, line by line.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from .hospital_view import HOSPITAL_FILES, read_hospital


class ReportError(ValueError):
    """The report cannot be written as asked (no such hospital, several and none named)."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def in_period(stamp: str, since: str, until: str) -> bool:
    day = (stamp or "")[:10]
    return (not since or day >= since) and (not until or day <= until)


def write_report(sources, path: Path, hospital: str = "", since: str = "", until: str = "") -> Path:
    """Write the report of ``hospital`` (the only one in ``sources`` when not named) to ``path``."""
    from .app import templates

    found = sources.hospitals()
    if not found:
        raise ReportError(f"no hospital's state folder in {sources.state} (give --state)")
    if not hospital:
        if len(found) > 1:
            raise ReportError(f"--state holds {len(found)} hospitals ({', '.join(found)}): name one with --hospital")
        hospital = next(iter(found))
    if hospital not in found:
        raise ReportError(f"--hospital {hospital}: not among {', '.join(found)}")
    folder = found[hospital]
    view = read_hospital(folder, policy_file=sources.policy(hospital), node_config=sources.node_config,
                         server_logs=sources.server_logs())
    runs = [run for run in view.runs if in_period(run.last, since, "") and in_period(run.first, "", until)]
    trainings = [t for t in view.privacy.trainings if in_period(t.time, since, until)]
    refusals = [r for r in view.refusals if in_period(r.time, since, until)]
    files = [(p, file_digest(p)) for p in [folder / name for name in HOSPITAL_FILES] + [view.policy.path]
             if p is not None and Path(p).is_file()]
    page = templates().env.get_template("report.html").render(
        view=view, runs=runs, trainings=trainings, refusals=refusals, files=files, since=since or "the first line",
        until=until or "the last line", written=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path
