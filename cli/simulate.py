"""``fedmed simulate``: the app in Flower's simulation engine on a private local SuperLink, every key and path
checked before anything starts, and every process it started stopped on Ctrl-C, SIGTERM or ``--timeout``."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import tomllib

from cli.arguments import absolute_paths


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
    for field in SimulationConfig.DESCRIPTOR.fields:
        key = field.name.replace("_", "-")
        if key in values:
            problem = federation_value_problem(key, field.type, values[key])
            if problem:
                raise ConfigError(f"--federation-config: {key}={values[key]!r}: {problem}")


def federation_value_problem(key: str, kind: int, value: Any) -> str | None:
    """Why Flower's simulation engine would refuse ``value`` for ``key`` (a field of its SimulationConfig, of
    protobuf type ``kind``) once it has started; None when it takes it."""
    import logging

    from google.protobuf.descriptor import FieldDescriptor as Field

    if kind == Field.TYPE_BOOL:
        return None if isinstance(value, bool) else "must be true or false"
    if kind in (Field.TYPE_UINT32, Field.TYPE_UINT64):
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32
        return None if ok else "must be a whole number, 0 or more"
    if kind in (Field.TYPE_FLOAT, Field.TYPE_DOUBLE):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        return None if ok else "must be a number, 0 or more"
    if not isinstance(value, str):
        return "must be a string"
    if key == "backend" and value != "ray":
        return "Flower's simulation engine has the backend 'ray'"
    if key.endswith("logging-level") and value.upper() not in logging.getLevelNamesMapping():
        return f"must be a logging level ({', '.join(sorted(logging.getLevelNamesMapping()))})"
    return None


def check_named_code(cfg) -> None:
    """Every network and loader the job names can be imported and is one (common/trust/code_gate.py's rules): a
    ConfigError naming the key, here, before Flower starts (the ServerApp would fail on it after)."""
    from common.settings import ConfigError
    from common.trust.code_gate import resolution_problems

    problems = resolution_problems(cfg)
    if problems:
        raise ConfigError(problems[0])


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
