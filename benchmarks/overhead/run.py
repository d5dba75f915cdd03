"""Orchestration overhead per round against the number of hospitals, fedmed next to a stock Flower FedAvg app.

Overhead = a round's wall time minus the hospitals' own compute time in it (the slowest hospital in a
deployment, where hospitals work in parallel; the sum in a simulation on this machine, where Ray
runs one virtual hospital at a time). Both apps train the same ~25k-parameter CNN on the same
generated data, so the difference is orchestration: fedmed sends one message per hospital per
round (the hospital evaluates the received model inside its training reply) and polls for replies
every 0.25 s at first instead of every 3 s; both send the model in Flower's records, one ``Array``
per tensor. ``fedmed-worker`` also keeps torch and the data loaded in each hospital's warm worker
(node config ``warm-worker=true``); ``fedmed-packed`` sends each array group as one Array
(``message-arrays='packed'``).

    python -m benchmarks.overhead.run                       # loopback deployment + simulation
    python -m benchmarks.overhead.run --deployment 2 4 --simulation 2 10 50 100 --rounds 6
    python -m benchmarks.overhead.run --deployment --simulation --arrays 1 20 120   # the cost of one Array
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from common.config import JobConfig
from common.data.export import export_partitions
from common.launch import (
    FlowerHome,
    exit_on_termination,
    free_port,
    run_log,
    start_superlink,
    start_supernode,
    submit_run,
    wait_for_run,
)
from server_app.results import read_history

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
SAMPLES_PER_HOSPITAL = 80
#: stock Flower FedAvg; fedmed as shipped; fedmed with each SuperNode's ``warm-worker=true``; fedmed with
#: ``message-arrays='packed'`` (each array group one Flower Array)
APPS = ("stock", "fedmed", "fedmed-worker", "fedmed-packed")
IMAGE_SIZE = 16


def fedmed_job(hospitals: int, rounds: int, results: Path, **extra) -> dict:
    return {"classifier": "small-cnn", "image-size": IMAGE_SIZE, "batch-size": 16, "num-server-rounds": rounds,
            "min-available-hospitals": hospitals, "min-train-hospitals": min(2, hospitals), "evaluate-every": 1000,
            "val-fraction": 0.1, "min-partition-size": 5, "run-name": "overhead", "results-dir": str(results),
            "round-timeout": 900.0, **extra}


def fedmed_rounds(run_dir: Path, parallel: bool) -> list[dict]:
    rows = []
    for record in read_history(run_dir):
        compute = [m.get("hospital-seconds", 0.0) for m in record["hospital_metrics"].values()]
        busy = max(compute) if parallel else sum(compute)
        rows.append({"round": record["round"], "seconds": record["seconds"], "hospital-seconds": busy})
    return rows


def run_deployment(app: str, hospitals: int, rounds: int, work: Path) -> list[dict]:
    home = FlowerHome(work / "home")
    port = free_port()
    link = start_superlink(home, port, simulation=False, connection="bench")
    nodes = []
    try:
        if app.startswith("fedmed"):
            sites = work / "sites"
            cfg = JobConfig(synthetic_samples=SAMPLES_PER_HOSPITAL * hospitals, image_size=IMAGE_SIZE,
                            min_partition_size=5, test_fraction=0.1)
            export_partitions(cfg, hospitals, sites)
            configs = [{"hospital": f"hospital-{i:02d}", "data-dir": str(sites / f"hospital-{i:02d}"),
                        "state-dir": str(work / "state" / f"h{i}"), "device": "cpu",
                        "warm-worker": app == "fedmed-worker"} for i in range(hospitals)]
            layout = "packed" if app == "fedmed-packed" else "per-tensor"
            run_config = fedmed_job(hospitals, rounds, work / "results", dataset="npz",
                                    **{"test-dir": str(sites / "test"), "message-arrays": layout})
            app_dir = HERE.parent.parent
        else:
            configs = [{"seed": i} for i in range(hospitals)]
            timings = work / "stock-timings.json"
            run_config = {"num-server-rounds": rounds, "timings-file": str(timings), "min-nodes": hospitals,
                          "samples-per-hospital": SAMPLES_PER_HOSPITAL, "image-size": IMAGE_SIZE}
            app_dir = HERE / "stock_app"
        for config in configs:
            nodes.append(start_supernode(home, f"127.0.0.1:{port}", free_port(), config))
        run_id = submit_run(home, "bench", run_config, app_dir=app_dir)
        status = wait_for_run(home, "bench", run_id, timeout=3600)
        if status != "finished:completed":
            raise RuntimeError(f"{app} run ended {status}:\n{run_log(home, 'bench', run_id)[-3000:]}")
    finally:
        for process in [*nodes, link]:
            process.stop()
    if app.startswith("fedmed"):
        return fedmed_rounds(work / "results" / "overhead", parallel=True)
    return json.loads(timings.read_text())


def run_simulation(hospitals: int, rounds: int, work: Path) -> list[dict]:
    home = FlowerHome(work / "home")
    link = start_superlink(home, free_port(), simulation=True)
    try:
        job = fedmed_job(hospitals, rounds, work / "results", **{"synthetic-samples": SAMPLES_PER_HOSPITAL * hospitals,
                                                                 "state-dir": str(work / "state")})
        run_id = submit_run(home, "local", job, {"num-supernodes": hospitals})
        status = wait_for_run(home, "local", run_id, timeout=3600)
        if status != "finished:completed":
            raise RuntimeError(f"simulation ended {status}:\n{run_log(home, 'local', run_id)[-3000:]}")
    finally:
        link.stop()
    return fedmed_rounds(work / "results" / "overhead", parallel=False)


def run_array_costs(counts: list[int], work: Path, in_memory: bool) -> list[dict]:
    """Round trips of messages with K Arrays (25k floats in all) through a loopback SuperLink and one SuperNode
    to an echoing ClientApp (``echo_app``): what one Array costs on the way, apart from any training. The
    SuperLink keeps its state in a database file (as deploy/ starts it) or, ``in_memory``, in memory."""
    home = FlowerHome(work / "home")
    port = free_port()
    link = start_superlink(home, port, simulation=False, connection="bench", in_memory=in_memory)
    node = start_supernode(home, f"127.0.0.1:{port}", free_port(), {})
    timings = work / "array-timings.json"
    try:
        run_id = submit_run(home, "bench", {"array-counts": ",".join(map(str, counts)), "timings-file": str(timings)},
                            app_dir=HERE / "echo_app")
        status = wait_for_run(home, "bench", run_id, timeout=1800)
        if status != "finished:completed":
            raise RuntimeError(f"echo run ended {status}:\n{run_log(home, 'bench', run_id)[-3000:]}")
    finally:
        for process in (node, link):
            process.stop()
    rows = json.loads(timings.read_text())
    return [{"arrays": k, "superlink_state": "memory" if in_memory else "file",
             **{key: statistics.median(r[key] for r in rows if r["arrays"] == k)
                for key in ("push_s", "round_trip_s", "handler_s")}} for k in counts]


def summarise(rows: list[dict]) -> dict:
    """Medians over rounds 2.. (round 1 includes start-up: app install, hospitals joining)."""
    steady = [r for r in rows if r["round"] >= 2] or rows
    return {"rounds": len(rows),
            "round_s": statistics.median(r["seconds"] for r in steady),
            "compute_s": statistics.median(r["hospital-seconds"] for r in steady),
            "overhead_s": statistics.median(r["seconds"] - r["hospital-seconds"] for r in steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployment", type=int, nargs="*", default=[2, 4], help="hospital counts on loopback")
    parser.add_argument("--simulation", type=int, nargs="*", default=[2, 10, 50, 100], help="virtual hospital counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--apps", nargs="+", choices=APPS, default=list(APPS), help="deployment apps to run")
    parser.add_argument("--arrays", type=int, nargs="*", default=[1, 20, 120],
                        help="Arrays per message for the per-Array cost (echo app; none: skip)")
    parser.add_argument("--out", type=Path, default=RESULTS / "overhead.md")
    args = parser.parse_args()
    # SIGTERM (timeout, a scheduler) or SIGHUP unwind the finally blocks, which stop each SuperLink and SuperNode
    # with everything they spawned (common.launch also stops leftovers at exit)
    exit_on_termination()

    measured: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fedmed-overhead-") as tmp:
        for hospitals in args.deployment:
            for app in args.apps:
                started = time.time()
                rows = run_deployment(app, hospitals, args.rounds, Path(tmp) / f"deploy-{app}-{hospitals}")
                measured[f"deployment/{app}/{hospitals}"] = {**summarise(rows), "per_round": rows}
                print(f"deployment {app} {hospitals} hospitals: {summarise(rows)} ({time.time() - started:.0f}s)",
                      flush=True)
                write_report(args, measured)  # after every measurement: an interrupted run keeps what it measured
        for hospitals in args.simulation:
            rows = run_simulation(hospitals, args.rounds, Path(tmp) / f"sim-{hospitals}")
            measured[f"simulation/fedmed/{hospitals}"] = {**summarise(rows), "per_round": rows}
            print(f"simulation {hospitals} hospitals: {summarise(rows)}", flush=True)
            write_report(args, measured)
        if args.arrays:
            measured["arrays"] = []
            for in_memory in (False, True):
                state = "memory" if in_memory else "file"
                measured["arrays"] += run_array_costs(args.arrays, Path(tmp) / f"arrays-{state}", in_memory)
                print(f"arrays: {measured['arrays']}", flush=True)
                write_report(args, measured)
    print(args.out.read_text())


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def write_report(args: argparse.Namespace, measured: dict[str, dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(measured, indent=2))
    lines = ["# Orchestration overhead per round", "",
             f"`python -m benchmarks.overhead.run --deployment {' '.join(map(str, args.deployment))} --apps "
             f"{' '.join(args.apps)} --simulation {' '.join(map(str, args.simulation))} --rounds {args.rounds}` "
             f"on a {os.cpu_count()}-core "
             f"{cpu_name()} machine; medians over rounds 2.. (round 1 includes start-up). Same ~25k-parameter CNN "
             f"and generated data ({SAMPLES_PER_HOSPITAL} samples per hospital, {IMAGE_SIZE}x{IMAGE_SIZE}) in both "
             "apps, and both send the model as Flower records, one `Array` per tensor (fedmed: 18 tensors, "
             "BatchNorm's step counters stay local; stock: 21), except `fedmed-packed` (`message-arrays='packed'`: "
             "one Array per array group).", "",
             "## Loopback deployment (one SuperLink, one SuperNode per hospital)", "",
             "| hospitals | app | round s | hospitals' compute s | overhead s | overhead / stock overhead |",
             "|---|---|---|---|---|---|"]
    for hospitals in args.deployment:
        stock = measured.get(f"deployment/stock/{hospitals}")
        for app in APPS:
            row = measured.get(f"deployment/{app}/{hospitals}")
            if row is None:
                continue
            ratio = f"{row['overhead_s'] / stock['overhead_s']:.2f}" if stock else "-"
            lines.append(f"| {hospitals} | {app} | {row['round_s']:.1f} | {row['compute_s']:.1f} | "
                         f"{row['overhead_s']:.1f} | {ratio} |")
    lines += ["", "## Flower simulation engine (virtual hospitals, one at a time on this machine)", "",
              "| hospitals | round s | hospitals' compute s | overhead s | overhead per hospital s |",
              "|---|---|---|---|---|"]
    for hospitals in args.simulation:
        ours = measured.get(f"simulation/fedmed/{hospitals}")
        if ours is not None:
            lines.append(f"| {hospitals} | {ours['round_s']:.1f} | {ours['compute_s']:.1f} | "
                         f"{ours['overhead_s']:.1f} | {ours['overhead_s'] / hospitals:.2f} |")
    if measured.get("arrays"):
        lines += ["", "## What one Flower Array costs (loopback, one SuperNode, an echoing ClientApp)", "",
                  "Messages of K Arrays holding 25k float32 values in all, to the SuperNode and back; medians of 4. "
                  "SuperLink state in a database file (`--database`, as `deploy/` and docker-compose start it) or "
                  "in memory (Flower's default).", "",
                  "| SuperLink state | Arrays per message | push to the SuperLink s | round trip s | "
                  "ClientApp handler s |", "|---|---|---|---|---|"]
        lines += [f"| {r['superlink_state']} | {r['arrays']} | {r['push_s']:.3f} | {r['round_trip_s']:.2f} | "
                  f"{r['handler_s']:.4f} |" for r in measured["arrays"]]
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
