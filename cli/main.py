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
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import tomllib


def parse_overrides(text: str, what: str = "--run-config") -> dict[str, Any]:
    """``"a=1 b='x y'"`` -> ``{"a": 1, "b": "x y"}`` (values are TOML; bare words are strings)."""
    from common.settings import ConfigError

    values: dict[str, Any] = {}
    try:
        items = shlex.split(text or "")
    except ValueError as error:  # e.g. "No closing quotation"
        raise ConfigError(f"{what}: {text!r} cannot be split into key=value items ({error})") from None
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{what}: {item!r} is not key=value")
        key, raw = item.split("=", 1)
        try:
            values[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            values[key.strip()] = raw
    return values


def usable_path(what: str, value: str | Path) -> Path:
    """``value`` made absolute; ConfigError naming ``what`` (a run-config key, a command-line option) when the file
    system cannot take it at all: a name too long, a symbolic link loop, a folder that cannot be searched. A path
    that merely does not exist (yet) is fine here: what needs it says so."""
    from common.settings import ConfigError

    try:
        path = Path(value).resolve()
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return path
    except OSError as error:  # ENAMETOOLONG, ELOOP (Python 3.13's resolve), EACCES, ...
        raise ConfigError(f"{what}: {str(value)!r} cannot be used as a path: {error.strerror or error}") from None
    except RuntimeError:  # Python 3.11's resolve() on a symbolic link loop
        raise ConfigError(f"{what}: {str(value)!r} cannot be used as a path: it leads into a symbolic link "
                          "loop") from None
    return path


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line naming the option and value (no usage block: --help has it)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def positive(kind: type, least: float = 1):
    """An argparse type: a number of ``kind`` of at least ``least`` (the error names the value)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value >= least or value != value:
            raise argparse.ArgumentTypeError(f"{text!r}: it must be at least {least:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def check_app_keys(values: dict[str, Any], app_dir: Path | None = None) -> None:
    """Run-config keys Flower would refuse for this app (only ``[tool.flwr.app.config]`` of its pyproject.toml may
    be set): ConfigError naming the key, before anything starts."""
    from cli.launch import PROJECT_ROOT
    from common.config import misspelt_key
    from common.settings import ConfigError

    listed = tomllib.loads(((app_dir or PROJECT_ROOT) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    known = set(flatten_keys(listed))
    for key in values:
        if key not in known:
            hint = misspelt_key(key) or "the app's pyproject.toml [tool.flwr.app.config] lists every key it takes"
            raise ConfigError(f"--run-config: {key!r} is not a run-config key of this app ({hint})")


def flatten_keys(table: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in table.items():
        name = f"{prefix}{key}"
        keys += flatten_keys(value, f"{name}.") if isinstance(value, dict) else [name]
    return keys


def check_federation_keys(values: dict[str, Any]) -> None:
    """``--federation-config`` keys Flower's simulation engine does not know: ConfigError naming them."""
    from flwr.proto.federation_config_pb2 import SimulationConfig

    from common.settings import ConfigError

    fields = [field.name.replace("_", "-") for field in SimulationConfig.DESCRIPTOR.fields]
    unknown = sorted(key for key in values if key not in fields)
    if unknown:
        raise ConfigError(f"--federation-config: {', '.join(map(repr, unknown))} is not a key of Flower's simulation "
                          f"engine ({', '.join(fields)})")
    if "num-supernodes" in values:
        raise ConfigError("--federation-config: num-supernodes is --hospitals here")


def check_named_code(cfg) -> None:
    """Every network and loader the job names can be imported and is one (common/trust/code_gate.py's rules): a
    ConfigError naming the key, here, before Flower starts (the ServerApp would fail on it after)."""
    from common.settings import ConfigError
    from common.trust.code_gate import resolution_problems

    problems = resolution_problems(cfg)
    if problems:
        raise ConfigError(problems[0])


def is_path_key(key: str) -> bool:
    return key.endswith(("-dir", "-file", "-path")) or key in ("resume-from", "hospital-keys")


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """Relative paths are relative to where the user stands, not to where Flower runs the apps (ConfigError naming
    the key for a path the file system cannot take)."""
    return {k: (str(usable_path(k, v)) if is_path_key(k) and isinstance(v, str) and v else v)
            for k, v in values.items()}


def check_flower_config(what: str, values: dict[str, Any]) -> None:
    """Values Flower's ``--run-config`` / ``--federation-config`` cannot carry (a string holding both quote kinds
    or a line break): ConfigError naming the option and key, before anything starts."""
    from cli.launch import format_config
    from common.settings import ConfigError

    try:
        format_config(values)
    except ValueError as error:
        raise ConfigError(f"{what}: {error}") from None


class RunStopped(BaseException):
    """SIGINT or SIGTERM while a run was on (a BaseException, like KeyboardInterrupt: nothing swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: Exit codes: 128 + the signal, as a shell reports it, and timeout(1)'s for --timeout.
EXIT_STOPPED = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
EXIT_TIMEOUT = 124
STOP_GRACE = 5.0  # seconds the Flower processes have after SIGTERM before SIGKILL


def _raise_stopped(signum, frame) -> None:
    raise RunStopped(signum)


@contextlib.contextmanager
def signals(handler) -> Iterator[None]:
    """Handle SIGTERM, SIGHUP and SIGINT with ``handler`` inside the block (signals a shell made this program
    ignore, such as SIGINT in a background job or SIGHUP under nohup, stay ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _still_stopping(signum, frame) -> None:
    print("fedmed: still stopping the run's processes, a few seconds more", file=sys.stderr, flush=True)


def resumed_run_dir(resume_from: str, results_dir: str) -> Path:
    """Where a resumed run without its own run-name writes: the checkpoint's run name under results-dir
    (the ServerApp takes the name from the checkpoint). A checkpoint lies in <run>/checkpoints/round-NNNNN.npz;
    resume-from names that file or the run folder."""
    source = Path(resume_from)
    folder = source.parent.parent if source.is_file() else source
    name = folder.name
    try:
        import numpy as np

        from server_app.checkpoint import find_checkpoint

        with np.load(find_checkpoint(source), allow_pickle=False) as archive:
            name = json.loads(archive["run/config"].tobytes().decode())["run-name"] or name
    except Exception:  # unreadable here: the ServerApp says why; the folder's name is the best guess
        pass
    return Path(results_dir) / name


def run_problem(history: list[dict[str, Any]], num_rounds: int) -> str | None:
    """Why a run Flower calls completed did not do its job (None when it did): no round, no round that
    aggregated any hospital, rounds missing, or hospitals failing until the end."""
    if not history:
        return "no round was recorded"
    empty = [r["round"] for r in history if not r.get("aggregated")]
    if len(empty) == len(history):
        return f"no round aggregated any hospital's update (rounds {history[0]['round']}-{history[-1]['round']})"
    if history[-1]["round"] < num_rounds:
        return f"only {history[-1]['round']} of {num_rounds} rounds were recorded"
    if empty and empty[-1] == history[-1]["round"]:
        first = empty[-1]
        while first - 1 in empty:
            first -= 1
        return f"rounds {first}-{empty[-1]} (the last) aggregated no hospital's update"
    return None


def simulate(hospitals: int, overrides: dict[str, Any], engine: dict[str, Any], home: Path,
             timeout: float, label: str = "", summary: bool = True) -> int:
    """Run the app in Flower's simulation engine on a private local SuperLink; print the results (``summary``:
    the run's table; each round's progress line always, after ``label`` if one is given).

    Ctrl-C, SIGTERM and ``--timeout`` stop the run (``flwr stop``) and every process it started, and return
    130, 143 or 124; a run that did not complete returns 1; a refused configuration 2, before anything starts."""
    from common.config import fedmed_keys_of, load_job_config, upgrade_keys
    from server_app.results import read_history, render_summary

    defaults = {"results-dir": "results", "state-dir": "state"}
    run_config = upgrade_keys(absolute_paths({**defaults, **overrides}))  # classifier= is model=: Flower knows one
    cfg = load_job_config(fedmed_keys_of(run_config), check_paths=True)  # fail here, before anything starts
    needed = max(cfg.min_available_hospitals, cfg.min_train_hospitals)
    if hospitals < needed:
        print(f"fedmed: --hospitals {hospitals} is too few for this run config: min-available-hospitals="
              f"{cfg.min_available_hospitals} and min-train-hospitals={cfg.min_train_hospitals} need at least "
              f"{needed} hospitals (lower them in --run-config or simulate more hospitals); nothing was started",
              file=sys.stderr)
        return 2
    if cfg.run_name:
        run_dir = Path(run_config["results-dir"]) / cfg.run_name
    elif cfg.resume_from:  # the ServerApp keeps the checkpoint's name, so the hospitals find their saved state
        run_dir = resumed_run_dir(cfg.resume_from, run_config["results-dir"])
    else:
        run_config["run-name"] = f"{cfg.task}-{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(run_config["results-dir"]) / run_config["run-name"]
    check_flower_config("--run-config", run_config)
    check_flower_config("--federation-config", engine)
    check_app_keys(overrides)
    check_federation_keys(engine)
    check_named_code(cfg)

    from cli.launch import (
        FlowerHome,
        flwr,
        free_port,
        run_log,
        running_processes,
        simulation_resources,
        start_superlink,
        stop_all,
        submit_run,
        wait_for_run,
    )

    deadline = time.monotonic() + timeout  # --timeout counts from here, start-up included
    others = running_processes()  # started by whoever called this (tests): not ours to stop
    flower_home = FlowerHome(home.resolve())
    run_id: int | None = None
    printed = 0

    def progress(_status: str = "") -> None:
        nonlocal printed
        if (run_dir / "metrics.jsonl").exists():
            history = read_history(run_dir)
            for record in history[printed:]:
                from common.engine.round_engine import describe

                print(f"{label}round {record['round']}: {describe(record)}", flush=True)
            printed = len(history)

    try:
        with signals(_raise_stopped):
            try:
                start_superlink(flower_home, free_port(), simulation=True)
                run_id = submit_run(flower_home, "local", run_config, simulation_resources(hospitals, engine))
                print(f"{label}run {run_id}: {hospitals} simulated hospitals, results in {run_dir}", flush=True)
                left = max(1.0, deadline - time.monotonic())
                status = wait_for_run(flower_home, "local", run_id, left, on_poll=progress)
            except RunStopped as stopped:
                why, code = f"stopped ({stopped})", EXIT_STOPPED[stopped.signum]
            except TimeoutError:
                why, code = f"stopped after --timeout {timeout:g}s", EXIT_TIMEOUT
            else:
                why, code = "", None
            if code is not None:
                with signals(_still_stopping):  # a second Ctrl-C must not cut the clean-up short
                    if run_id is not None:
                        try:  # best effort: the processes go below whatever the SuperLink answers
                            flwr(flower_home, "stop", str(run_id), "local", timeout=15)
                        except Exception:
                            pass
                    stop_all(STOP_GRACE, keep=others)
                run = f"run {run_id}" if run_id is not None else "the run (not submitted yet)"
                results = (f"partial results in {run_dir}" if run_dir.exists() else
                           f"no results were written (they would be in {run_dir})")
                print(f"fedmed: {run} {why}; its processes were ended; {results}", file=sys.stderr, flush=True)
                return code

            progress()
            if status != "finished:completed":
                print(run_log(flower_home, "local", run_id)[-6000:], file=sys.stderr)
                print(f"fedmed: run {run_id} ended with status {status}; partial results in {run_dir}",
                      file=sys.stderr)
                return 1
            history = read_history(run_dir) if (run_dir / "metrics.jsonl").exists() else []
            problem = run_problem(history, cfg.num_server_rounds)
            if problem:  # e.g. a dead Ray actor fails every hospital: Flower still calls the run completed
                print(run_log(flower_home, "local", run_id)[-6000:], file=sys.stderr)
                print(f"fedmed: run {run_id} failed: {problem}; see {run_dir / 'metrics.jsonl'}", file=sys.stderr)
                return 1
            if summary:
                print(render_summary(json.loads((run_dir / "config.json").read_text()), history))
                if (run_dir / "cross_site.md").exists():
                    print((run_dir / "cross_site.md").read_text())
                print(f"\nResults: {run_dir} (summary.md, metrics.jsonl, plots/)")
            return 0
    finally:
        with signals(_still_stopping):
            stop_all(STOP_GRACE, keep=others)


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
    from common.quantization.int8 import describe_export, export_int8, segment_folder
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
    segment.add_argument("--out", type=Path, required=True, help="folder for the mask PNGs (0/255, input size)")

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
    if (sys.argv[1:] if argv is None else list(argv))[:1] in (["app-hash"], ["policy"]):  # a hospital operator's
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
