"""The ServerApp's peak memory against the number of hospitals: every reply in memory (``reply-store='memory'``, the
path Flower's own loop takes) next to the streamed round (``'disk'``, the default in the strategy's own loop).

In-process rows: fedmed's FedAvgStrategy runs its own ``start()`` loop in a fresh process per row against a grid of
synthetic hospitals in the same process (``benchmarks/memory/grid.py``: random weights in the message's layout, built
when pulled), so the process's memory is the ServerApp's, plus the one reply being pulled, as Flower's gRPC grid
holds it. Peak: the process's resident set high-water mark (VmHWM, reset after setup); base: its resident set then
(Python, torch, Flower, the method, the server's test set); both in MB and the difference in model sizes.

Flower rows (``--deployment``, ``--simulation``): the same two settings in real Flower runs (benchmarks/overhead):
a loopback deployment of 2 hospitals training the large model (SuperLink and ServerApp separately), and Flower's
simulation of many virtual hospitals with the small model (its simulation process holds the ServerApp and the
in-memory SuperLink state together).

    python -m benchmarks.memory.run                                   # 2, 10, 50 x 100 MB; 1000 x small
    python -m benchmarks.memory.run --hospitals 2 10 --small 100 --deployment --simulation 1000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import cpu_name
from cli.launch import exit_on_termination

RESULTS = Path(__file__).resolve().parent.parent / "results"
STORES = ("memory", "disk")
LARGE = {"model": "resnet18", "resnet-width": 1.5, "image-size": 32}
SMALL = {"model": "small-cnn", "image-size": 16}


def status_mb_of(path: str, field: str) -> float:
    """A ``kB`` field of a /proc file, in MB."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def status_mb(field: str) -> float:
    return status_mb_of("/proc/self/status", field)


def measure(hospitals: int, store: str, model: dict, rounds: int, work: Path) -> dict:
    """One row, in this process: base and peak resident memory of a run of ``rounds`` rounds."""
    import numpy as np

    from benchmarks.memory.grid import SyntheticGrid
    from strategies import FedAvgStrategy

    job = {**model, "synthetic-samples": 60, "min-partition-size": 5, "run-name": f"{store}-{hospitals}",
           "results-dir": str(work), "reply-store": store, "min-available-hospitals": hospitals,
           "min-train-hospitals": 2, "evaluate-every": 1000, "audit-log": "none", "batch-size": 16}
    strategy = FedAvgStrategy(run_config=job)
    model_mb = sum(a.nbytes for a in strategy.engine.method.global_arrays.values()) / 1e6  # builds model, test set
    gc.collect()
    base = status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    started = time.time()
    strategy.start(SyntheticGrid(hospitals), num_rounds=rounds)
    peak = status_mb("VmHWM")
    history = strategy.engine.history
    assert all(len(r["aggregated"]) == hospitals for r in history), [r["refused"] for r in history]
    return {"hospitals": hospitals, "store": store, "model": model["model"], "model_mb": model_mb, "base_mb": base,
            "peak_mb": peak, "models_over_base": (peak - base) / model_mb, "seconds": time.time() - started,
            "round_s": float(np.median([r["seconds"] for r in history]))}


def run_row(hospitals: int, store: str, model: dict, rounds: int, work: Path) -> dict:
    """:func:`measure` in a process of its own (a clean high-water mark and allocator)."""
    out = work / f"{store}-{hospitals}-{model['model']}.json"
    command = [sys.executable, "-m", "benchmarks.memory.run", "--row", str(hospitals), store, json.dumps(model),
               str(rounds), str(work), str(out)]
    subprocess.run(command, check=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    return json.loads(out.read_text())


def unaffordable(rows: list[dict], hospitals: int, store: str, model: dict) -> dict | None:
    """A row not run, when the rows measured before it say it would take more than half the memory this machine has
    available now (a shared machine): its peak extrapolated from the largest such row, linear in the hospitals."""
    measured = [r for r in rows if r["store"] == store and r["model"] == model["model"] and "skipped" not in r]
    if not measured:
        return None
    last = max(measured, key=lambda r: r["hospitals"])
    predicted = last["base_mb"] + (last["peak_mb"] - last["base_mb"]) * hospitals / last["hospitals"]
    available = status_mb_of("/proc/meminfo", "MemAvailable")
    if predicted <= available / 2:
        return None
    return {**{k: last[k] for k in ("model", "model_mb", "base_mb")}, "hospitals": hospitals, "store": store,
            "peak_mb": predicted, "models_over_base": (predicted - last["base_mb"]) / last["model_mb"],
            "round_s": float("nan"), "skipped": f"not run: extrapolated from {last['hospitals']} hospitals, as it "
                                                f"would take ~{predicted / 1024:.1f} GB of the {available / 1024:.1f} "
                                                "GB available"}


def flower_rows(args: argparse.Namespace, work: Path, rows: list[dict], flower: dict) -> None:
    """The Flower runs (benchmarks/overhead), each store in turn, into ``flower`` (the report rewritten after each;
    those ``flower`` has already are not run again)."""
    from benchmarks.overhead.run import run_large_model, run_simulation

    for store in args.stores:
        key = f"deployment/{store}"
        if args.deployment and key not in flower:
            flower[key] = run_large_model(LARGE["resnet-width"], args.flower_rounds, work / f"deploy-{store}",
                                          extra={"reply-store": store})
            print(f"{key}: {flower[key]}", flush=True)
            write_report(args, rows, flower)
        for hospitals in args.simulation:
            key = f"simulation/{store}/{hospitals}"
            if key in flower:
                continue
            run = run_simulation(hospitals, args.flower_rounds, work / f"sim-{store}-{hospitals}",
                                 extra={"reply-store": store})
            flower[key] = {k: v for k, v in run.items() if k != "rows"}
            print(f"{key}: {flower[key]}", flush=True)
            write_report(args, rows, flower)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hospitals", type=int, nargs="*", default=[2, 10, 50], help="with the ~100 MB model")
    parser.add_argument("--small", type=int, nargs="*", default=[1000], help="hospital counts with the small model")
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each in-process row")
    parser.add_argument("--flower-rounds", type=int, default=1, help="rounds of each Flower run")
    parser.add_argument("--fresh", action="store_true", help="measure every row again (default: keep those in --out's "
                                                              "JSON, so an interrupted run goes on where it stopped)")
    parser.add_argument("--deployment", action="store_true", help="also a loopback deployment, 2 hospitals, 100 MB")
    parser.add_argument("--simulation", type=int, nargs="*", default=[], help="also Flower simulations, small model")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory.md")
    parser.add_argument("--row", nargs=6, help=argparse.SUPPRESS)  # one in-process row (run_row's subprocess)
    args = parser.parse_args()
    if args.row:
        hospitals, store, model, rounds, work, out = args.row
        Path(out).write_text(json.dumps(measure(int(hospitals), store, json.loads(model), int(rounds), Path(work))))
        return
    exit_on_termination()  # SIGTERM (a timeout) unwinds, stopping the Flower processes a run started
    saved = json.loads(args.out.with_suffix(".json").read_text()) \
        if args.out.with_suffix(".json").exists() and not args.fresh else {}
    kept = {(r["hospitals"], r["store"], r["model"]): r for r in saved.get("in-process", []) if "skipped" not in r}
    rows: list[dict] = []
    flower: dict = saved.get("flower", {})
    with tempfile.TemporaryDirectory(prefix="fedmed-memory-") as tmp:
        for model, counts in ((LARGE, args.hospitals), (SMALL, args.small)):
            for hospitals in counts:
                for store in args.stores:  # one heavy process at a time
                    row = kept.get((hospitals, store, model["model"])) or unaffordable(rows, hospitals, store, model) \
                        or run_row(hospitals, store, model, args.rounds, Path(tmp))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    write_report(args, rows, flower)
        if args.deployment or args.simulation:
            flower_rows(args, Path(tmp), rows, flower)
    print(args.out.read_text())


def write_report(args: argparse.Namespace, rows: list[dict], flower: dict) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"in-process": rows, "flower": flower}, indent=2))
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    command = (f"python -m benchmarks.memory.run --hospitals {' '.join(map(str, args.hospitals))} --small "
               f"{' '.join(map(str, args.small))} --rounds {args.rounds}"
               + (" --deployment" if args.deployment else "")
               + (f" --simulation {' '.join(map(str, args.simulation))} --flower-rounds {args.flower_rounds}"
                  if args.simulation or args.deployment else ""))
    lines = ["# The ServerApp's memory against the number of hospitals", "",
             f"`{command}` on a {os.cpu_count()}-core {cpu_name()} machine with {memory_gb:.0f} GB of memory. "
             "FedAvg, every hospital in every round; `memory`: every reply held until the round closes (Flower's own "
             "loop, and `reply-store='memory'`); `disk`: each reply screened as it arrives and kept on disk until the "
             "round closes (`reply-store='disk'`, the default in the strategy's own loop), the aggregate read back "
             "tensor by tensor. The same aggregate bit for bit (tests/test_streamed_rounds.py).", "",
             "## The ServerApp in-process (synthetic hospitals; peak resident memory of its process)", "",
             "A fresh process per row runs fedmed's `FedAvgStrategy.start()` against synthetic hospitals in the same "
             "process (`benchmarks/memory/grid.py`), which build each reply when the server pulls it. Base: the "
             "process after building the strategy (Python, torch, Flower, the model, the server's test set); peak: "
             "its resident high-water mark over the rounds (the last round's test-set evaluation included).", "",
             "| model | model MB | hospitals | replies | base MB | peak MB | peak - base MB | (peak - base) / model | "
             "round s |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        skipped = "skipped" in row
        peak = f"~{row['peak_mb']:.0f} ({row['skipped']})" if skipped else f"{row['peak_mb']:.0f}"
        lines.append(f"| {row['model']} | {row['model_mb']:.3g} | {row['hospitals']} | {row['store']} | "
                     f"{row['base_mb']:.0f} | {peak} | {'~' * skipped}{row['peak_mb'] - row['base_mb']:.0f} | "
                     f"{'~' * skipped}{row['models_over_base']:.1f} | "
                     f"{'-' if skipped else format(row['round_s'], '.1f')} |")
    if flower:
        lines += ["", "## Flower runs (benchmarks/overhead; peak PSS of each process kind, MB)", "",
                  "| run | replies | model MB | SuperLink MB | ServerApp MB | ServerApp / model | "
                  "simulation process MB | all processes MB |", "|---|---|---|---|---|---|---|---|"]
        for key, row in flower.items():
            kind, store = key.split("/")[:2]
            roles = row["peak_mb_by_role"]
            model_mb = row.get("model_mb") or next((r["model_mb"] for r in rows if r["model"] == SMALL["model"]), 0.0)
            server = roles.get("serverapp", 0.0)
            what = (f"loopback deployment, {row.get('hospitals', 2)} hospitals, ResNet-18 x{row.get('width', 1.5):g}"
                    if kind == "deployment" else f"simulation, {key.split('/')[2]} virtual hospitals, small CNN")
            simulation = roles.get("simulation", 0.0)
            lines.append(f"| {what} | {store} | {model_mb:.3g} | {roles.get('superlink', 0.0):.0f} | "
                         f"{f'{server:.0f}' if server else '-'} | {f'{server / model_mb:.1f}' if server else '-'} | "
                         f"{f'{simulation:.0f}' if simulation else '-'} | {row.get('peak_mb', 0.0):.0f} |")
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
