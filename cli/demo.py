"""``fedmed demo``: what federated training gives hospitals whose data differ, in a few minutes on a CPU.

Three hospitals hold generated skin-lesion-like images (``common/data/synthetic.py``: four lesion textures) split by
a Dirichlet draw over the classes (alpha 0.5, as in the benchmarks), so each holds mostly two of the four classes.
The same network, data and budget are trained three ways: each hospital alone (local training, in this process),
FedAvg and FedProIn (each a run in Flower's simulation engine). The server's held-out test set (all four classes)
scores every model after every round; the demo prints a comparison table and writes it, with a plot of the
curves, to ``results/demo-<time>/``.

The settings are chosen to be stable, so that what a newcomer sees does not depend on the CPU's arithmetic:
MONAI's ResNet-18 at a quarter width, Adam at 1e-4, 2 local epochs a round, 10 rounds. The first demo (full width,
Adam at 1e-3, IID hospitals, 5 rounds) saw its hospitals' validation loss jump from 2 to 9 and ended at 0.754
accuracy on an AMD CPU and 0.958 on an Intel one; at 1e-4 the curves rise without a jump, and a change of the
arithmetic (kernels held to AVX2) moves the final accuracy by under 0.01. docs/results.md#the-demo has the
measurements and the settings tried.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

#: The demo's job (a run config); ``--rounds`` and ``--seed`` override theirs.
DEMO_RUN_CONFIG: dict[str, Any] = {
    "task": "classification", "dataset": "synthetic", "synthetic-samples": 1200, "image-size": 32,
    "partitioner": "dirichlet", "dirichlet-alpha": 0.5,
    "model": "resnet18", "resnet-width": 0.25,
    "learning-rate": 1e-4, "local-epochs": 2, "batch-size": 32, "num-server-rounds": 10,
}
#: The federated methods the demo runs in Flower, by strategy, with their names in the table.
FEDERATED = {"fedavg": "FedAvg", "fedproin": "FedProIn"}
LOCAL = "Local (each hospital alone)"
METRICS = ("accuracy", "f1_weighted", "mcc")

#: ``federate(strategy, run_config) -> (exit code, round records)``: one federated run of the demo
Federate = Callable[[str, dict[str, Any]], tuple[int, list[dict[str, Any]]]]


def demo_run_config(rounds: int, seed: int, out: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**DEMO_RUN_CONFIG, "num-server-rounds": rounds, "seed": seed, "results-dir": str(out),
            "state-dir": str(out / "state"), **(overrides or {})}


def flower_simulation(hospitals: int, home: Path, deadline: float) -> Federate:
    """Each federated run in Flower's simulation engine (``fedmed simulate``), its progress printed by round."""
    from cli.simulate import EXIT_TIMEOUT, simulate
    from server_app.results import read_history

    def federate(strategy: str, run_config: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
        left = deadline - time.monotonic()
        if left <= 0:
            return EXIT_TIMEOUT, []
        code = simulate(hospitals, {**run_config, "strategy": strategy, "run-name": strategy}, {}, home, left,
                        label=f"{FEDERATED[strategy]}: ", summary=False)
        run_dir = Path(run_config["results-dir"]) / strategy
        history = read_history(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        return code, history

    return federate


def train_locally(run_config: dict[str, Any], hospitals: int) -> list[dict[str, Any]]:
    """Each hospital alone, the same network, data and budget, in this process: per round, the mean over hospitals
    of their own models' test metrics and validation loss, and each hospital's test metrics."""
    from common.config import load_job_config
    from common.data.sources import server_test_set
    from common.engine.inprocess import simulated_sites
    from common.engine.references import train_alone
    from common.engine.round_engine import weighted_mean_metrics
    from common.methods.site import HospitalStateStore

    cfg = load_job_config({**run_config, "strategy": "fedavg", "run-name": "local"})
    test = server_test_set(cfg)
    histories = {}
    for site in simulated_sites(cfg, hospitals):
        site.state = HospitalStateStore(None, keep=1)  # in memory: nothing of it outlives the demo
        histories[site.name] = train_alone(cfg, site, test)
        final = histories[site.name][-1].get("test", {})
        print(f"{LOCAL}: {site.name} ({len(site.train)} training images) alone: "
              + ", ".join(f"{m}={final.get(m, float('nan')):.4f}" for m in METRICS), flush=True)
    records = []
    for index, first in enumerate(next(iter(histories.values()))):
        per_hospital = {name: history[index].get("test", {}) for name, history in histories.items()}
        losses = [history[index].get("train", {}).get("val-loss") for history in histories.values()]
        losses = [loss for loss in losses if loss is not None]
        records.append({"round": first["round"],
                        "test": weighted_mean_metrics([(1.0, m) for m in per_hospital.values()]),
                        "per_hospital": per_hospital,
                        "train": {"val-loss": sum(losses) / len(losses)} if losses else {}})
    return records


def comparison_rows(histories: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per method: the last round's test metrics, and the range of accuracy over the models the hospitals end with
    (local training: one model each; a federated method: one model for all)."""
    rows = []
    for name, history in histories.items():
        final = next((r for r in reversed(history) if "test" in r), {"round": 0, "test": {}})
        per_hospital = [m.get("accuracy") for m in final.get("per_hospital", {}).values()]
        rows.append({"method": name, "round": final["round"], **{m: final["test"].get(m) for m in METRICS},
                     "hospital-accuracy": (min(per_hospital), max(per_hospital)) if per_hospital else None})
    return rows


def render_comparison(rows: list[dict[str, Any]], hospitals: int, run_config: dict[str, Any]) -> str:
    def number(value) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    lines = [f"# fedmed demo: {hospitals} hospitals with different data, the same network and budget", "",
             f"Generated skin-lesion-like images (4 classes), split by Dirichlet(alpha="
             f"{run_config['dirichlet-alpha']}); {run_config['num-server-rounds']} rounds x "
             f"{run_config['local-epochs']} local epochs; seed {run_config['seed']}. Test metrics on the server's "
             "held-out test set (all four classes) after the last round.", "",
             "| method | rounds | accuracy | weighted F1 | MCC | accuracy of each hospital's model |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        spread = row["hospital-accuracy"]
        each = (f"{spread[0]:.3f} to {spread[1]:.3f}" if spread else "one model for all")
        lines.append(f"| {row['method']} | {row['round']} | {number(row['accuracy'])} | "
                     f"{number(row['f1_weighted'])} | {number(row['mcc'])} | {each} |")
    return "\n".join(lines) + "\n"


def plot_comparison(histories: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Test accuracy, and the hospitals' validation loss on their own validation data of the model each received
    (local training: its own), log scale, by round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (accuracy, loss) = plt.subplots(1, 2, figsize=(10, 4))
    for name, history in histories.items():
        tested = [r for r in history if r.get("test", {}).get("accuracy") is not None]
        accuracy.plot([r["round"] for r in tested], [r["test"]["accuracy"] for r in tested], marker="o", label=name)
        validated = [r for r in history if r.get("train", {}).get("val-loss") is not None]
        loss.plot([r["round"] for r in validated], [r["train"]["val-loss"] for r in validated], marker="o",
                  label=name)
    accuracy.set(title="global test set: accuracy", xlabel="round", ylim=(0, 1))
    loss.set(title="hospitals' validation loss on their own data\n(FedProIn: of its prototype-distance scores)",
             xlabel="round", yscale="log")
    for axis in (accuracy, loss):
        axis.grid(alpha=0.3)
        axis.xaxis.get_major_locator().set_params(integer=True)
    accuracy.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run_demo(hospitals: int, rounds: int, seed: int, out: Path, federate: Federate,
             overrides: dict[str, Any] | None = None) -> int:
    """The federated runs, then local training; the table printed and written with the plot to ``out``. Returns
    the first failing run's exit code (its partial results stay), else 0."""
    run_config = demo_run_config(rounds, seed, out, overrides)
    histories: dict[str, list[dict[str, Any]]] = {}
    for strategy, name in FEDERATED.items():
        code, history = federate(strategy, run_config)
        if code != 0:
            print(f"fedmed demo: the {name} run did not complete; results so far in {out}", file=sys.stderr)
            return code
        histories[name] = history
    histories = {LOCAL: train_locally(run_config, hospitals), **histories}
    out.mkdir(parents=True, exist_ok=True)
    table = render_comparison(comparison_rows(histories), hospitals, run_config)
    (out / "comparison.md").write_text(table)
    (out / "comparison.json").write_text(json.dumps({"run-config": run_config, "histories": histories}, indent=1,
                                                    default=str) + "\n")
    plot_comparison(histories, out / "comparison.png")
    print("\n" + table)
    print(f"Results: {out} (comparison.md, comparison.png; each federated run's folder: "
          f"{', '.join(FEDERATED)})")
    return 0


def demo(hospitals: int, rounds: int, seed: int, home: Path, timeout: float, results_dir: Path) -> int:
    """``fedmed demo``: the comparison above, its federated runs in Flower's simulation engine."""
    from common.config import load_job_config

    out = Path(results_dir).resolve() / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    if Path(results_dir).exists() and not Path(results_dir).is_dir():
        print(f"fedmed demo: --results {results_dir}: not a folder (the demo writes a folder of results there); "
              "nothing was started", file=sys.stderr)
        return 2
    load_job_config(demo_run_config(rounds, seed, out))  # a bad --rounds or --seed stops here, before anything runs
    if hospitals < 2:
        print(f"fedmed demo: --hospitals {hospitals}: the demo needs at least 2 hospitals to federate; nothing was "
              "started", file=sys.stderr)
        return 2
    return run_demo(hospitals, rounds, seed, out, flower_simulation(hospitals, home, time.monotonic() + timeout))
