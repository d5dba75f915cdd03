"""Runs stop when asked: Ctrl-C, SIGTERM and ``--timeout`` end ``fedmed simulate`` and every process it started
(SuperLink, SuperExec, flwr-simulation, Ray), checked by PID; a hospital count the run config cannot work with
is refused before anything starts; a resumed run keeps its checkpoint's name."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cli import launch, simulate
from cli import main as cli
from cli.launch import ProcessInfo, marked_processes, process_table, process_tree, start_process, terminate_tree

ROOT = Path(__file__).resolve().parent.parent
#: a run that would take many minutes: it is stopped long before its end
LONG_RUN = {"model": "small-cnn", "image-size": 8, "synthetic-samples": 60, "batch-size": 16,
            "min-partition-size": 5, "num-server-rounds": 2000, "run-name": "long"}


def alive(procs: dict[int, ProcessInfo]) -> dict[int, str]:
    """Those still running (same PID and start time, not zombies), with their command lines."""
    left = {}
    for pid, info in procs.items():
        now = process_table().get(pid)
        if now is not None and now.start == info.start and now.state != "Z":
            try:
                left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
            except OSError:
                continue
    return left


def wait_until(condition, timeout: float, poll: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return condition()


# --- the process-tree helpers ----------------------------------------------------------------------
SLEEPERS = ("sleep 301 & "                                  # a plain child
            "setsid sleep 302 & "                           # a new session: out of the group killpg reached
            "(setsid sleep 303 &) ; "                       # an orphan: reparented to init, found by its mark
            "(trap '' TERM; exec sleep 304) & "             # deaf to SIGTERM: needs the SIGKILL
            "wait")


def sleepers(procs) -> dict[str, int]:
    found = {}
    for pid in procs:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[0] == b"sleep":
            found[cmd[1].decode()] = pid
    return found


def test_stop_ends_the_whole_tree_including_processes_that_left_the_group(tmp_path):
    process = start_process("sleepers", ["bash", "-c", SLEEPERS], tmp_path, tmp_path / "logs", env=dict(os.environ))
    try:
        assert wait_until(lambda: len(sleepers(marked_processes([process.mark]))) == 4, 10)
        marked = marked_processes([process.mark])
        tree = process_tree([process.pid])
        by_mark, by_tree = sleepers(marked), sleepers(tree)
        assert set(by_mark) == {"301", "302", "303", "304"}
        assert set(by_tree) == {"301", "302", "304"}  # the orphan is no descendant any more
        assert process_table()[by_tree["302"]].sid != process.pid  # it escaped the session
        everything = {**tree, **marked}

        started = time.monotonic()
        assert process.stop(grace=1.0) == []
        assert time.monotonic() - started < 8
        assert alive(everything) == {}
        assert not process.running() and process not in launch.running_processes()
    finally:
        launch.stop_all(grace=0.5)


def processes_whose_cmdline_starts(text: str) -> dict[int, ProcessInfo]:
    found = {}
    for pid, info in process_table().items():
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(text.encode()) and info.state != "Z":
                found[pid] = info
        except OSError:
            continue
    return found


def test_stop_ends_processes_that_were_orphaned_and_hide_their_launch_mark(tmp_path):
    """What Ray's agents do when the ServerApp that started Ray is SIGKILLed: their parent dies, so they are no one's
    descendants any more (reparented to init, in a session of their own), and their launch mark cannot be read
    (Ray's ``setproctitle`` overwrites the environment /proc shows; ``env -i`` starts with none). stop() still ends
    them: they were seen in the tree while their parent lived."""
    pytest.importorskip("ray")
    title = f"ray::DashboardAgent fedmed-test-{os.getpid()}-{time.monotonic_ns()}"
    nap = f"342.{os.getpid()}"  # seconds: a sleep no other test starts
    agent = f"import time, ray._raylet; ray._raylet.setproctitle({title!r}); time.sleep(341)"
    middle = tmp_path / "middle.sh"  # like a Ray head started by the ServerApp: it dies, its agents stay
    # (RAY_CLIENT_MODE, which importing ray put in this process's environment, is left out: importing ray rewrites an
    # inherited one, and setproctitle then leaves the environment before it readable)
    middle.write_text(f"env -i sleep {nap} &\nenv -u RAY_CLIENT_MODE {shlex.quote(sys.executable)} -c "
                      f"{shlex.quote(agent)} &\nsleep 4\n")
    process = start_process("escapers", ["bash", "-c", f"setsid bash {middle} & exec sleep 343"], tmp_path,
                            tmp_path / "logs", env=dict(os.environ))
    leaves: dict[int, ProcessInfo] = {}
    try:
        def orphaned() -> bool:
            leaves.update(processes_whose_cmdline_starts(title))  # once its title is set
            leaves.update(processes_whose_cmdline_starts(f"sleep\0{nap}"))
            return len(leaves) == 2 and not processes_whose_cmdline_starts(f"bash\0{middle}")

        assert wait_until(orphaned, 60), f"not orphaned in time: {leaves}"
        # they escaped all that stop() relied on before: the tree and its session, and the mark
        assert not set(leaves) & set(process_tree([process.pid])), "still in the tree"
        assert not set(leaves) & set(marked_processes([process.mark])), "the mark is still readable"
        assert process.stop(grace=1.0) == []
        assert alive(leaves) == {}
    finally:
        for pid in alive(leaves):
            os.kill(pid, signal.SIGKILL)
        launch.stop_all(grace=0.5)


def test_stop_all_spares_the_processes_it_is_told_to_keep(tmp_path):
    env = dict(os.environ)
    kept = start_process("kept", ["sleep", "321"], tmp_path, tmp_path / "logs", env=env)
    ours = start_process("ours", ["sleep", "322"], tmp_path, tmp_path / "logs", env=env)
    try:
        launch.stop_all(grace=1.0, keep=[kept])
        assert kept.running() and not ours.running()
        assert launch.running_processes() == [kept]
    finally:
        launch.stop_all(grace=0.5)
    assert not kept.running() and launch.running_processes() == []


def test_terminate_tree_without_marks_follows_children_out_of_their_session():
    """A process tree started without the launcher's mark (no new session either): the tree walk alone
    finds the child that called setsid."""
    root = subprocess.Popen(["bash", "-c", "setsid sleep 311 & sleep 312 & wait"])
    try:
        assert wait_until(lambda: len(sleepers(process_tree([root.pid]))) == 2, 10)
        tree = process_tree([root.pid])
        assert terminate_tree([root.pid], grace=2.0, reap=[root]) == []
        assert root.poll() is not None and alive(tree) == {}
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()


# --- the CLI: refused before anything starts ---------------------------------------------------------
def test_too_few_hospitals_are_refused_at_once_and_nothing_starts(tmp_path):
    home = tmp_path / "flwr-home"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli.main", "simulate", "--hospitals", "0", "--home", str(home),
                           "--run-config", f"results-dir='{tmp_path / 'results'}' min-available-hospitals=3 "
                                           "min-train-hospitals=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - started < 30  # (mostly Python's start-up)
    assert "--hospitals 0" in done.stderr and "min-available-hospitals=3" in done.stderr
    assert "min-train-hospitals=2" in done.stderr and "Traceback" not in done.stderr
    assert not home.exists() and not (tmp_path / "results").exists()


def test_too_few_hospitals_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "start_superlink", lambda *a, **k: pytest.fail("nothing may start"))
    code = cli.main(["simulate", "--hospitals", "1", "--home", str(tmp_path / "h"), "--run-config",
                     f"results-dir='{tmp_path / 'results'}'"])
    assert code == 2
    assert "--hospitals 1" in capsys.readouterr().err


# --- the CLI's own flow, with the Flower processes faked ------------------------------------------------
class FakeFlower:
    """Stands in for cli.launch's process and run functions: records what simulate() asks."""

    def __init__(self, monkeypatch, wait):
        self.submitted: list[dict] = []
        self.commands: list[tuple] = []
        self.stopped = 0
        monkeypatch.setattr(launch, "start_superlink", lambda *a, **k: None)
        monkeypatch.setattr(launch, "submit_run", self.submit)
        monkeypatch.setattr(launch, "wait_for_run", wait)
        monkeypatch.setattr(launch, "flwr", lambda home, *args, **k: self.commands.append(args))
        monkeypatch.setattr(launch, "stop_all", self.stop_all)
        monkeypatch.setattr(launch, "run_log", lambda *a, **k: "")

    def submit(self, home, connection, run_config, federation_config):
        self.submitted.append(dict(run_config))
        return 7

    def stop_all(self, grace=5.0, keep=()):
        self.stopped += 1


def write_checkpoint(run_dir: Path, rnd: int = 2) -> Path:
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True)
    config = np.frombuffer(json.dumps({"run-name": run_dir.name}).encode(), dtype=np.uint8)
    np.savez(folder / f"round-{rnd:05d}.npz", **{"run/config": config})
    return folder / f"round-{rnd:05d}.npz"


def timed_out(*args, **kwargs):
    raise TimeoutError("run 7 not finished")


@pytest.mark.parametrize("point_at", ["folder", "file"])
def test_resume_keeps_the_checkpoints_run_name_and_timeout_stops_with_124(tmp_path, monkeypatch, capsys, point_at):
    results = tmp_path / "results"
    checkpoint = write_checkpoint(results / "ward-7")
    fake = FakeFlower(monkeypatch, timed_out)
    source = results / "ward-7" if point_at == "folder" else checkpoint
    code = cli.main(["simulate", "--hospitals", "2", "--home", str(tmp_path / "h"), "--timeout", "5", "--run-config",
                     f"results-dir='{results}' resume-from='{source}' num-server-rounds=4"])
    out, err = capsys.readouterr()
    assert code == simulate.EXIT_TIMEOUT
    (submitted,) = fake.submitted
    assert not submitted.get("run-name")  # the ServerApp takes the checkpoint's
    assert f"results in {results / 'ward-7'}\n" in out
    assert "--timeout 5s" in err and f"partial results in {results / 'ward-7'}" in err
    assert fake.commands == [("stop", "7", "local")] and fake.stopped >= 1


def test_overwrite_flag_sets_overwrite_run(tmp_path, monkeypatch, capsys):
    fake = FakeFlower(monkeypatch, timed_out)
    cli.main(["simulate", "--hospitals", "2", "--home", str(tmp_path / "h"), "--overwrite", "--run-config",
              f"results-dir='{tmp_path}' run-name='again'"])
    assert fake.submitted[0]["overwrite-run"] is True and fake.submitted[0]["run-name"] == "again"
    cli.main(["simulate", "--hospitals", "2", "--home", str(tmp_path / "h"), "--run-config",
              f"results-dir='{tmp_path}' run-name='again'"])
    assert "overwrite-run" not in fake.submitted[1]


def round_record(rnd: int, aggregated: list[str]) -> dict:
    return {"round": rnd, "chosen": ["a", "b"], "aggregated": aggregated, "missing": [], "refused": {},
            "bytes_up": 0, "bytes_down": 0, "seconds": 0.1}


@pytest.mark.parametrize(("aggregated", "problem"), [
    ([["a", "b"], ["a"], ["b"]], None),
    ([["a"], [], ["a", "b"]], None),  # one empty round in the middle: the run still did its job
    ([[], [], []], "no round aggregated"),
    ([["a", "b"], [], []], "rounds 2-3 (the last) aggregated no"),  # e.g. a dead Ray actor from round 2 on
    ([["a", "b"]], "only 1 of 3 rounds"),
    ([], "no round was recorded"),
])
def test_a_completed_run_that_aggregated_nobody_is_a_failure(tmp_path, monkeypatch, capsys, aggregated, problem):
    run_dir = tmp_path / "results" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(round_record(i + 1, names)) + "\n" for i, names in enumerate(aggregated)))
    (run_dir / "config.json").write_text(json.dumps({"num-server-rounds": 3}))
    FakeFlower(monkeypatch, lambda *a, **k: "finished:completed")
    monkeypatch.setattr("server_app.results.render_summary", lambda config, history: "summary")
    code = cli.main(["simulate", "--hospitals", "2", "--home", str(tmp_path / "h"), "--run-config",
                     f"results-dir='{tmp_path / 'results'}' run-name='r' num-server-rounds=3"])
    err = capsys.readouterr().err
    if problem is None:
        assert code == 0, err
    else:
        assert code == 1 and problem in err


# --- the real thing: a simulation stopped by a signal ----------------------------------------------------
FLOWER_PROCESSES = ("flower-superlink", "flower-superexec", "flwr-simulation", "raylet", "gcs_server",
                    "ClientAppActor", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


class Seen(dict):
    """Every process seen in the CLI's tree (PID -> ProcessInfo), and which Flower and Ray processes they were."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def add_tree_of(self, pid: int) -> None:
        """Add the CLI's process tree and the launch-marked processes that left it."""
        table = process_table()
        tree = process_tree([pid], table)
        marks = set()
        for child in tree:
            try:
                for item in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                    if item.startswith(launch.LAUNCH_MARK.encode() + b"="):
                        marks.add(item.split(b"=", 1)[1].decode())
            except OSError:
                continue
        for child, info in {**tree, **marked_processes(marks, table)}.items():
            if child == pid:
                continue
            self[child] = info
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            self.names.update(name for name in FLOWER_PROCESSES if name in cmd)


def stop_a_running_simulation(tmp_path: Path, signum: int, ready, act=None,
                              timeout: float = 6 * 3600) -> tuple[int, float, Seen, str]:
    """Start a long ``fedmed simulate``, send ``signum`` once ``ready(run_dir, seen)`` (or call ``act(seen)``
    instead); return the exit code, the seconds from the signal to the exit, every process seen in its tree, and its
    stderr."""
    results = tmp_path / "results"
    config = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in LONG_RUN.items())
    args = [sys.executable, "-m", "cli.main", "simulate", "--hospitals", "2", "--home", str(tmp_path / "home"),
            "--timeout", str(timeout),
            "--run-config", f"{config} results-dir='{results}' state-dir='{tmp_path / 'state'}'"]
    cli_process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = Seen()
    run_dir = results / LONG_RUN["run-name"]
    try:
        deadline = time.monotonic() + 900  # a wait, not a speed claim: a loaded machine takes longer to round one
        while not ready(run_dir, seen):
            assert cli_process.poll() is None, cli_process.communicate()
            assert time.monotonic() < deadline, f"not ready in time; seen {sorted(seen.names)}"
            seen.add_tree_of(cli_process.pid)
            time.sleep(0.3)
        seen.add_tree_of(cli_process.pid)
        signalled = time.monotonic()
        if act is None:
            cli_process.send_signal(signum)
        else:
            act(seen)
        _, err = cli_process.communicate(timeout=60 if act is None else timeout + 60)
        return cli_process.returncode, time.monotonic() - signalled, seen, err
    finally:
        if cli_process.poll() is None:
            cli_process.kill()
            cli_process.communicate()
        for pid in alive(seen):  # whatever the assertions say: leave nothing behind
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def stop_bound(seconds: float = 30.0) -> float:
    """How long a stop may take: ``seconds`` on an idle machine, longer in proportion to the load on a busy one (the
    claim is that it stops, and soon; not how fast a starved machine tears Ray down)."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def metrics_size(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").stat().st_size
    except OSError:
        return 0


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_stops_the_simulation_and_every_process_it_started(tmp_path):
    def after_round_one(run_dir, seen):
        return metrics_size(run_dir) > 0

    code, seconds, seen, err = stop_a_running_simulation(tmp_path, signal.SIGINT, after_round_one)
    assert code == 130, err[-3000:]
    assert seconds < stop_bound()
    assert {"flower-superlink", "flower-superexec", "flwr-simulation", "raylet", "ClientAppActor"} <= seen.names
    assert alive(seen) == {}
    run_dir = tmp_path / "results" / LONG_RUN["run-name"]
    assert "stopped (SIGINT)" in err and f"partial results in {run_dir}" in err
    size = metrics_size(run_dir)
    time.sleep(3)
    assert metrics_size(run_dir) == size > 0  # nothing trains on


@pytest.mark.integration
@pytest.mark.slow  # a whole Ray simulation: the fast tier's stop tests cover the process tree
def test_sigterm_stops_the_simulation_once_ray_runs(tmp_path):
    def ray_started(run_dir, seen):  # cheaper than waiting for a round
        return "raylet" in seen.names

    code, seconds, seen, err = stop_a_running_simulation(tmp_path, signal.SIGTERM, ray_started)
    assert code == 143, err[-3000:]
    assert seconds < stop_bound()
    assert {"flower-superlink", "flower-superexec", "flwr-simulation", "raylet"} <= seen.names
    assert alive(seen) == {}
    assert "stopped (SIGTERM)" in err


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.integration
@pytest.mark.slow
def test_a_serverapp_killed_with_sigkill_leaves_no_ray_process_behind(tmp_path):
    """SIGKILL of the ServerApp's process (flwr-simulation, which started Ray): Ray's raylet, GCS and agents lose
    their parent; the CLI still ends with every process the launch started gone, Ray's agents included."""
    def ray_agents_run(run_dir, seen):
        return {"raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= seen.names

    def kill_the_serverapp(seen):
        serverapps = [pid for pid in alive(seen) if "flwr-simulation" in command_line(pid)]
        assert serverapps
        for pid in serverapps:
            os.kill(pid, signal.SIGKILL)

    code, _, seen, err = stop_a_running_simulation(tmp_path, signal.SIGKILL, ray_agents_run, act=kill_the_serverapp,
                                                   timeout=90)
    assert code in (1, simulate.EXIT_TIMEOUT), err[-3000:]  # a failed run, or one Flower never calls finished
    assert {"flower-superlink", "flwr-simulation", "raylet", "ray::DashboardAgent"} <= seen.names
    assert alive(seen) == {}
