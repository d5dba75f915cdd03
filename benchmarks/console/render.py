"""How long ``fedmed console`` takes to show a hospital with a year of audit log, and the memory it needs: a log of
``--lines`` lines and ``--trainings`` trainings (``benchmarks/console/generate.py``), each page served in-process
(Starlette's TestClient, the app ``fedmed console`` serves) in a fresh process per page so each peak is its own.

Rows: the hospital's page the first time (its log verified whole, line by line, and read once), the same page again
with no file changed (read from what the console keeps), again after one more round was appended to the log (only
the new lines read), and one run's page of messages. Time: the process's CPU seconds for the request (the machine is
shared, so wall time says more about the neighbours); memory: the resident set's peak above what the process held
before the first request (Python, Starlette, Flower, torch imported).

    python -m benchmarks.console.render [--lines 100000] [--trainings 7600]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def measure(folder: Path, page: str, warm: bool = False) -> dict:
    """One page, in this process: CPU seconds and peak memory of each request, the HTML's size."""
    import dp_accounting  # noqa: F401
    from starlette.testclient import TestClient

    import client_app.policy_rules  # noqa: F401  (a running console has these loaded before its first page)
    from common.trust.audit import AuditLog
    from console.app import Sources, create_app

    app = create_app(Sources(state=folder, policies=(("", folder / "policy.toml"),)))
    client = TestClient(app)
    client.get("/missing-page")  # the app's own start-up, not the page's
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started_up = time.process_time()  # the process's start: Python, its imports, the app
    row = {}
    if warm:  # as fedmed console starts: every log read before the first page is asked for
        started = time.process_time()
        app.state.views.warm()
        row["start-up: the log read"] = {"cpu-seconds": round(time.process_time() - started, 3), "html-bytes": 0,
                                         "peak-mb-above-start": round(resource.getrusage(resource.RUSAGE_SELF)
                                                                      .ru_maxrss / 1024 - base, 1)}

    def timed(name: str, url: str) -> None:
        started = time.process_time()
        response = client.get(url)
        assert response.status_code == 200, response.text[:400]
        row[name] = {"cpu-seconds": round(time.process_time() - started, 3), "html-bytes": len(response.content),
                     "peak-mb-above-start": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base,
                                                  1)}

    timed("first page", page)
    if page.endswith("hospital-00") and not warm:
        timed("again, no file changed", page)
        log = AuditLog(folder / "audit.jsonl", "hospital:hospital-00")
        log.append_many([("message", {"direction": "received", "kind": "train", "run": "new", "round": 1}),
                         ("message", {"direction": "sent", "kind": "train", "run": "new", "round": 1,
                                      "error": "refused by its policy (policy.toml): privacy budget spent"})])
        timed("after one more round was logged", page)
    row["start-mb"] = round(base, 1)
    row["start-cpu-seconds"] = round(started_up, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--trainings", type=int, default=7600)
    parser.add_argument("--measure", nargs=3, metavar=("FOLDER", "PAGE", "WARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1], args.measure[2] == "warm")))
        return
    from benchmarks.console.generate import generate
    from benchmarks.machine import cpu_name

    load_before = os.getloadavg()[0]  # the machine is shared: what else ran is part of the figure
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hospital-00"
        generate(folder, args.lines, args.trainings)
        size = (folder / "audit.jsonl").stat().st_size
        rows = {}
        for name, page, warm in (("hospital page, read when asked", "/hospital/hospital-00", "cold"),
                                 ("hospital page, read at start-up", "/hospital/hospital-00", "warm"),
                                 ("a run's page, read when asked", "/hospital/hospital-00/run/1", "cold")):
            out = subprocess.run([sys.executable, "-m", "benchmarks.console.render", "--measure", str(folder), page,
                                  warm], check=True, capture_output=True, text=True).stdout
            rows[name] = json.loads(out.strip().splitlines()[-1])
    load = (round(load_before, 2), round(os.getloadavg()[0], 2))
    record = {"cpu": cpu_name(), "load-average-1min": load, "lines": args.lines, "trainings": args.trainings,
              "log-mb": round(size / 1e6, 1),
              "pages": rows}
    stem = RESULTS / "console_render"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    table = ["| page | request | CPU seconds | peak MB above start | HTML |", "|---|---|---:|---:|---:|"]
    start_cpu = max(row["start-cpu-seconds"] for row in rows.values())
    start_mb = max(row["start-mb"] for row in rows.values())
    for name, row in rows.items():
        for request, numbers in row.items():
            if isinstance(numbers, dict):
                table.append(f"| {name} | {request} | {numbers['cpu-seconds']:.2f} | "
                             f"{numbers['peak-mb-above-start']:.0f} | {numbers['html-bytes'] / 1e3:.0f} kB |")
    text = (f"# fedmed console: a hospital's log of {args.lines:,} lines and {args.trainings:,} trainings\n\n"
            f"`python -m benchmarks.console.render` on {cpu_name()} (2 cores, shared; load average {load[0]:.1f} "
            f"before, {load[1]:.1f} after), log {size / 1e6:.1f} MB.\n\n"
            + "\n".join(table) + "\n\n"
            "The first request verifies the whole log once (each line's JSON, canonical form and SHA-256, as `fedmed "
            "audit verify` does: one JSON dump a line, the hash taken over the canonical text without its hash "
            "member) and reads it into the page's figures, epsilon counted in one pass; every later page is served "
            "from what the console keeps until a file changes, and a log that grew is read in its new lines only. "
            "`fedmed console` reads every log at start-up, before it serves (the rows read at start-up). Start-up "
            f"itself (Python, the console's imports, no torch): {start_cpu:.2f} CPU s, {start_mb:.0f} MB.\n")
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
