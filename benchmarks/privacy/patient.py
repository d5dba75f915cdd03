"""What patient-level DP-SGD costs (common/trust/patient_dp.py): the same federation with no DP and with every
hospital's policy at epsilon 1, 3 and 8 per patient (delta 1e-5), side by side, and what each trick adds.

    python -m benchmarks.privacy.patient                          # the whole table: 2 data sets x IID, Dir(0.5) x
                                                                  # FedAvg, FedProIn x no DP, eps 1, 3, 8 x scratch,
                                                                  # pretrained x 3 seeds, and the tricks (a GPU's work)
    python -m benchmarks.privacy.patient --datasets blood --methods fedavg --starts scratch --epsilons 8 --seeds 0
    python -m benchmarks.privacy.patient --datasets blood --partitions iid --methods fedavg --starts scratch \
        --epsilons 8 --hospitals 1 2 5 --no-tricks                # the same patients in fewer, larger hospitals

Each finished run is ``<out>/runs/<row>.json`` and is skipped when the command is started again; the table
(``<out>/results.md``) is rebuilt from whatever runs exist and names each cell that has not run. Every hospital holds
the policy ``[patient-dp] target-epsilon = E, max-grad-norm = C, delta = 1e-5, unit = "patient"`` and its own ledger;
the noise is what spends E over the run's rounds (every hospital trains every round). The no-DP row is the same run
(the same GroupNorm network, data, split and seeds) training the same layers: "scratch" and "pretrained" every layer
with the task's own loop, "pretrained-head" the last linear layer alone through the same DP-SGD path and plan with the
clip and the noise out of reach (NO_PRIVACY). "pretrained" starts from the encoder trained centrally on the other
data set (benchmarks.fedproin.pretrain, with GroupNorm; a ResNet-18), and "pretrained-head" trains only its last
linear layer on that encoder, frozen.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.fedproin.pretrain import DATASETS, OTHER, pretrain
from benchmarks.machine import cpu_name
from common.config import JobConfig
from common.engine.inprocess import run_rounds, simulated_sites
from common.methods.registry import hospital_class
from common.methods.site import HospitalStateStore
from common.trust.enforcer import Enforcer, policed
from common.trust.ledger import PrivacyLedger
from common.trust.policy import PatientDP, Policy

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("fedmed")
HOSPITALS = 10
PARTITIONS = {"iid": {"partitioner": "iid"}, "dirichlet": {"partitioner": "dirichlet", "dirichlet_alpha": 0.5}}
PARTITION_NAMES = {"iid": "IID", "dirichlet": "Dir(0.5)"}
#: the job every row shares (CPU-sized: 28 px, 10 rounds); the DP rows add the plan below
JOB = {"image_size": 28, "num_server_rounds": 10, "local_epochs": 4, "batch_size": 32, "learning_rate": 1e-3,
       "fraction_train": 1.0, "min_partition_size": 10, "val_fraction": 0.0, "test_fraction": 0.2, "device": "cpu",
       "evaluate_every": 5}
MODELS = {"scratch": {"model": "small-cnn"}, "pretrained": {"model": "resnet18", "resnet_width": 0.25},
          "pretrained-head": {"model": "resnet18", "resnet_width": 0.25}}
#: what a start changes in the DP plan: "pretrained-head" trains the last linear layer alone on the frozen encoder,
#: with DP and without (the task's own loop trains every layer, so its no-DP row goes through DP-SGD's path),
#: and takes a larger step (tuned on blood cells, Dir(0.5), seed 0 at epsilon 8; docs/privacy.md lists the tries)
START_PLAN = {"pretrained-head": {"train_layers": "head", "learning_rate": 4.0}}
#: the policy of a no-DP row that trains the head alone: the DP-SGD path and plan with the clip at C = 10^6 (far
#: above a linear head's gradient for one image) and noise of std sigma C = 10^-3 on a step's sum of about 128
#: patients' gradients: neither acts
NO_PRIVACY = PatientDP(noise_multiplier=1e-9, max_grad_norm=1e6)
#: tuned on blood cells, Dir(0.5), seed 0 at epsilon 8 (docs/privacy.md lists the tries)
PLAN = {"group_norm": True, "batch_size": 128, "learning_rate": 1.0, "momentum": 0.9, "augmentations": 1,
        "averaging": 0.0}
MAX_GRAD_NORM = 1.0
#: what each trick adds, one change from the plan each (blood cells, Dir(0.5), FedAvg, from scratch, epsilon 8)
TRICKS: dict[str, dict[str, Any]] = {
    "no DP, BatchNorm (what GroupNorm costs without DP)": {"group_norm": False, "epsilon": None},
    "BatchNorm kept (no GroupNorm)": {"group_norm": False},
    "augmentation multiplicity 4": {"augmentations": 4},
    "augmentation multiplicity 8": {"augmentations": 8},
    "parameter averaging 0.9": {"averaging": 0.9},
    "learning rate 0.5": {"learning_rate": 0.5},
    "learning rate 2": {"learning_rate": 2.0},
    "logical batch 64": {"batch_size": 64},
    "logical batch 1024": {"batch_size": 1024},
    "8 local epochs (twice the steps, at the same epsilon)": {"local_epochs": 8},
}
#: trick keys that change the job rather than the DP plan
JOB_KEYS = {"local_epochs"}


def job(dataset: str, partition: str, start: str, seed: int, plan: dict[str, Any],
        hospitals: int = HOSPITALS) -> JobConfig:
    fields = {**JOB, **DATASETS[dataset], **PARTITIONS[partition], **MODELS[start], "seed": seed,
              "strategy": "fedavg", "run_name": "patient-dp", "min_train_hospitals": hospitals,
              "min_available_hospitals": hospitals}
    if start.startswith("pretrained"):
        source = OTHER[dataset]
        fields["encoder_weights"] = str(pretrain(DATASETS[source], source, JOB["image_size"], 0.25, 10,
                                                 group_norm=plan["group_norm"]))
    return JobConfig(**fields, patient_dp={**plan, **START_PLAN.get(start, {})})


def run(cfg: JobConfig, epsilon: float | None) -> dict[str, Any]:
    """One federation; its final test metrics and the most any hospital spent."""
    sites = simulated_sites(cfg, cfg.min_train_hospitals)
    for site in sites:
        site.state = HospitalStateStore(None, keep=1)
    ledgers: dict[str, PrivacyLedger] = {}
    started = time.time()
    if epsilon is None and cfg.patient_dp.train_layers == "all":
        history = run_rounds(cfg, sites).history
    else:
        table = (NO_PRIVACY if epsilon is None else
                 PatientDP(target_epsilon=epsilon, max_grad_norm=MAX_GRAD_NORM, delta=1e-5))
        policy = Policy(patient_dp=table)

        def enforcer(name: str) -> Enforcer:
            return Enforcer(policy, ledgers.setdefault(name, PrivacyLedger(None)))

        with mock.patch("common.engine.inprocess.hospital_class",
                        lambda method: policed(hospital_class(method), enforcer, cfg.run_name)):
            history = run_rounds(cfg, sites).history
    refused = sorted({reason for r in history for reason in (r.get("refused") or {}).values()})
    trained = sum(len(r.get("aggregated") or []) for r in history)
    curve = [[r["round"], round(r["test"]["accuracy"], 4)] for r in history if "accuracy" in (r.get("test") or {})]
    return {"test": history[-1].get("test", {}) if trained else {}, "curve": curve, "seconds": time.time() - started,
            "load": round(os.getloadavg()[1], 1),
            "spent": None if epsilon is None else max(ledger.epsilon(1e-5) for ledger in ledgers.values()),
            "refused": refused[:1]}


def rows(args) -> list[tuple[str, dict[str, Any]]]:
    """(file name, what the row is) of every run the arguments ask for."""
    chosen = []
    for dataset in args.datasets:
        for partition in args.partitions:
            for method in args.methods:
                for start in args.starts:
                    for epsilon in [None, *args.epsilons]:
                        for seed in args.seeds:
                            for hospitals in args.hospitals:
                                chosen.append({"dataset": dataset, "partition": partition, "method": method,
                                               "start": start, "epsilon": epsilon, "seed": seed, "trick": "",
                                               "hospitals": hospitals})
    if args.tricks:
        for trick in [t for t in TRICKS if not args.trick or any(t.startswith(n) for n in args.trick)]:
            for partition in args.tricks_on:
                for seed in args.seeds:
                    chosen.append({"dataset": "blood", "partition": partition, "method": "fedavg",
                                   "start": "scratch", "epsilon": TRICKS[trick].get("epsilon", 8.0), "seed": seed,
                                   "trick": trick, "hospitals": HOSPITALS})
    return list({name(row): row for row in chosen}.items())


def name(row: dict[str, Any]) -> str:
    eps = "nodp" if row["epsilon"] is None else f"eps{row['epsilon']:g}"
    trick = row["trick"].split(" (")[0].replace(",", "").replace(" ", "-")
    trick = f"-{trick}" if trick else ""
    sites = "" if hospitals(row) == HOSPITALS else f"-{hospitals(row)}hospitals"
    return (f"{row['dataset']}-{row['partition']}-{row['method']}-{row['start']}{sites}-{eps}{trick}"
            f"-seed{row['seed']}")


def hospitals(row: dict[str, Any]) -> int:
    """How many hospitals the row's patients are split between (HOSPITALS for runs recorded before it varied)."""
    return int(row.get("hospitals", HOSPITALS))


def headline(record: dict[str, Any]) -> float | None:
    """Accuracy (blood cells) or weighted F1 (HAM10000) of the final round."""
    test = record.get("test") or {}
    return test.get("f1_weighted" if record["dataset"] == "ham10000" else "accuracy")


def one_class(record: dict[str, Any]) -> bool:
    """Whether the run's model predicts one class for every test image (Matthews correlation 0): on an imbalanced
    data set such as HAM10000 that still scores (its weighted F1 is then the majority class's share times its F1)."""
    return (record.get("test") or {}).get("mcc") == 0.0


def report(out: Path, command: str) -> str:
    records = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    groups: dict[tuple, list[dict[str, Any]]] = {}  # (dataset, partition, method, start, hospitals, trick, epsilon)
    for record in records:
        key = (*(record[k] for k in ("dataset", "partition", "method", "start")), hospitals(record), record["trick"],
               record["epsilon"])
        groups.setdefault(key, []).append(record)

    def cell(key) -> tuple[str, float | None]:
        found = groups.get(key, [])
        values = [v for v in map(headline, found) if v is not None]
        if not found:
            return "not run", None
        if not values:
            return f"refused: {(found[0].get('refused') or ['no test result'])[0][:90]}", None
        mean = statistics.mean(values)
        spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        flat = sum(map(one_class, found))
        flat_note = f", {flat} of {len(values)} one class" if flat else ""
        return f"{mean:.3f}{spread} (n={len(values)}{flat_note})", mean

    loads = [r["load"] for r in records if "load" in r]
    load = (f" (2 cores shared with other work: 5-minute load average {min(loads)}-{max(loads)} at the runs' ends)"
            if loads else "")
    lines = [f"# Patient-level DP-SGD: what it costs\n\nLast made by `{command}` on {cpu_name()}{load}; each run's "
             "own command is in its file under runs/. Accuracy for blood "
             "cells, weighted F1 for HAM10000, final round, mean ± std over the seeds run (n); in brackets each DP "
             "row's share of its no-DP row (the goal's ratio), which trains the same layers: every layer with the "
             "task's own loop for scratch and pretrained (fine-tuned), the last linear layer alone on the frozen "
             "encoder for pretrained-head, through the same DP-SGD path and plan with the clip at 10^6 and the noise "
             "multiplier at 10^-9; \"one class\": runs whose model predicts one class for every test image "
             "(Matthews correlation 0); epsilon per patient at delta 1e-5, the most any hospital's ledger "
             "holds. The data set's training patients are split between the hospitals the row names (the tricks: "
             f"{HOSPITALS}), every one trains every round; "
             f"{JOB['num_server_rounds']} rounds, 28 px; DP plan {PLAN}, max-grad-norm {MAX_GRAD_NORM}; what a start "
             f"changes in it: {START_PLAN}.\n",
             "| data set | partition | method | start | hospitals | no DP | eps 1 | eps 3 | eps 8 |",
             "|---|---|---|---|---|---|---|---|---|"]
    combos = sorted({k[:5] for k in groups if not k[5]})
    for combo in combos:
        base, base_mean = cell(combo + ("", None))
        row = [*combo[:4], str(combo[4]), base]
        for epsilon in (1.0, 3.0, 8.0):
            text, mean = cell(combo + ("", epsilon))
            spent = [r.get("spent") for r in groups.get(combo + ("", epsilon), []) if r.get("spent")]
            if mean is not None and base_mean:
                text += f" [{mean / base_mean:.0%}]"
            if spent:
                text += f", eps {max(spent):.2f}"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    for partition in sorted({k[1] for k in groups if k[5]}):
        tricks = [k for k in groups if k[5] and k[1] == partition]
        plan_key = ("blood", partition, "fedavg", "scratch", HOSPITALS, "", 8.0)
        base = cell(plan_key)
        lines += ["", f"What each trick adds (blood cells, {PARTITION_NAMES[partition]}, FedAvg, from scratch, "
                  "epsilon 8; one change from the plan each):", "", "| change | accuracy | against the plan |",
                  "|---|---|---|", f"| the plan | {base[0]} | |"]
        plan_runs = {r["seed"]: headline(r) for r in groups.get(plan_key, [])}
        for key in sorted(tricks, key=lambda k: k[5]):
            text, mean = cell(key)
            pairs = [(headline(r), plan_runs.get(r["seed"])) for r in groups[key]]
            pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
            moved = (f"{statistics.mean(a - b for a, b in pairs):+.3f} (the plan's same seeds)" if pairs else "")
            lines.append(f"| {key[5]} | {text} | {moved} |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=["blood", "ham10000"])
    parser.add_argument("--partitions", nargs="+", choices=sorted(PARTITIONS), default=["iid", "dirichlet"])
    parser.add_argument("--methods", nargs="+", choices=["fedavg", "fedproin"], default=["fedavg", "fedproin"])
    parser.add_argument("--starts", nargs="+", choices=sorted(MODELS), default=["scratch", "pretrained"])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--hospitals", nargs="+", type=int, default=[HOSPITALS],
                        help="how many hospitals the patients are split between (fewer: more patients each)")
    parser.add_argument("--tricks", action=argparse.BooleanOptionalAction, default=True,
                        help="also the rows of TRICKS (blood cells, FedAvg, epsilon 8; --tricks-on)")
    parser.add_argument("--tricks-on", nargs="+", choices=sorted(PARTITIONS), default=["dirichlet"],
                        help="the partitions the TRICKS rows run on (default Dir(0.5))")
    parser.add_argument("--trick", action="append", default=[],
                        help="only the TRICKS rows whose name starts so (repeatable; default all)")
    parser.add_argument("--rounds", type=int, default=JOB["num_server_rounds"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "privacy-patient")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the runs there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout)
    torch.set_num_threads(1)
    JOB["num_server_rounds"] = args.rounds
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.privacy.patient " + shlex.join(argv if argv is not None else sys.argv[1:])
    for file, row in ([] if args.report_only else rows(args)):
        target = args.out / "runs" / f"{file}.json"
        if target.exists():
            continue
        trick = TRICKS.get(row["trick"], {})
        plan = {**PLAN, **{k: v for k, v in trick.items() if k != "epsilon" and k not in JOB_KEYS}}
        cfg = job(row["dataset"], row["partition"], row["start"], row["seed"], plan, hospitals(row))
        cfg = cfg.model_copy(update={"strategy": row["method"], **{k: v for k, v in trick.items() if k in JOB_KEYS}})
        result = run(cfg, row["epsilon"])
        target.write_text(json.dumps({**row, **result, "command": command}, indent=1) + "\n")
        print(f"{file}: {headline({**row, **result})} eps {result['spent']} in {result['seconds']:.0f}s "
              f"{result['refused']}", flush=True)
    print(report(args.out, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
