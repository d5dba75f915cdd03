"""A held-out set for QFedPolyp's Table 1 that no run sees: whole CVC-ClinicDB video sequences and Kvasir-SEG images
set aside before anything is split, so the runs' own test set (which picked the configurations) is not the last word.

    python -m benchmarks.qfedpolyp.heldout --out /tmp/q64-polyp
    python -m benchmarks.qfedpolyp.table1 --preset cpu --set data_dir=/tmp/q64-polyp/pool ...
    fedmed evaluate --run <out>/runs/<config> --data /tmp/q64-polyp/heldout

``<out>/pool`` (what the runs split into hospitals and their test set) and ``<out>/heldout`` are copies of
../shared/data/polyp (outside the repository), each data set with a ``groups.csv`` that keeps the groups of the whole
data set (``write_image_mask``), held out by the same leak-free, group-aware split the runs use
(``stratified_holdout``: a fraction of every data set, whole video sequences only), with its own seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.data.image_mask import load_image_mask, write_image_mask
from common.data.partition import stratified_holdout

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "polyp"
FRACTION = 0.15
SEED = 2026  #: not a run's seed: the held-out part is the same whatever seed the runs use


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for pool/ and heldout/ (must not exist)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--fraction", type=float, default=FRACTION)
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; pass a new folder")
    data = load_image_mask(args.data, 16)  # the groups come from the files, not the size read
    kept, held = stratified_holdout(data.strata, args.fraction, SEED, groups=data.groups)
    write_image_mask(data.subset(kept), args.out / "pool", args.data)
    write_image_mask(data.subset(held), args.out / "heldout", args.data)
    for name, part in (("pool", data.subset(kept)), ("heldout", data.subset(held))):
        counts = {str(s): int((part.sources == s).sum()) for s in sorted(set(part.sources))}
        groups = len(set(part.groups[part.sources == "cvc_clinicdb_256"]))
        print(f"{args.out / name}: {counts}; CVC-ClinicDB sequences: {groups}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
