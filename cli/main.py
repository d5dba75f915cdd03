"""``fedmed``: the demo, simulations on one machine, and per-hospital data folders for deployments.

    fedmed demo                               # local training, FedAvg and FedProIn on generated non-IID data
    fedmed simulate --hospitals 5 --run-config "task='polyp-segmentation' num-server-rounds=10"
    fedmed partition --run-config "dataset='ham10000' data-dir='../shared/data/ham10000'" --hospitals 5 --out sites
    fedmed export-int8 --run results/<run-name> --out polyp-int8.pt2   # QFedPolyp's INT8 deployment model
    fedmed segment --model polyp-int8.pt2 --images new-frames/ --out masks/
    fedmed evaluate --run results/<run-name> --data external-site/   # a run's model on a labelled folder
    fedmed evaluate --run results/<run-name> --data external-site/ --best   # its best round's (select-by)
    fedmed runs --results results                # the runs of a results folder, newest first
    fedmed console --state state --results results   # a read-only page of both (docs/privacy.md)

Ctrl-C, SIGTERM or --timeout stop a simulation or the demo and every process it started (exit code 130, 143
or 124; partial results stay in the run folder); a run that did not complete exits 1; a refused config or
argument (a key or path that cannot work, a hospital count, a data set that does not fit the run) exits 2 with
one line naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cli.arguments import OneLineParser, absolute_paths, parse_overrides, positive, usable_path
from cli.simulate import EXIT_STOPPED, RunStopped, simulate

#: where ``export-int8 --best`` writes without --out (.pt2 or .onnx, by engine), and what ``segment --best`` runs
BEST_INT8 = Path("exports") / "int8-best"


def best_int8_model(run: Path) -> Path:
    """``segment --run RUN --best``: the INT8 model ``export-int8 --run RUN --best`` wrote, checked to be of the
    run's best round still (a run resumed since may have found a better one): ValueError saying what to do."""
    from common.quantization.int8 import SUFFIXES, load_deployment
    from server_app.checkpoint import find_best, read_best

    best = read_best(find_best(run))
    written = [Path(run) / BEST_INT8.with_suffix(suffix) for suffix in SUFFIXES.values()]
    model = max((m for m in written if m.is_file()), key=lambda m: m.stat().st_mtime, default=written[0])
    again = f"fedmed export-int8 --run {run} --best"
    if not model.is_file():
        raise ValueError(f"--best: {run} has no INT8 model of its best round ({model}); export it first: {again}")
    _, metadata = load_deployment(model)
    if int(metadata.get("rounds", -1)) != best["round"] or not str(metadata.get("checkpoint", "")).endswith(
            "best.npz"):
        raise ValueError(f"--best: {model} is the model after round {metadata.get('rounds')}, but the run's best "
                         f"round by {best['metric']} is now {best['round']}; export it again: {again}")
    return model


def int8_command(args: argparse.Namespace) -> int:
    """``export-int8`` and ``segment``: a bad run folder, model file or image folder is one line on stderr."""
    from cli.int8_export import describe_export, export_int8, segment_folder
    from server_app.checkpoint import find_best, find_checkpoint, load_checkpoint

    try:
        if args.command == "export-int8":
            checkpoint = find_best(args.run) if args.best else find_checkpoint(args.run)
            out = args.out or Path(args.run) / BEST_INT8  # export_int8 adds the engine's suffix
            path, metadata = export_int8(load_checkpoint(checkpoint), out, args.calibration_dir,
                                         args.calibration_images, source=str(checkpoint), engine=args.engine,
                                         app_dir=args.app_dir)
            print(f"INT8 model of {checkpoint} written to {path}\n{describe_export(metadata)}")
        else:
            model = best_int8_model(args.run) if args.best else args.model
            written = segment_folder(model, args.images, args.out)
            print(f"{len(written)} masks written to {args.out}")
    except (ValueError, OSError) as error:
        print(f"fedmed {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


def check_evaluation_dataset(run: Path, dataset: str) -> None:
    """``--dataset`` must be a folder format of the run's task (or a loader of the user's own,
    'package.module:loader'): ConfigError naming it otherwise. A run whose config cannot be read here is left to
    :func:`server_app.evaluation.evaluate_run`, which says why."""
    if not dataset or ":" in dataset:
        return
    from common.config import TASK_DATASETS, ConfigError

    try:
        import numpy as np

        from server_app.checkpoint import find_checkpoint

        with np.load(find_checkpoint(run), allow_pickle=False) as archive:
            task = json.loads(archive["run/config"].tobytes().decode())["task"]
    except Exception:
        return
    formats = [name for name in TASK_DATASETS.get(task, ()) if name != "synthetic"]
    if formats and dataset not in formats:
        raise ConfigError(f"--dataset {dataset!r} does not fit the run's task {task!r}: use "
                          f"{' or '.join(repr(f) for f in formats)} (or a loader of your own, 'package.module:loader')")


def evaluate_command(args: argparse.Namespace) -> int:
    """``evaluate``: the run's model on a labelled folder, printed and written as JSON and markdown."""
    from server_app.evaluation import evaluate_run, render_evaluation, write_evaluation
    from server_app.results import finite_or_none

    try:
        check_evaluation_dataset(args.run, args.dataset)
        result = evaluate_run(args.run, args.data, round_number=args.round, int8_model=args.model,
                              modalities=args.modalities, hospital=args.hospital, dataset=args.dataset,
                              best=args.best, app_dir=args.app_dir)
    except (ValueError, OSError) as error:  # a folder, checkpoint or model that does not fit: one line
        print(f"fedmed evaluate: {error}", file=sys.stderr)
        return 2
    except (AttributeError, TypeError, KeyError, IndexError) as error:  # data a loader of the user's own gave,
        # of another kind than the run's task takes: still one line, naming what was given
        print(f"fedmed evaluate: --data {args.data} ({args.dataset or 'format from its layout'}) does not fit the "
              f"run {args.run} ({type(error).__name__}: {error})", file=sys.stderr)
        return 2
    result = finite_or_none(result)  # strict JSON: a NaN score (e.g. HD95 of an empty mask) is written as null
    name = "-".join(part for part in (Path(args.data).name, args.hospital, "int8" if args.model else "",
                                      f"round-{args.round}" if args.round else "", "best" if args.best else "")
                    if part)
    json_path, md_path = write_evaluation(result, args.out or Path(args.run) / "evaluations" / name)
    print(render_evaluation(result))
    print(f"written to {md_path} and {json_path}")
    return 0


def runs_command(args: argparse.Namespace) -> int:
    """``runs``: a table of the runs in a results folder, newest first."""
    from server_app.results import list_runs, render_runs

    if not args.results.is_dir():
        print(f"fedmed runs: --results {args.results} is not a folder", file=sys.stderr)
        return 2
    rows = list_runs(args.results, args.metric)
    if not rows:
        print(f"no runs in {args.results} (a run folder holds config.json)")
        return 0
    print(render_runs(rows))
    return 0


def partition_command(args: argparse.Namespace) -> int:
    """``partition``: a hospital count below 1 is refused before anything is written; a refused partition leaves
    no folder behind where there was none (a retry would find it not empty)."""
    import shutil

    from common.config import ConfigError, load_job_config
    from common.data.export import export_partitions

    if args.hospitals < 1:
        raise ConfigError(f"--hospitals {args.hospitals}: a partition needs at least 1 hospital; nothing was written")
    cfg = load_job_config(absolute_paths(parse_overrides(args.run_config)), check_paths=True)
    new_folder = not args.out.exists()
    try:
        manifest = export_partitions(cfg, args.hospitals, args.out)
    except BaseException:
        if new_folder and args.out.is_dir() and not args.out.is_symlink():
            shutil.rmtree(args.out, ignore_errors=True)
        raise
    print(json.dumps(manifest, indent=2))
    return 0


#: command-line options that name files or folders (checked before anything runs)
PATH_OPTIONS = ("home", "out", "run", "data", "model", "images", "calibration_dir", "results", "app_dir")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and option of ``fedmed`` but ``audit``, ``app-hash`` and ``policy`` (cli/audit.py,
    cli/site.py); the docs' commands are checked against it (tests/test_docs_snippets.py)."""
    parser = OneLineParser(prog="fedmed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="local training, FedAvg and FedProIn side by side on generated non-IID "
                          "hospitals (Flower simulation; a few minutes on a CPU)")
    demo.add_argument("--hospitals", type=int, default=3)
    demo.add_argument("--rounds", type=positive(int), default=10)
    demo.add_argument("--seed", type=int, default=42, help="the data, its split and the training's random draws")
    demo.add_argument("--results", type=Path, default=Path("results"),
                      help="folder for the demo's folder, demo-<time>/ (default: results)")

    sim = sub.add_parser("simulate", help="a run in Flower's simulation engine on this machine")
    sim.add_argument("--hospitals", type=int, default=3, help="number of simulated hospitals (SuperNodes)")
    sim.add_argument("--run-config", default="", help="overrides, e.g. \"strategy='fedprox' num-server-rounds=10\"")
    sim.add_argument("--federation-config", default="", help="e.g. \"client-resources-num-gpus=0.5\"")
    sim.add_argument("--overwrite", action="store_true",
                     help="replace an existing run folder of the same name (run config overwrite-run=true)")

    part = sub.add_parser("partition", help="write per-hospital data folders (and the server's test set)")
    part.add_argument("--run-config", default="", help="the job's data keys: dataset, data-dir, partitioner, ...")
    part.add_argument("--hospitals", type=int, required=True)
    part.add_argument("--out", type=Path, required=True)

    export = sub.add_parser("export-int8", help="a run's final global polyp segmentation model as an INT8 model")
    export.add_argument("--run", type=Path, required=True, help="run folder (its latest checkpoint) or checkpoint file")
    export.add_argument("--out", type=Path, default=None,
                        help="model file to write, e.g. polyp-int8.pt2 (--best: <run>/exports/int8-best.pt2 "
                        "or .onnx, by engine)")
    export.add_argument("--best", action="store_true",
                        help="the best round's model (checkpoints/best.npz, kept by select-by) instead of the latest")
    export.add_argument("--calibration-dir", type=Path, default=None,
                        help="images to calibrate activation ranges on (default: the run's training data); with a "
                        "loader of the run's own, a folder it reads as a hospital's data")
    export.add_argument("--calibration-images", type=positive(int), default=64)
    export.add_argument("--engine", choices=("auto", "pt2e", "onnxruntime", "openvino"), default="auto",
                        help="pt2e: PyTorch's quantisation (torchao; concatenations in int8 or float, whichever runs "
                        "faster here), a .pt2 compiled when it runs; onnxruntime: ONNX "
                        "Runtime's static quantisation (QDQ or QOperator, whichever runs faster here), a .onnx, also "
                        "for sites without PyTorch or a C++ compiler; openvino: ONNX Runtime's QDQ file run by "
                        "OpenVINO, a .onnx; each of any network, all in fedmed-hospitals[int8]; auto (default): every "
                        "installed one is timed here at batch 1 and 8 and the fastest written (an --out suffix limits "
                        "the choice to its type)")

    segment = sub.add_parser("segment", help="masks for a folder of images with an exported model")
    segment.add_argument("--model", type=Path, default=None, help="file written by `fedmed export-int8`")
    segment.add_argument("--run", type=Path, default=None, help="with --best: the run folder")
    segment.add_argument("--best", action="store_true", help="the INT8 model of the run's best round, as "
                         "`fedmed export-int8 --run RUN --best` wrote it (<run>/exports/int8-best.pt2 or .onnx)")
    segment.add_argument("--images", type=Path, required=True, help="folder of images (or an images/masks data set)")
    segment.add_argument("--out", type=Path, required=True, help="folder for the mask PNGs (0/255, input size), or "
                         "DICOM SEGs for DICOM images (docs/data.md)")

    evaluation = sub.add_parser("evaluate", help="score a run's model on a labelled folder it never saw")
    evaluation.add_argument("--run", type=Path, required=True, help="run folder (or one of its checkpoint files)")
    evaluation.add_argument("--data", type=Path, required=True,
                            help="labelled folder: HAM10000 layout, npz, images/ + masks/, or BraTS case folders")
    evaluation.add_argument("--round", type=positive(int), default=None,
                            help="the checkpoint after this round (default: last)")
    evaluation.add_argument("--model", type=Path, default=None, help="an INT8 model from `fedmed export-int8`")
    evaluation.add_argument("--modalities", default="", help="brain task: the MRI modalities to give the model")
    evaluation.add_argument("--hospital", default="", help="FedProto: this hospital's own model")
    evaluation.add_argument("--dataset", default="", help="the folder's format when it cannot be told from its layout "
                            "(default: the run's own loader, where it had one)")
    evaluation.add_argument("--out", type=Path, default=None,
                            help="file name without suffix (default: <run>/evaluations/<data folder>)")
    evaluation.add_argument("--best", action="store_true",
                            help="the best round's model (checkpoints/best.npz, kept by select-by) instead of the last")

    for p in (export, evaluation):
        p.add_argument("--app-dir", type=Path, default=None, help="the folder holding the run's own network and loader "
                       "modules (model/dataset='package.module:name'), when the one the run recorded is gone")

    # their own parsers (cli/audit.py, cli/site.py); here so that --help lists them
    sub.add_parser("audit", help="verify an audit log's chain (and against the other end's), rebuild a privacy "
                   "ledger: fedmed audit --help", add_help=False)
    sub.add_parser("app-hash", help="an app bundle's SHA-256 and files, for a hospital to review and approve",
                   add_help=False)
    sub.add_parser("policy", help="what a hospital's policy and node config allow: fedmed policy check --help",
                   add_help=False)
    sub.add_parser("console", help="a read-only page over a hospital's state and a results folder: fedmed console "
                   "--help", add_help=False)
    sub.add_parser("key-fingerprint", help="a hospital key's SHA-256 fingerprint, to compare with its officer and pin "
                   "in the policy's peers", add_help=False)
    runs = sub.add_parser("runs", help="the runs in a results folder, newest first")
    runs.add_argument("--results", type=Path, default=Path("results"), help="results folder (default: results)")
    runs.add_argument("--metric", default="", help="e.g. test.dice, min:test.loss, train.val-accuracy (default: the "
                      "run's select-by, else its task's headline test metric)")

    for p in (demo, sim):
        p.add_argument("--home", type=Path, default=Path(".flwr"), help="FLWR_HOME for the local SuperLink")
        p.add_argument("--timeout", type=positive(float, 1), default=6 * 3600,
                       help="seconds the whole run may take; then it is stopped (exit code 124)")
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["audit"]:  # fedmed audit verify LOG (docs/privacy.md)
        from cli.audit import main as audit_main

        return audit_main(sys.argv[1:] if argv is None else list(argv))
    if (sys.argv[1:] if argv is None else list(argv))[:1] in (["app-hash"], ["policy"], ["key-fingerprint"]):
        from cli.site import main as site_main

        return site_main(sys.argv[1:] if argv is None else list(argv))
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["console"]:  # the read-only page (docs/privacy.md)
        from cli.console import main as console_main

        return console_main(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "export-int8" and args.out is None and not args.best:
        parser.error("export-int8: the following arguments are required: --out (or --best)")
    if args.command == "segment" and not (args.model is not None and not args.best or
                                          args.model is None and args.best and args.run is not None):
        parser.error("segment: give --model FILE, or --run RUN --best (the INT8 model of the run's best round)")
    from common.config import ConfigError
    from common.data.containers import DataError

    try:
        for option in PATH_OPTIONS:  # a name too long, a symbolic link loop: one line naming the option
            if getattr(args, option, None) is not None:
                usable_path(f"--{option.replace('_', '-')}", getattr(args, option))
        if args.command == "demo":
            from cli.demo import demo

            return demo(args.hospitals, args.rounds, args.seed, args.home, args.timeout, args.results)
        if args.command == "simulate":
            overrides = parse_overrides(args.run_config)
            if args.overwrite:
                overrides["overwrite-run"] = True
            return simulate(args.hospitals, overrides, parse_overrides(args.federation_config, "--federation-config"),
                            args.home, args.timeout)
        if args.command == "partition":
            return partition_command(args)
        if args.command in ("export-int8", "segment"):
            return int8_command(args)
        if args.command == "evaluate":
            return evaluate_command(args)
        if args.command == "runs":
            return runs_command(args)
    except (ConfigError, DataError) as error:
        print(f"fedmed: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a path the checks above could not foresee: one line naming the file, no traceback
        print(f"fedmed {args.command}: {error}", file=sys.stderr)
        return 2
    except RunStopped as stopped:  # after the run's processes were ended (simulate's finally)
        print(f"fedmed: stopped ({stopped})", file=sys.stderr)
        return EXIT_STOPPED[stopped.signum]
    except Exception as error:  # anything else: one line, the traceback only when asked for
        if os.environ.get("FEDMED_DEBUG"):
            raise
        print(f"fedmed {args.command}: {type(error).__name__}: {error} (FEDMED_DEBUG=1 shows where)",
              file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
