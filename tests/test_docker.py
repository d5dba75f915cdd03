"""docker-compose on a real Docker engine: the image builds, the consortium comes up with TLS and authentication
and three hospitals on data written by ``fedmed partition``, a run submitted from the host with ``flwr run``
completes with its results on the host; a hospital whose container is killed mid-run is recorded as missing,
and after ``docker-compose start`` it rejoins with its saved state. Everything the test made is removed, the Docker
engine too when the test started it (run directly, as the README's command does; ``.ci/run`` starts one first and
stops it itself)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cli.launch import FlowerHome, flwr, free_port, run_log, submit_run, wait_for_run
from cli.main import main as fedmed
from server_app.results import aggregated_in, read_history

from .conftest import ROOT

ENGINE = ROOT.parent / "shared" / "tools" / "docker-engine.sh"
BASE_IMAGE = "fedmed-base/python:3.11"
HOSPITALS = ("hospital-a", "hospital-b", "hospital-c")


def sh(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None,
       check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check:
        assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                     f"{done.stderr[-3000:]}"
    return done


def docker_engine_running() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextlib.contextmanager
def docker_engine_for(script: Path, running=docker_engine_running):
    """A Docker engine (and the base image) for the block, from ``script`` (docker-engine.sh). A test stops what it
    starts: where no engine ran before, ``script --stop`` ends the one it started when the block ends, however it
    ends (the script may start dockerd and fail after it, e.g. building the base image); an engine that was
    running before (``.ci/run`` starts one) is left running."""
    started_here = not running()
    try:
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1200)
        if done.returncode == 3:
            pytest.skip(f"no Docker engine can start on this machine: {done.stdout.strip()} {done.stderr.strip()}")
        assert done.returncode == 0, done.stdout + done.stderr
        yield
    finally:
        if started_here:
            subprocess.run(["bash", str(script), "--stop"], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def docker_engine():
    if not ENGINE.is_file():
        pytest.skip(f"no Docker engine script at {ENGINE} (../shared/tools beside the repository)")
    with docker_engine_for(ENGINE):
        yield


@pytest.fixture(scope="module")
def image(docker_engine):
    tag = f"fedmed:test-{uuid.uuid4().hex[:8]}"
    sh("docker", "build", "--network", "host", "-f", "deploy/Dockerfile", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
       "--build-arg", "TORCH_INDEX=", "-t", tag, ".", cwd=ROOT, timeout=1500)
    yield tag
    sh("docker", "rmi", "-f", tag, check=False)


@pytest.fixture
def consortium(tmp_path, image):
    """docs/deployment.md's compose steps in a fresh folder: certificates, keys, sites, .env, `docker-compose up -d`."""
    project = tmp_path / "consortium"
    (project / "deploy").mkdir(parents=True)
    shutil.copy(ROOT / "docker-compose.yml", project / "docker-compose.yml")
    sh("bash", str(ROOT / "deploy" / "make_certificates.sh"), "deploy/certs", "superlink", "localhost", "127.0.0.1",
       cwd=project)
    sh("bash", str(ROOT / "deploy" / "make_hospital_keys.sh"), "deploy/keys", *HOSPITALS, cwd=project)
    for hospital in HOSPITALS:  # each hospital's officer pins the consortium's keys in its own policy
        sh("bash", str(ROOT / "deploy" / "make_hospital_policy.sh"), f"deploy/policies/{hospital}.toml",
           *(f"deploy/keys/{other}.pub" for other in HOSPITALS), cwd=project, env={"FEDMED_PYTHON": sys.executable})
    assert fedmed(["partition", "--hospitals", "3", "--out", str(project / "sites"), "--run-config",
                   "synthetic-samples=240 image-size=16 min-partition-size=5"]) == 0
    (project / "results").mkdir()
    port = free_port()
    name = f"fedmedtest{uuid.uuid4().hex[:6]}"
    env = sh("bash", str(ROOT / "deploy" / "compose_env.sh"), env={"FEDMED_PYTHON": sys.executable}).stdout
    (project / ".env").write_text(f"{env}FEDMED_IMAGE={image}\nFEDMED_PORT={port}\nCOMPOSE_PROJECT_NAME={name}\n")
    compose = ["docker-compose", "-p", name]
    try:
        sh(*compose, "up", "-d", cwd=project, timeout=600)
        home = FlowerHome(tmp_path / "flwr-home")
        home.add_connection("consortium", f"127.0.0.1:{port}", project / "deploy" / "certs" / "ca.crt")
        yield project, compose, home
    finally:
        logs = sh(*compose, "logs", "--no-color", cwd=project, check=False).stdout
        (tmp_path / "compose.log").write_text(logs)
        sh(*compose, "down", "-v", "--remove-orphans", cwd=project, timeout=300, check=False)
        left = sh("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={name}", check=False).stdout
        assert not left.strip(), f"containers left behind: {left}"


def run_config(name: str, rounds: int, **extra) -> dict:
    return {"dataset": "npz", "test-dir": "/data/test", "model": "small-cnn", "image-size": 16,
            "batch-size": 16, "num-server-rounds": rounds, "min-available-hospitals": 3, "min-train-hospitals": 2,
            "run-name": name, "hospital-keys": "/hospital-keys", "secure-aggregation.enabled": True,
            "secure-aggregation.update-norm-bound": 5.0, **extra}  # the hospitals' policies require it


def wait_for(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}")


def history_of(project: Path, name: str) -> list[dict]:
    path = project / "results" / name
    return read_history(path) if (path / "metrics.jsonl").is_file() else []


FAKE_ENGINE = """echo "${1:-start}" >> "$FAKE_ENGINE_CALLS"
[ "${1:-}" = "--stop" ] || exit "${FAKE_ENGINE_EXIT:-0}"
"""


@pytest.mark.parametrize(("running_before", "exit_code", "body_fails", "calls"), [
    (False, 0, False, ["start", "--stop"]),  # the README's command: the test started it, the test stops it
    (False, 0, True, ["start", "--stop"]),  # ... however the test ends
    (False, 3, False, ["start", "--stop"]),  # no engine possible (it may have started dockerd before failing)
    (True, 0, False, ["start"]),  # .ci/run started it: left running
])
def test_the_docker_engine_is_stopped_after_the_test_only_when_the_test_started_it(tmp_path, monkeypatch,
                                                                                   running_before, exit_code,
                                                                                   body_fails, calls):
    script = tmp_path / "docker-engine.sh"
    script.write_text(FAKE_ENGINE)
    monkeypatch.setenv("FAKE_ENGINE_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("FAKE_ENGINE_EXIT", str(exit_code))
    ran = []
    expected = pytest.skip.Exception if exit_code == 3 else RuntimeError if body_fails else None
    with contextlib.ExitStack() as stack:
        if expected is not None:
            stack.enter_context(pytest.raises(expected))
        with docker_engine_for(script, running=lambda: running_before):
            ran.append(True)
            if body_fails:
                raise RuntimeError("the test failed")
    assert ran == ([] if exit_code == 3 else [True])
    assert (tmp_path / "calls").read_text().split() == calls


def docker_isolates_networks() -> bool:
    """Whether this Docker engine keeps its networks apart: Docker does that with iptables rules, and the engine
    ../shared/tools/docker-engine.sh starts here runs without them ({"iptables": false}), where the host routes
    between two internal networks. A user's Docker has them on by default."""
    try:
        return json.loads(Path("/etc/docker/daemon.json").read_text()).get("iptables", True) is not False
    except (OSError, ValueError):
        return True


#: run in hospital-a's ClientApp container: which addresses accept a connection
REACH = """
import json, socket
def reaches(host, port):
    try:
        socket.create_connection((host, port), 3).close()
        return True
    except OSError:
        return False
print(json.dumps({"its supernode": reaches("10.209.1.2", 9094), "the superlink": reaches("superlink", 9200),
                  "another hospital": reaches("10.209.2.2", 9094), "the internet": reaches("1.1.1.1", 53)}))
"""


@pytest.mark.docker
@pytest.mark.integration
@pytest.mark.slow
def test_compose_consortium_runs_loses_a_hospital_and_takes_it_back(consortium):
    project, compose, home = consortium
    no_crash_loops = sh(*compose, "ps", cwd=project).stdout
    assert "Restarting" not in no_crash_loops and "Exit 1" not in no_crash_loops, no_crash_loops

    first = submit_run(home, "consortium", run_config("compose-first", 2))
    status = wait_for_run(home, "consortium", first, 600)
    assert status == "finished:completed", run_log(home, "consortium", first)[-4000:]
    history = history_of(project, "compose-first")
    assert [r["round"] for r in history] == [1, 2] and all(sorted(r["aggregated"]) == list(HOSPITALS)
                                                           for r in history)
    results = project / "results" / "compose-first"
    for path in (results / "summary.md", results / "checkpoints" / "round-00002.npz"):
        assert path.is_file() and path.stat().st_uid == os.getuid(), path  # on the host, owned by its user
    # from inside a hospital's ClientApp container, only its own SuperNode answers
    inside = sh(*compose, "exec", "-T", "hospital-a-clientapp", "python3", "-c", REACH, cwd=project)
    reached = json.loads(inside.stdout)
    expected = {"its supernode": True, "the superlink": False, "another hospital": False, "the internet": False}
    if not docker_isolates_networks():  # one internal network from another: that is Docker's iptables rules' job
        del expected["another hospital"], reached["another hospital"]
    assert reached == expected, reached

    # The restarted hospital is listed again only once the SuperLink has given up on its killed node (60 s
    # without a heartbeat) and the new one has joined, while rounds without it take seconds: the run goes on
    # until it is back in, then the test stops it.
    second = submit_run(home, "consortium", run_config("compose-second", 300, strategy="fedproin",
                                                       **{"round-timeout": 40.0}))
    wait_for(lambda: len(history_of(project, "compose-second")) >= 1, 300, "round 1 of the second run")
    sh(*compose, "kill", "hospital-c", "hospital-c-clientapp", cwd=project)
    wait_for(lambda: any("hospital-c" in r["missing"] for r in history_of(project, "compose-second")), 300,
             "a round that names hospital-c as missing")
    sh(*compose, "start", "hospital-c", "hospital-c-clientapp", cwd=project)

    def back_in(history):
        missed = [r["round"] for r in history if "hospital-c" in r["missing"]]
        return [r for r in history if missed and r["round"] > max(missed) and "hospital-c" in aggregated_in(r)]

    wait_for(lambda: back_in(history_of(project, "compose-second")), 600, "hospital-c training again")
    assert flwr(home, "stop", str(second), "consortium").returncode == 0
    status = wait_for_run(home, "consortium", second, 300)
    assert status == "finished:stopped", run_log(home, "consortium", second)[-4000:]
    history = history_of(project, "compose-second")
    missed = [r["round"] for r in history if "hospital-c" in r["missing"]]
    back = back_in(history)
    assert missed and back, [(r["round"], r["aggregated"], r["missing"]) for r in history]
    assert [r["round"] for r in history] == list(range(1, len(history) + 1))
    remembered = back[0]["hospital_metrics"]["hospital-c"]["state-from-round"]  # its memory from before the kill
    assert 1 <= remembered < back[0]["round"]


@pytest.mark.docker
@pytest.mark.integration
@pytest.mark.slow
def test_compose_consortium_comes_back_after_down_and_up_and_after_stop_and_start(consortium):
    """docs/deployment.md's restarts: `docker-compose down` (volumes kept) then `up -d`, and `stop` then `start`,
    bring the same consortium back (the registration step keeps the keys the SuperLink holds, the hospitals wait
    for it); each time a run completes with every hospital, and the hospitals keep their audit logs."""
    project, compose, home = consortium
    for attempt, (down, up) in enumerate([(None, None), (["down"], ["up", "-d"]), (["stop"], ["start"])]):
        if down is not None:
            sh(*compose, *down, cwd=project, timeout=300)
            sh(*compose, *up, cwd=project, timeout=600)
        name = f"compose-back-{attempt}"
        # each run from a model of its own seed: a hospital trains from a model whose sum it helped unmask only once
        run = submit_run(home, "consortium", run_config(name, 1, seed=attempt + 1))
        status = wait_for_run(home, "consortium", run, 600)
        assert status == "finished:completed", run_log(home, "consortium", run)[-4000:]
        assert sorted(history_of(project, name)[0]["aggregated"]) == list(HOSPITALS), attempt
        states = sh(*compose, "ps", cwd=project).stdout
        assert "Restarting" not in states, states
    registrations = sh(*compose, "logs", "--no-color", "register-hospitals", cwd=project, check=False).stdout
    assert "registered already" in registrations  # the second and third start found the keys in place
    audit = sh(*compose, "exec", "-T", "hospital-a", "cat", "/state/hospital/audit.jsonl", cwd=project).stdout
    runs = {line.split('"run":"')[1].split('"')[0] for line in audit.splitlines() if '"run":"compose-back' in line}
    assert runs == {"compose-back-0", "compose-back-1", "compose-back-2"}  # one log across the restarts
