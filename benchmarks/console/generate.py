"""A hospital's state folder as a year of federated work leaves it: an audit log of ``--lines`` lines holding
``--trainings`` trainings under local DP (each with its ``privacy-release`` and ``epsilon`` lines), the rest the
messages of many runs (identity queries, trainings, evaluations, refusals once the budget is spent), and the privacy
ledger that matches it. Written with the hospital's own writer (``common.trust.audit.AuditLog``), so the chain is
real and verifies.

    python -m benchmarks.console.generate OUT_FOLDER [--lines 100000] [--trainings 7600]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from common.trust.audit import AuditLog
from common.trust.ledger import LEDGER_FILE, RELEASE_EVENT

ROUNDS_PER_RUN = 20
POLICY = ('methods = ["fedavg"]\nmax-rounds-per-run = 50\n'
          "[local-dp]\nclip-norm = 0.5\nnoise-multiplier = 30.0\ndelta = 1e-5\nmax-epsilon = 10.0\n")


def generate(folder: Path, lines: int = 100_000, trainings: int = 7600, name: str = "hospital-00") -> Path:
    """Write ``folder``/audit.jsonl, privacy-ledger.json and policy.toml; returns the audit log's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "policy.toml").write_text(POLICY)
    digest = hashlib.sha256(POLICY.encode()).hexdigest()
    log = AuditLog(folder / "audit.jsonl", f"hospital:{name}")
    releases, batch, written, trained, run = [], [], 0, 0, 0
    head = "0" * 64  #: the server's audit head its messages carry (no server log here)

    def message(direction: str, kind: str, run_name: str, rnd: int | None, **extra) -> tuple[str, dict]:
        return "message", {"direction": direction, "kind": kind, "run": run_name, "round": rnd, "method": "fedavg",
                           "flower-run": 1000 + run, "peer-node": 1, "peer": "server",
                           "peer-audit-head": head if direction == "received" else None,
                           "sha256": hashlib.sha256(f"{run_name}{rnd}{kind}{direction}".encode()).hexdigest(),
                           "bytes": 48_000 if kind == "train" else 900, **extra}

    while written < lines:
        run += 1
        run_name = f"run-{run:04d}"
        round_lines = [message("received", "query", run_name, 0), message("sent", "query", run_name, 0,
                                                                         metrics=[], masked=False)]
        for rnd in range(1, ROUNDS_PER_RUN + 1):
            where = {"run": run_name, "round": rnd, "policy": "policy.toml", "policy-sha256": digest}
            round_lines.append(message("received", "train", run_name, rnd))
            if trained < trainings:
                trained += 1
                releases.append({"run": run_name, "round": rnd, "method": "fedavg", "noise-multiplier": 15.0,
                                 "distributed-dp": None})
                round_lines += [(RELEASE_EVENT, {**releases[-1], "ledger": str(folder / LEDGER_FILE)}),
                                ("policy", {"decision": "epsilon", "delta": 1e-5, "max-epsilon": 10.0, **where}),
                                message("sent", "train", run_name, rnd, metrics=["num-examples", "train-loss"],
                                        masked=False)]
            else:
                round_lines += [("policy", {"decision": "refused", "reason": "privacy budget spent", **where}),
                                message("sent", "train", run_name, rnd, error="hospital reported an error: refused "
                                        "by its policy (policy.toml): privacy budget spent")]
            round_lines += [message("received", "evaluate", run_name, rnd),
                            message("sent", "evaluate", run_name, rnd, metrics=["val-accuracy", "val-loss"],
                                    masked=False)]
        round_lines = round_lines[:lines - written]
        for record in log.append_many(round_lines, sync=False):
            if record["event"] == RELEASE_EVENT:
                batch.append(record)
        written += len(round_lines)
    times = {(r["run"], r["round"]): r["time"] for r in batch}
    ledger = [{**r, "time": times[r["run"], r["round"]]} for r in releases if (r["run"], r["round"]) in times]
    (folder / LEDGER_FILE).write_text(json.dumps({"releases": ledger}, indent=1))
    return folder / "audit.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--trainings", type=int, default=7600)
    args = parser.parse_args()
    path = generate(args.folder, args.lines, args.trainings)
    print(f"{path}: {args.lines} lines, {args.trainings} trainings")


if __name__ == "__main__":
    main()
