"""Orchestration overhead per round against the number of hospitals, fedmed next to a stock Flower FedAvg app.

Overhead = a round's wall time minus the hospitals' own compute time in it (the slowest hospital in a
deployment, where hospitals work in parallel; the sum in a simulation on this machine, where Ray
runs one virtual hospital at a time). Both apps train the same ~25k-parameter CNN on the same
generated data, so the difference is orchestration: fedmed sends one message per hospital per
round (the hospital evaluates the received model inside its training reply) and polls for replies
every 0.25 s at first instead of every 3 s; both send the model in Flower's records: stock one ``Array``
per tensor, fedmed as shipped one float32 ``Array`` for the whole model (``message-arrays='auto'``),
``fedmed-per-tensor`` one per tensor, ``fedmed-packed`` one ``.npz`` Array. fedmed's hospitals run
``fedmed-supernode`` (deploy/fedmed_supernode.py: Flower's SuperNode with short polls, and one long-lived
ClientApp process beside it, torch and the data kept loaded), ``fedmed-flower-waits`` with the SuperNode's
waits as Flower has them; ``fedmed-superexec``: on stock
SuperNodes, a ClientApp process per message handing the work to the hospital's warm worker;
``fedmed-no-worker``: the same with ``warm-worker=false``, all work in each message's own process.

    python -m benchmarks.overhead.run                       # loopback deployment + simulation
    python -m benchmarks.overhead.run --deployment 2 4 --simulation 2 10 50 100 --rounds 6
    python -m benchmarks.overhead.run --deployment --simulation --arrays 1 20 120   # the cost of one Array
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import cpu_name
from cli.launch import (
    FlowerHome,
    exit_on_termination,
    free_port,
    marked_processes,
    run_log,
    start_superlink,
    start_supernode,
    submit_run,
    wait_for_run,
)
from common.config import JobConfig
from common.data.export import export_partitions
from server_app.results import read_history

from .memory import PeakMemory, role_of
from .profile import summarise_profile

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
SAMPLES_PER_HOSPITAL = 80
#: stock Flower FedAvg on stock SuperNodes; fedmed as deploy/ starts it (``fedmed-supernode``: one long-lived
#: ClientApp process per hospital, short polls; ``message-arrays='auto'``), the same with one Array per tensor and
#: with each array group packed into one Array, and with the SuperNode's own waits as Flower has them (3 s between
#: empty polls...); fedmed on stock SuperNodes (Flower's SuperExec, a ClientApp process per message) with each
#: hospital's warm worker, and without it (``warm-worker=false``)
APPS = ("stock", "fedmed", "fedmed-flower-waits", "fedmed-per-tensor", "fedmed-packed", "fedmed-superexec",
        "fedmed-no-worker")
LAYOUT_OF = {"fedmed-per-tensor": "per-tensor", "fedmed-packed": "packed"}  # message-arrays; the others: auto
SUPERNODE_ENV = {"fedmed-flower-waits": {"FEDMED_SUPERNODE_POLL": "flower"}}  # fedmed-supernode with Flower's waits
ON_STOCK_SUPERNODES = ("stock", "fedmed-superexec", "fedmed-no-worker")
#: process kinds (benchmarks/overhead/memory.py) that run at the hospitals
HOSPITAL_ROLES = ("supernode", "superexec", "clientapp", "clientapp executor", "warm worker")
IMAGE_SIZE = 16
#: glibc malloc settings, inherited by every process a run starts: named in the report when set
ALLOCATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")
LARGE_MODEL_SAMPLES = 40  # per hospital: the large-model rows measure traffic and memory, not learning


def fedmed_job(hospitals: int, rounds: int, results: Path, **extra) -> dict:
    return {"model": "small-cnn", "image-size": IMAGE_SIZE, "batch-size": 16, "num-server-rounds": rounds,
            "min-available-hospitals": hospitals, "min-train-hospitals": min(2, hospitals), "evaluate-every": 1000,
            "val-fraction": 0.1, "min-partition-size": 5, "run-name": "overhead", "results-dir": str(results),
            "round-timeout": 900.0, **extra}


def fedmed_rounds(run_dir: Path, parallel: bool) -> list[dict]:
    rows = []
    for record in read_history(run_dir):
        compute = [m.get("hospital-seconds", 0.0) for m in record["hospital_metrics"].values()]
        starts = [m.get("clientapp-start-seconds", 0.0) for m in record["hospital_metrics"].values()]
        busy = max(compute) if parallel else sum(compute)
        rows.append({"round": record["round"], "seconds": record["seconds"], "hospital-seconds": busy,
                     "clientapp-start-seconds": max(starts, default=0.0)})
    return rows


def until_finished(home: FlowerHome, connection: str, run_id: int, what: str, timeout: float = 3600) -> None:
    """Wait for the run; RuntimeError with the tail of its log unless it completed."""
    status = wait_for_run(home, connection, run_id, timeout=timeout)
    if status != "finished:completed":
        raise RuntimeError(f"{what} ended {status}:\n{run_log(home, connection, run_id)[-3000:]}")


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
                        "warm-worker": app != "fedmed-no-worker"} for i in range(hospitals)]
            run_config = fedmed_job(hospitals, rounds, work / "results", dataset="npz",
                                    **{"test-dir": str(sites / "test"), "message-arrays": LAYOUT_OF.get(app, "auto")})
            app_dir = HERE.parent.parent
        else:
            configs = [{"seed": i} for i in range(hospitals)]
            timings = work / "stock-timings.json"
            run_config = {"num-server-rounds": rounds, "timings-file": str(timings), "min-nodes": hospitals,
                          "samples-per-hospital": SAMPLES_PER_HOSPITAL, "image-size": IMAGE_SIZE}
            app_dir = HERE / "stock_app"
        for config in configs:
            nodes.append(start_supernode(home, f"127.0.0.1:{port}", free_port(), config,
                                         executor=app not in ON_STOCK_SUPERNODES, env=SUPERNODE_ENV.get(app)))
        until_finished(home, "bench", submit_run(home, "bench", run_config, app_dir=app_dir), f"{app} run")
    finally:
        for process in [*nodes, link]:
            process.stop()
    if app.startswith("fedmed"):
        return fedmed_rounds(work / "results" / "overhead", parallel=True)
    return json.loads(timings.read_text())


def run_simulation(hospitals: int, rounds: int, work: Path, profile: Path | None = None,
                   extra: dict | None = None) -> dict:
    """A simulation of ``hospitals`` virtual hospitals: its rounds, the seconds spent finding the hospitals, the
    peak memory of its processes and, with ``profile``, py-spy's samples of round 2 onwards written there.
    ``extra``: run-config keys over the benchmark's."""
    home = FlowerHome(work / "home")
    link = start_superlink(home, free_port(), simulation=True)
    results = work / "results" / "overhead"
    try:
        job = fedmed_job(hospitals, rounds, work / "results", **{"synthetic-samples": SAMPLES_PER_HOSPITAL * hospitals,
                                                                 "state-dir": str(work / "state"), **(extra or {})})
        with PeakMemory([link]) as peak:
            run_id = submit_run(home, "local", job, {"num-supernodes": hospitals})
            if profile is not None:
                record_profile(link, results, profile, after_round=rounds - 1)
            until_finished(home, "local", run_id, "simulation")
    finally:
        link.stop()
    history = read_history(results)
    return {"rows": fedmed_rounds(results, parallel=False), "identity_s": history[0].get("identity-seconds", 0.0),
            "peak_mb": peak.total, "peak_mb_by_role": peak.by_role}


def record_profile(link, results: Path, out: Path, after_round: int, seconds: float = 60.0) -> None:
    """py-spy's stack samples of the simulation process and its Ray actors once ``after_round`` rounds are done
    (the profiled round is left out of the timings)."""
    deadline, history = time.time() + 3600, results / "metrics.jsonl"
    while not history.exists() or len(history.read_text().splitlines()) < after_round:
        if time.time() > deadline:
            return
        time.sleep(1.0)
    simulation = [pid for pid in marked_processes([link.mark]) if role_of(pid) == "simulation"]
    if not simulation:
        print("no flwr-simulation process to profile", flush=True)
        return
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    subprocess.run([py_spy, "record", "--pid", str(simulation[0]), "--subprocesses", "--nonblocking",
                    "--format", "raw", "--rate", "20", "--duration", str(int(seconds)), "--output", str(out)],
                   check=False, capture_output=True)


def run_large_model(width: float, rounds: int, work: Path, hospitals: int = 2, extra: dict | None = None) -> dict:
    """A loopback deployment training a ResNet-18 of ``width`` (1.0: the standard 11 M parameters, 45 MB; 1.5:
    100 MB) on 32x32 generated images: round seconds and the peak memory of each process kind. ``extra``: run-config
    keys over the benchmark's."""
    home = FlowerHome(work / "home")
    port = free_port()
    link = start_superlink(home, port, simulation=False, connection="bench")
    sites = work / "sites"
    cfg = JobConfig(synthetic_samples=LARGE_MODEL_SAMPLES * hospitals, image_size=32, min_partition_size=5,
                    test_fraction=0.1)
    export_partitions(cfg, hospitals, sites)
    nodes = [start_supernode(home, f"127.0.0.1:{port}", free_port(),
                             {"hospital": f"hospital-{i:02d}", "data-dir": str(sites / f"hospital-{i:02d}"),
                              "state-dir": str(work / "state" / f"h{i}"), "device": "cpu"})
             for i in range(hospitals)]
    job = fedmed_job(hospitals, rounds, work / "results", dataset="npz", model="resnet18",
                     **{"resnet-width": width, "image-size": 32, "batch-size": 16, "test-dir": str(sites / "test"),
                        **(extra or {})})
    try:
        with PeakMemory([link, *nodes]) as peak:
            until_finished(home, "bench", submit_run(home, "bench", job, app_dir=HERE.parent.parent), "large-model run")
    finally:
        for process in [*nodes, link]:
            process.stop()
    history = read_history(work / "results" / "overhead")
    model_mb = statistics.median(t["down"] for r in history for t in r["traffic"].values()) / 1e6
    return {"width": width, "model_mb": model_mb, "hospitals": hospitals,
            **summarise(fedmed_rounds(work / "results" / "overhead", parallel=True)),
            "peak_mb_by_role": peak.by_role, "peak_mb": peak.total}


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
        until_finished(home, "bench", run_id, "echo run", timeout=1800)
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
            "overhead_s": statistics.median(r["seconds"] - r["hospital-seconds"] for r in steady),
            "clientapp_start_s": statistics.median(r.get("clientapp-start-seconds", 0.0) for r in steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployment", type=int, nargs="*", default=[2, 4], help="hospital counts on loopback")
    parser.add_argument("--simulation", type=int, nargs="*", default=[2, 10, 50, 100], help="virtual hospital counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--large-models", type=float, nargs="*", default=[], metavar="WIDTH",
                        help="ResNet-18 widths for the large-model rows (loopback, 2 hospitals), e.g. 0.25 1 1.5")
    parser.add_argument("--profile", type=int, metavar="HOSPITALS",
                        help="profile (py-spy) the simulation of this many hospitals from round 2 on")
    parser.add_argument("--apps", nargs="+", choices=APPS, default=list(APPS), help="deployment apps to run")
    parser.add_argument("--arrays", type=int, nargs="*", default=[1, 20, 120],
                        help="Arrays per message for the per-Array cost (echo app; none: skip)")
    parser.add_argument("--out", type=Path, default=RESULTS / "overhead.md")
    args = parser.parse_args()
    if args.profile and not (shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists()):
        parser.error("--profile needs py-spy: pip install -e '.[profile]'")
    # SIGTERM (timeout, a scheduler) or SIGHUP unwind the finally blocks, which stop each SuperLink and SuperNode
    # with everything they spawned (cli.launch also stops leftovers at exit)
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
            profile = Path(tmp) / f"profile-{hospitals}.txt" if hospitals == args.profile else None
            run = run_simulation(hospitals, args.rounds, Path(tmp) / f"sim-{hospitals}", profile)
            rows = run.pop("rows")
            timed = rows[:-1] if profile is not None and len(rows) > 2 else rows  # the profiled round is slower
            measured[f"simulation/fedmed/{hospitals}"] = {**summarise(timed), **run, "per_round": rows,
                                                          "profiled_round": len(rows) if timed != rows else None}
            if profile is not None and profile.exists():
                measured["profile"] = {"hospitals": hospitals, **summarise_profile(profile)}
            print(f"simulation {hospitals} hospitals: {summarise(rows)}, {run}", flush=True)
            write_report(args, measured)
        for width in args.large_models:
            measured[f"large-model/{width:g}"] = run_large_model(width, args.rounds, Path(tmp) / f"large-{width:g}")
            print(f"large model {width:g}: {measured[f'large-model/{width:g}']}", flush=True)
            write_report(args, measured)
        if args.arrays:
            measured["arrays"] = []
            for in_memory in (False, True):
                state = "memory" if in_memory else "file"
                measured["arrays"] += run_array_costs(args.arrays, Path(tmp) / f"arrays-{state}", in_memory)
                print(f"arrays: {measured['arrays']}", flush=True)
                write_report(args, measured)
    print(args.out.read_text())


def write_report(args: argparse.Namespace, measured: dict[str, dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(measured, indent=2))
    allocator = "".join(f"{k}={os.environ[k]} " for k in ALLOCATOR_SETTINGS if k in os.environ)
    lines = ["# Orchestration overhead per round", "",
             f"`{allocator}python -m benchmarks.overhead.run --deployment {' '.join(map(str, args.deployment))} --apps "
             f"{' '.join(args.apps)} --simulation {' '.join(map(str, args.simulation))} --rounds {args.rounds}"
             + (f" --profile {args.profile}" if args.profile else "")
             + (f" --large-models {' '.join(f'{w:g}' for w in args.large_models)}" if args.large_models else "")
             + f" --arrays {' '.join(map(str, args.arrays))}".rstrip()  # bare --arrays: none (the default runs some)
             + "` "
             f"on a {os.cpu_count()}-core "
             f"{cpu_name()} machine; medians over rounds 2.. (round 1 includes start-up). Same ~25k-parameter CNN "
             f"and generated data ({SAMPLES_PER_HOSPITAL} samples per hospital, {IMAGE_SIZE}x{IMAGE_SIZE}) in both "
             "apps, both sending the model in Flower records: stock one `Array` per tensor (21); fedmed as shipped "
             "(`message-arrays='auto'`, flat in its own round loop) one float32 `Array` holding its 18 tensors "
             "(BatchNorm's step counters stay local), `fedmed-per-tensor` one `Array` per tensor, `fedmed-packed` "
             "one `.npz` `Array`. Every `Array` is two objects through the SuperLink (the Array and its data "
             "chunk), each a few milliseconds of the SuperLink's CPU.", "",
             "## Loopback deployment (one SuperLink, one SuperNode per hospital)", "",
             "Overhead = round - the slowest hospital's compute; of it, the time before our handler ran: on stock "
             "SuperNodes from the start of the message's fresh `flwr-clientapp` process (Python, importing Flower, "
             "installing the app from its FAB, pulling the message from the SuperNode one object per Array), with "
             "`fedmed-supernode` from the moment its executor acquired the task (the pull, which waits for the "
             "SuperNode to receive the message's objects from the SuperLink); the rest: polls (stock SuperNodes: "
             "3 s when idle, SuperExec 1 s, reply 0.5 s; `fedmed-supernode`: 0.1 s after a message growing to 3 s, "
             "reply 0.02 s; ServerApp: Flower's loop 3 s, fedmed's 0.25 s+), retries of objects not yet at the "
             "SuperLink (Flower: 1 s, 2 s, 4 s...; fedmed-supernode and fedmed's ServerApp: 0.05 s up to 0.5 s) "
             "and the transfers of the reply's objects (SuperNode to SuperLink to ServerApp).", "",
             "| hospitals | app | round s | hospitals' compute s | overhead s | of it before the handler s | "
             "overhead / stock overhead |", "|---|---|---|---|---|---|---|"]
    for hospitals in args.deployment:
        stock = measured.get(f"deployment/stock/{hospitals}")
        for app in APPS:
            row = measured.get(f"deployment/{app}/{hospitals}")
            if row is None:
                continue
            ratio = f"{row['overhead_s'] / stock['overhead_s']:.2f}" if stock else "-"
            start = f"{row['clientapp_start_s']:.1f}" if row.get("clientapp_start_s") else "-"
            lines.append(f"| {hospitals} | {app} | {row['round_s']:.1f} | {row['compute_s']:.1f} | "
                         f"{row['overhead_s']:.1f} | {start} | {ratio} |")
    lines += ["", "## Flower simulation engine (virtual hospitals, one at a time on this machine)", "",
              "Every hospital trains every round. Identities: seconds to learn which hospital each virtual node "
              "is, before round 1. Peak memory: the proportional set size of all the run's processes (SuperLink, "
              "simulation process with the ServerApp, Ray and its actors), sampled every second.", "",
              "| hospitals | identities s | round s | hospitals' compute s | overhead s | round s per hospital | "
              "peak memory MB | MB per hospital |", "|---|---|---|---|---|---|---|---|"]
    simulated = [(h, measured[f"simulation/fedmed/{h}"]) for h in args.simulation
                 if f"simulation/fedmed/{h}" in measured]
    for hospitals, ours in simulated:
        peak = ours.get("peak_mb", 0.0)
        lines.append(f"| {hospitals} | {ours.get('identity_s', 0.0):.1f} | {ours['round_s']:.1f} | "
                     f"{ours['compute_s']:.1f} | {ours['overhead_s']:.1f} | {ours['round_s'] / hospitals:.3f} | "
                     f"{peak:.0f} | {peak / hospitals:.1f} |")
    if len(simulated) > 1:
        plot_per_hospital(simulated, args.out.with_name(args.out.stem + "_simulation.png"))
        lines += ["", f"![seconds per hospital]({args.out.stem}_simulation.png)"]
    if measured.get("profile"):
        lines += ["", profile_table(measured["profile"])]
    large = [measured[f"large-model/{w:g}"] for w in args.large_models if f"large-model/{w:g}" in measured]
    if large:
        lines += ["", "## Large models (loopback deployment, 2 hospitals, ResNet-18 of growing width)", "",
                  "Peak memory (PSS, MB) of each process kind over the whole run; the hospitals' column adds up the "
                  "SuperNodes (with `fedmed-supernode`'s supervisors), every SuperExec (the SuperLink's too, about "
                  "100 MB), the ClientApp processes, the executors' and the warm workers. Round: median over "
                  "rounds 2..",
                  "", "| ResNet-18 width | model MB | round s | overhead s | of it before the handler s | "
                  "SuperLink MB | ServerApp MB | ServerApp / model | hospitals' processes MB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in large:
            roles = row["peak_mb_by_role"]
            hospital_side = sum(roles.get(k, 0.0) for k in HOSPITAL_ROLES)
            server = roles.get("serverapp", 0.0)
            lines.append(f"| {row['width']:g} | {row['model_mb']:.1f} | {row['round_s']:.1f} | "
                         f"{row['overhead_s']:.1f} | {row['clientapp_start_s']:.1f} | "
                         f"{roles.get('superlink', 0.0):.0f} | {server:.0f} | "
                         f"{server / row['model_mb']:.1f} | {hospital_side:.0f} |")
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


def plot_per_hospital(simulated: list[tuple[int, dict]], target: Path) -> None:
    """Round seconds and overhead seconds per hospital against the number of hospitals (flat: linear scaling)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [h for h, _ in simulated]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(counts, [m["round_s"] / h for h, m in simulated], marker="o", label="round")
    ax.plot(counts, [m["overhead_s"] / h for h, m in simulated], marker="s", label="overhead (round - compute)")
    ax.set_xscale("log")
    ax.set_xlabel("virtual hospitals")
    ax.set_ylabel("seconds per hospital")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)


def profile_table(profile: dict) -> str:
    lines = [f"## Where the time of a round goes ({profile['hospitals']} virtual hospitals, py-spy, "
             f"{profile['samples']} samples of the last round, which the table above leaves out)", "",
             "Share of the busy samples in each process kind; in each, the functions most often on the stack "
             "(inclusive, leaving out those on nearly every stack) and at its top (self).", "",
             "| process | share of samples | on the stack | at the top |", "|---|---|---|---|"]
    for kind in profile["processes"]:
        top = ", ".join(f"`{name}` {share:.0%}" for name, share in kind["top"])
        own = ", ".join(f"`{name}` {share:.0%}" for name, share in kind["self"])
        lines.append(f"| {kind['process']} | {kind['share']:.0%} | {top} | {own} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
