"""``fedmed``: the demo, simulations on one machine, and per-hospital data folders for deployments.

    fedmed demo                               # the main job on generated data, printed as a table
    fedmed simulate --hospitals 5 --run-config "task='polyp-segmentation' num-server-rounds=10"
    fedmed partition --run-config "dataset='ham10000' data-dir='../shared/data/ham10000'" --hospitals 5 --out sites
    fedmed export-int8 --run results/<run-name> --out polyp-int8.pt    # QFedPolyp's INT8 deployment model
    fedmed segment --model polyp-int8.pt --images new-frames/ --out masks/
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import tomllib


def parse_overrides(text: str) -> dict[str, Any]:
    """``"a=1 b='x y'"`` -> ``{"a": 1, "b": "x y"}`` (values are TOML; bare words are strings)."""
    values: dict[str, Any] = {}
    for item in shlex.split(text or ""):
        if "=" not in item:
            raise SystemExit(f"run config override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        try:
            values[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            values[key.strip()] = raw
    return values


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """Relative paths are relative to where the user stands, not to where Flower runs the apps."""
    def is_path(key: str) -> bool:
        return key.endswith(("-dir", "-file", "-path")) or key == "resume-from"

    return {k: (str(Path(v).resolve()) if is_path(k) and isinstance(v, str) and v else v) for k, v in values.items()}


def simulate(hospitals: int, overrides: dict[str, Any], engine: dict[str, Any], home: Path,
             timeout: float) -> int:
    """Run the app in Flower's simulation engine on a private local SuperLink; print the results."""
    from common.config import load_job_config
    from common.launch import FlowerHome, free_port, run_log, start_superlink, submit_run, wait_for_run
    from server_app.results import read_history, render_summary

    defaults = {"results-dir": "results", "state-dir": "state"}
    run_config = absolute_paths({**defaults, **overrides})
    cfg = load_job_config(run_config, check_paths=True)  # fail here, before anything starts
    if not cfg.run_name:
        run_config["run-name"] = f"{cfg.task}-{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(run_config["results-dir"]) / run_config["run-name"]
    flower_home = FlowerHome(home.resolve())
    superlink = start_superlink(flower_home, free_port(), simulation=True)
    printed = 0
    try:
        run_id = submit_run(flower_home, "local", run_config, {"num-supernodes": hospitals, **engine})
        print(f"run {run_id}: {hospitals} simulated hospitals, results in {run_dir}", flush=True)

        def progress(_status: str) -> None:
            nonlocal printed
            if (run_dir / "metrics.jsonl").exists():
                history = read_history(run_dir)
                for record in history[printed:]:
                    from common.round_engine import describe

                    print(f"round {record['round']}: {describe(record)}", flush=True)
                printed = len(history)

        status = wait_for_run(flower_home, "local", run_id, timeout, on_poll=progress)
        progress(status)
        if status != "finished:completed":
            print(run_log(flower_home, "local", run_id)[-6000:], file=sys.stderr)
            print(f"run {run_id} ended with status {status}", file=sys.stderr)
            return 1
        print(render_summary(json.loads((run_dir / "config.json").read_text()), read_history(run_dir)))
        print(f"\nResults: {run_dir} (summary.md, metrics.jsonl, plots/)")
        return 0
    finally:
        superlink.stop()


def int8_command(args: argparse.Namespace) -> int:
    """``export-int8`` and ``segment``: a bad run folder, model file or image folder is one line on stderr."""
    from common.quantization.int8 import export_int8, segment_folder
    from server_app.checkpoint import find_checkpoint, load_checkpoint

    try:
        if args.command == "export-int8":
            checkpoint = find_checkpoint(args.run)
            path, metadata = export_int8(load_checkpoint(checkpoint), args.out, args.calibration_dir,
                                         args.calibration_images, source=str(checkpoint))
            print(f"INT8 model of {checkpoint} written to {path}\n{json.dumps(metadata, indent=2)}")
        else:
            written = segment_folder(args.model, args.images, args.out)
            print(f"{len(written)} masks written to {args.out}")
    except (ValueError, OSError) as error:
        print(f"fedmed {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedmed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="federated classification on generated data (3 hospitals, simulation)")
    demo.add_argument("--hospitals", type=int, default=3)
    demo.add_argument("--rounds", type=int, default=5)

    sim = sub.add_parser("simulate", help="a run in Flower's simulation engine on this machine")
    sim.add_argument("--hospitals", type=int, default=3, help="number of simulated hospitals (SuperNodes)")
    sim.add_argument("--run-config", default="", help="overrides, e.g. \"strategy='fedprox' num-server-rounds=10\"")
    sim.add_argument("--federation-config", default="", help="e.g. \"client-resources-num-gpus=0.5\"")

    part = sub.add_parser("partition", help="write per-hospital data folders (and the server's test set)")
    part.add_argument("--run-config", default="", help="the job's data keys: dataset, data-dir, partitioner, ...")
    part.add_argument("--hospitals", type=int, required=True)
    part.add_argument("--out", type=Path, required=True)

    export = sub.add_parser("export-int8", help="a run's final global polyp U-Net as an INT8 TorchScript model")
    export.add_argument("--run", type=Path, required=True, help="run folder (its latest checkpoint) or checkpoint file")
    export.add_argument("--out", type=Path, required=True, help="model file to write, e.g. polyp-int8.pt")
    export.add_argument("--calibration-dir", type=Path, default=None,
                        help="images to calibrate activation ranges on (default: the run's training data)")
    export.add_argument("--calibration-images", type=int, default=64)

    segment = sub.add_parser("segment", help="masks for a folder of images with an exported model")
    segment.add_argument("--model", type=Path, required=True, help="file written by `fedmed export-int8`")
    segment.add_argument("--images", type=Path, required=True, help="folder of images (or an images/masks data set)")
    segment.add_argument("--out", type=Path, required=True, help="folder for the mask PNGs (0/255, input size)")

    for p in (demo, sim):
        p.add_argument("--home", type=Path, default=Path(".flwr"), help="FLWR_HOME for the local SuperLink")
        p.add_argument("--timeout", type=float, default=6 * 3600)

    args = parser.parse_args(argv)
    from common.config import ConfigError

    try:
        if args.command == "demo":
            return simulate(args.hospitals, {"num-server-rounds": args.rounds}, {}, args.home, args.timeout)
        if args.command == "simulate":
            return simulate(args.hospitals, parse_overrides(args.run_config), parse_overrides(args.federation_config),
                            args.home, args.timeout)
        if args.command == "partition":
            from common.config import load_job_config
            from common.data.export import export_partitions

            cfg = load_job_config(absolute_paths(parse_overrides(args.run_config)), check_paths=True)
            manifest = export_partitions(cfg, args.hospitals, args.out)
            print(json.dumps(manifest, indent=2))
            return 0
        if args.command in ("export-int8", "segment"):
            return int8_command(args)
    except ConfigError as error:
        print(f"fedmed: {error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
