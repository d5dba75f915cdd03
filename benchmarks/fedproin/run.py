"""FedProIn against its baselines in the layout of the paper's Table 1, on real data, in one process.

    python -m benchmarks.fedproin.run --preset cpu --dataset ham10000
    python -m benchmarks.fedproin.run --preset paper --dataset blood --seeds 0 1 2     # for a GPU

Every method runs on the same hospitals (K = 10 partitions of the same pool, IID and Dirichlet
alpha = 0.5), the same server test set, rounds, local epochs, batch size and learning rate; SOLO and
centralised training are references with the same budget (common.engine.references). Each finished run
is written to ``<out>/runs/<method>-<partition>-seed<s>.json`` and skipped when the script is
started again, so an interrupted benchmark resumes. The table (mean +- std over seeds of the final
round's accuracy, weighted F1 and MCC) and a plot of accuracy over rounds are rebuilt at the end.
Long runs belong under the shared CPU lock: ``flock /tmp/fedmed-cpu.lock python -m ...``.

The paper preset (128 x 128, ResNet-18, 50 rounds x 5 epochs, batch 128) needs one GPU. ``python -m
benchmarks.gpu_check --sections presets`` measures its seconds per round and peak GPU memory on the machine at hand
(one round on generated data of the preset's sizes); it has not yet run on a GPU, as none was lent to this work, so
no figure is given here.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common.config import JobConfig
from common.data.sources import server_test_set
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.references import run_centralised, run_solo
from common.methods.site import HospitalStateStore

from .pretrain import DATASETS, OTHER, pretrain
from .report import write_report

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("fedmed")

#: The paper's protocol (K = 10, 50 % per round, Adam, 128x128, E = 5, 50 rounds, batch 128, lr 1e-4, 3 seeds),
#: and a CPU preset that keeps the protocol but shrinks images, rounds and epochs to fit two cores.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"job": {"image_size": 128, "num_server_rounds": 50, "local_epochs": 5, "batch_size": 128,
                      "learning_rate": 1e-4}, "seeds": [0, 1, 2]},
    "cpu": {"job": {"image_size": 28, "resnet_width": 0.25, "num_server_rounds": 10, "local_epochs": 2,
                    "batch_size": 32, "learning_rate": 1e-3, "evaluate_every": 2}, "seeds": [0, 1, 2]},
}
PROTOCOL = {"fraction_train": 0.5, "min_train_hospitals": 2, "min_available_hospitals": 2, "min_partition_size": 10,
            "val_fraction": 0.125, "test_fraction": 0.2, "device": "auto"}  # 70 / 10 / 20 as in the paper
NUM_HOSPITALS = 10
PARTITIONS: dict[str, dict[str, Any]] = {"iid": {"partitioner": "iid"},
                                         "dirichlet": {"partitioner": "dirichlet", "dirichlet_alpha": 0.5}}

#: Table rows in the paper's order: name -> (strategy, overrides of the job).
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "SOLO": ("solo", {}),
    "FedAvg": ("fedavg", {}),
    "FedProx": ("fedprox", {}),
    "MOON": ("moon", {}),
    "FedProto": ("fedproto", {}),
    "FedBN": ("fedbn", {}),
    "FedProIn": ("fedproin", {}),
    "Centralised": ("centralised", {}),
}
#: Where the platform's FedProIn defaults differ from the paper's (docs/fedproin.md has the measurements).
PLATFORM_FEDPROIN: dict[str, Any] = {"task_loss": "dce", "class_balanced": False, "class_augmentation": False}
ABLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "FedProIn no FDL": ("fedproin", {"fedproin": {"fdl_weight": 0.0}}),
    "FedProIn no PCL": ("fedproin", {"fedproin": {"pcl_weight": 0.0}}),
    "FedProIn no NIA": ("fedproin", {"fedproin": {"aggregation": "fedavg"}}),
    "FedProIn no FDL, PCL, NIA": ("fedproin", {"fedproin": {"fdl_weight": 0.0, "pcl_weight": 0.0,
                                                            "aggregation": "fedavg"}}),
    # the prototype head alone: FedAvg's training on the prototype model (no FDL, PCL, NIA, class balance)
    "FedProIn head only": ("fedproin", {"fedproin": {"fdl_weight": 0.0, "pcl_weight": 0.0, "aggregation": "fedavg",
                                                     "class_balanced": False, "class_augmentation": False}}),
    # the design notes' stable alternative task loss: cross-entropy over every class's distance, not the nearest rival
    "FedProIn DCE": ("fedproin", {"fedproin": {"task_loss": "dce"}}),
    "FedProIn DCE no class balance": ("fedproin", {"fedproin": PLATFORM_FEDPROIN}),
    "FedProIn DCE gamma 0.02": ("fedproin", {"fedproin": {**PLATFORM_FEDPROIN, "dce_gamma": 0.02}}),
    "FedProIn DCE gamma 0.2": ("fedproin", {"fedproin": {**PLATFORM_FEDPROIN, "dce_gamma": 0.2}}),
    "FedProIn DCE FDL 3": ("fedproin", {"fedproin": {**PLATFORM_FEDPROIN, "fdl_weight": 3.0}}),
    "FedProIn DCE FDL 10": ("fedproin", {"fedproin": {**PLATFORM_FEDPROIN, "fdl_weight": 10.0}}),
    "FedProIn DCE head only": ("fedproin", {"fedproin": {**PLATFORM_FEDPROIN, "fdl_weight": 0.0, "pcl_weight": 0.0,
                                                         "aggregation": "fedavg"}}),
    # choices where paper and public code differ, or that docs/fedproin.md lists as ours: one change each
    "FedProIn MCL": ("fedproin", {"fedproin": {"task_loss": "mcl", "fdl_weight": 0.1, "pcl_weight": 0.01}}),
    "FedProIn xi 0.01": ("fedproin", {"fedproin": {"mcel_xi": 0.01}}),
    "FedProIn xi 0.2": ("fedproin", {"fedproin": {"mcel_xi": 0.2}}),
    "FedProIn M 1": ("fedproin", {"fedproin": {"num_prototypes": 1}}),
    "FedProIn weights 1, 0.1": ("fedproin", {"fedproin": {"fdl_weight": 1.0, "pcl_weight": 0.1}}),
    "FedProIn prototype lr 1e-2": ("fedproin", {"fedproin": {"prototype_learning_rate": 1e-2}}),
    "FedProIn no class balance": ("fedproin", {"fedproin": {"class_balanced": False, "class_augmentation": False}}),
    "FedProIn max-class draws": ("fedproin", {"fedproin": {"epoch_draws": "max-class"}}),
    "FedProIn Adam kept": ("fedproin", {"fedproin": {"keep_optimizer_state": True}}),
    "FedProIn class-means init": ("fedproin", {"fedproin": {"prototype_init": "class-means"}}),
    "FedProIn feature-moments init": ("fedproin", {"fedproin": {"prototype_init": "feature-moments"}}),
    "FedProIn far-sample reseed after 2": ("fedproin", {"fedproin": {"reseed_after": 2, "reseed_rule": "far-sample"}}),
    "FedProIn split after 2": ("fedproin", {"fedproin": {"reseed_after": 2}}),
}
#: The paper's FedProIn: every FedProIn row is it unless the row says otherwise. The platform's defaults (DCE,
#: no class balance) are the row 'FedProIn DCE no class balance'; the table keeps the paper's method as reference.
PAPER_FEDPROIN: dict[str, Any] = {"task_loss": "mcel", "class_balanced": True, "class_augmentation": True}
REFERENCES = {"solo": run_solo, "centralised": run_centralised}
#: what made the runs that record no command (the first table, before commands were recorded)
MAIN_COMMAND = "python -m benchmarks.fedproin.run --preset cpu --dataset {dataset} --threads 2"
#: Methods scored with every hospital's own model (ten test-set passes): evaluated twice per run only.
PER_HOSPITAL_EVALUATION = ("solo", "fedproto", "fedbn")


def job_config(base: dict[str, Any], strategy: str, overrides: dict[str, Any]) -> JobConfig:
    fields = {**base, **{k: v for k, v in overrides.items() if k != "fedproin"}}
    fields["strategy"] = strategy if strategy not in REFERENCES else "fedavg"
    if strategy in PER_HOSPITAL_EVALUATION:
        fields["evaluate_every"] = max(fields.get("evaluate_every", 1), fields["num_server_rounds"] // 2)
    cfg = JobConfig(**fields)
    fedproin = {**PAPER_FEDPROIN, **overrides.get("fedproin", {})}
    return cfg.model_copy(update={"fedproin": cfg.fedproin.model_copy(update=fedproin)})


def run_one(cfg: JobConfig, strategy: str) -> list[dict[str, Any]]:
    """One method on the job's K hospitals: its round history (``test`` where evaluated)."""
    sites = simulated_sites(cfg, NUM_HOSPITALS, device=cfg.device)
    for site in sites:
        site.state = HospitalStateStore(None, keep=1)  # in memory; only the last round is ever read back
    if strategy in REFERENCES:
        return REFERENCES[strategy](cfg, sites, server_test_set(cfg))
    return run_rounds(cfg, sites).history


def compact(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the report needs from each round, plus FedProIn's prototype usage."""
    keep = ("round", "test", "train", "seconds", "refused", "method")
    return [{k: r[k] for k in keep if k in r and (k != "method" or "prototype-usage" in r[k])} for r in history]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="ham10000")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the preset's")
    parser.add_argument("--partitions", nargs="+", choices=sorted(PARTITIONS), default=["iid", "dirichlet"])
    parser.add_argument("--methods", nargs="+", help="table rows to run (default: all, plus --ablations)")
    parser.add_argument("--ablations", action="store_true", help="also run FedProIn without FDL / PCL / NIA, and "
                        "with each alternative choice of ABLATIONS")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job field, e.g. --set num_server_rounds=1 --set fedproin.mcel_xi=0.1")
    parser.add_argument("--pretrained", action="store_true",
                        help="every method starts from an encoder pretrained centrally on the other data set "
                             "(benchmarks.fedproin.pretrain, cached); results go to <dataset>-<preset>-pretrained")
    parser.add_argument("--pretrain-epochs", type=int, default=10)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/fedproin/<dataset>-<preset>")
    parser.add_argument("--before", type=Path, help="a result folder of this benchmark run before a change (another "
                        "split, other code): the report says how far each row moved from it, seed for seed")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine two threads ran 10x slower "
                             "than one whenever another job was running; use more on a machine of your own)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    preset = PRESETS[args.preset]
    base = {**PROTOCOL, **preset["job"], **DATASETS[args.dataset]}
    fedproin_overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, text = item.partition("=")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if key.startswith("fedproin."):
            fedproin_overrides[key.removeprefix("fedproin.")] = value
        else:
            base[key] = value
    catalogue = {**METHODS, **ABLATIONS}
    names = args.methods or [*METHODS, *(ABLATIONS if args.ablations else {})]
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {list(catalogue)}")
    folder = f"{args.dataset}-{args.preset}"
    if args.pretrained:
        source = OTHER[args.dataset]
        base["encoder_weights"] = str(pretrain(DATASETS[source], source, base["image_size"],
                                               base.get("resnet_width", 1.0), args.pretrain_epochs))
        folder += f"-pretrained-{source}"
    out = args.out or ROOT / "benchmarks" / "results" / "fedproin" / folder
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if args.pretrained:  # how the encoder was made, and how well it does on its own data set, beside the table
        shutil.copyfile(Path(base["encoder_weights"]).with_suffix(".json"), out / "pretrained-encoder.json")
    seeds = args.seeds or preset["seeds"]

    command = " ".join(["python -m benchmarks.fedproin.run", *map(shlex.quote, argv if argv is not None
                                                                  else sys.argv[1:])])
    for partition in args.partitions:
        for seed in seeds:
            for name in names:
                strategy, overrides = catalogue[name]
                target = out / "runs" / f"{slug(name)}-{partition}-seed{seed}.json"
                if target.exists():
                    continue
                merged = {**overrides, "fedproin": {**overrides.get("fedproin", {}), **fedproin_overrides}}
                cfg = job_config({**base, **PARTITIONS[partition], "seed": seed,
                                  "run_name": f"{slug(name)}-{partition}-seed{seed}"}, strategy, merged)
                log.info("=== %s, %s, seed %d", name, partition, seed)
                started = time.time()
                history = run_one(cfg, strategy)
                record = {"method": name, "partition": partition, "seed": seed, "seconds": time.time() - started,
                          "command": command,
                          "config": cfg.to_flat(), "history": compact(history)}
                target.write_text(json.dumps(record, indent=1) + "\n")
                log.info("=== %s, %s, seed %d: %s in %.0fs", name, partition, seed,
                         history[-1].get("test"), record["seconds"])
    write_report(out, list(METHODS), list(ABLATIONS), f"{args.dataset}, preset {args.preset}"
                 + (", pretrained encoder" if args.pretrained else ""), MAIN_COMMAND.format(dataset=args.dataset),
                 before=args.before)
    return 0


def slug(name: str) -> str:
    return name.lower().replace(",", "").replace(" ", "-")


if __name__ == "__main__":
    sys.exit(main())
