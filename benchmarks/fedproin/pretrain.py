"""A CPU stand-in for the paper's ImageNet start: a ResNet-18 trained centrally on another real data set.

    python -m benchmarks.fedproin.pretrain --source blood --image-size 28 --width 0.25

Nothing can be downloaded here, so the benchmark's "pretrained" rows start from an encoder trained on
the *other* medical data set in ../shared/data (for HAM10000 the blood cells, for the blood cells
HAM10000): every image of it, all classes, with FedAvg's local step on one site (the same code the
centralised reference runs). The state dict is cached under ``benchmarks/cache/`` (not in git) and its
source-set test accuracy written beside it; ``encoder-weights`` loads it for every method, leaving the
classification head (the source's classes) behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from common.config import JobConfig
from common.engine.inprocess import run_rounds, simulated_sites

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "benchmarks" / "cache"
DATA = ROOT.parent / "shared" / "data"
log = logging.getLogger("fedmed")
#: target data set -> the data set its encoder is pretrained on
OTHER = {"ham10000": "blood", "blood": "ham10000"}
#: the data sets the benchmark trains on, as run-config keys
DATASETS: dict[str, dict[str, Any]] = {
    "ham10000": {"dataset": "ham10000", "data_dir": str(DATA / "ham10000")},
    "blood": {"dataset": "npz", "data_dir": str(DATA / "blood" / "pbc_blood_28.npz")},
}


def encoder_path(source: str, image_size: int, width: float, epochs: int, seed: int, group_norm: bool = False) -> Path:
    norm = "-groupnorm" if group_norm else ""
    return CACHE / f"encoder-{source}-{image_size}px-w{width:g}-e{epochs}{norm}-seed{seed}.pt"


def pretrain(source: dict[str, Any], name: str, image_size: int, width: float, epochs: int, seed: int = 0,
             batch_size: int = 32, learning_rate: float = 1e-3, group_norm: bool = False) -> Path:
    """Train (or find in the cache) the encoder (``group_norm``: GroupNorm in place of BatchNorm, as patient-level
    DP-SGD needs it); returns the state-dict file."""
    target = encoder_path(name, image_size, width, epochs, seed, group_norm)
    if target.is_file():
        return target
    cfg = JobConfig(run_name=f"pretrain-{name}", strategy="fedavg", **source, image_size=image_size,
                    resnet_width=width, num_server_rounds=epochs, local_epochs=1, batch_size=batch_size,
                    learning_rate=learning_rate, fraction_train=1.0, min_train_hospitals=1,
                    min_available_hospitals=1, val_fraction=0.0, test_fraction=0.1, seed=seed,
                    evaluate_every=epochs, device="auto", patient_dp={"group_norm": group_norm})
    log.info("pretraining a ResNet-18 (width %g, %d px) on %s for %d epochs", width, image_size, name, epochs)
    engine = run_rounds(cfg, simulated_sites(cfg, 1, device=cfg.device))
    model = engine.method.evaluation_model()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    torch.save(model.state_dict(), partial)
    partial.replace(target)
    test = engine.history[-1].get("test", {})
    target.with_suffix(".json").write_text(json.dumps({"source": name, "epochs": epochs, "image-size": image_size,
                                                       "resnet-width": width, "seed": seed,
                                                       "source-test": test}, indent=1) + "\n")
    log.info("pretrained encoder %s: %s test accuracy %.3f", target.name, name, test.get("accuracy", float("nan")))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=sorted(DATASETS), required=True)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    print(pretrain(DATASETS[args.source], args.source, args.image_size, args.width, args.epochs, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
