"""A consortium across separate network hosts (network namespaces), with TLS and hospital authentication,
surviving a hospital killed mid-round, its restart, and a cut link; strangers are refused."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from cli.launch import (
    FlowerHome,
    TLSFiles,
    flwr,
    run_log,
    run_status,
    start_superlink,
    start_supernode,
    submit_run,
    wait_for_port,
    wait_for_run,
)
from cli.main import main as fedmed
from server_app.results import read_history

from .flower_processes import stopped_at_exit
from .netns import VirtualNetwork, require_netns

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the long tier (.ci/run)

ROOT = Path(__file__).resolve().parent.parent
HOSPITALS = ["hospital-00", "hospital-01", "hospital-02"]
PORT = 9200
#: The run's length if the test never stops it. A node that comes back is listed again only after its next
#: heartbeat reaches the SuperLink (Flower retries a failed one after up to 20 s, and keeps a silent node online
#: for 60 s), while rounds here take about a second; so each fault is undone once a round has seen it, the run
#: goes on until the hospital is back in, and then the test stops it.
MOST_ROUNDS = 300


def deploy_script(name: str, *args: str, env: dict | None = None) -> str:
    done = subprocess.run(["bash", str(ROOT / "deploy" / name), *map(str, args)], capture_output=True, text=True,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_tls_consortium_across_hosts_survives_faults(tmp_path):
    require_netns()
    sites = tmp_path / "sites"
    assert fedmed(["partition", "--hospitals", "3", "--out", str(sites),
                   "--run-config", "synthetic-samples=240 image-size=16 min-partition-size=5"]) == 0

    with VirtualNetwork(["superlink", *HOSPITALS, "intruder", "plain"]) as net:
        link_address = net.addresses["superlink"]
        deploy_script("make_certificates.sh", tmp_path / "certs", "superlink", link_address)
        deploy_script("make_hospital_keys.sh", tmp_path / "keys", *HOSPITALS, "intruder")
        tls = TLSFiles(tmp_path / "certs" / "ca.crt", tmp_path / "certs" / "server.pem",
                       tmp_path / "certs" / "server.key")
        home = FlowerHome(tmp_path / "flwr-home")
        superlink = start_superlink(home, PORT, host=link_address, simulation=False, tls=tls, supernode_auth=True,
                                    netns=net.netns("superlink"), connection="consortium")
        with stopped_at_exit(superlink) as started:
            wait_for_port(link_address, PORT, 60, superlink.process)
            deploy_script("register_hospitals.sh", "consortium", *[tmp_path / "keys" / f"{h}.pub" for h in HOSPITALS],
                          env=home.env)

            def hospital(name: str, key: str | None, tls_on: bool = True):
                node = start_supernode(
                    home, f"{link_address}:{PORT}", 9094,
                    {"hospital": name, "data-dir": str(sites / name if name in HOSPITALS else sites / "hospital-00"),
                     "state-dir": str(tmp_path / "state" / name), "device": "cpu",
                     **({"identity-key": str(tmp_path / "keys" / key)} if key else {})},
                    root_certificates=tls.ca_cert if tls_on else None,
                    auth_key=tmp_path / "keys" / key if key else None, netns=net.netns(name), name=name)
                started.append(node)
                return node

            nodes = {h: hospital(h, h) for h in HOSPITALS}
            intruder = hospital("intruder", "intruder")
            plain = hospital("plain", None, tls_on=False)

            run_dir = tmp_path / "results" / "consortium"
            run_id = submit_run(home, "consortium", {
                "strategy": "fedproin", "model": "small-cnn", "dataset": "npz", "test-dir": str(sites / "test"),
                "image-size": 16, "batch-size": 16, "num-server-rounds": MOST_ROUNDS, "min-available-hospitals": 3,
                "min-train-hospitals": 2, "round-timeout": 60.0, "run-name": "consortium",
                "results-dir": str(tmp_path / "results"), "hospital-keys": str(tmp_path / "keys")})
            # after round 1: kill hospital-02; once a round has missed it: restart it (same key and state
            # folder); once it has trained again: cut hospital-01's cable; once a round has missed hospital-01:
            # restore it. Each fault is undone only after a round has seen it: rounds take about a second, so the
            # round in flight when a fault strikes may already hold the hospital's reply.
            schedule = {
                "kill": lambda history: len(history) >= 1,
                "restart": lambda history: first_round(history, "missing", "hospital-02", events["kill"]),
                "cut": lambda history: first_round(history, "aggregated", "hospital-02", events["restart"]),
                "restore": lambda history: first_round(history, "missing", "hospital-01", events["cut"]),
            }
            events: dict[str, int] = {}
            deadline = time.time() + 1200
            status, last_check = "unknown", 0.0
            while time.time() < deadline:
                if time.time() - last_check > 10:  # `flwr ls` costs a second of CPU: ask now and then
                    status, last_check = run_status(home, "consortium", run_id), time.time()
                    if status.startswith("finished"):
                        break
                history = read_history(run_dir) if (run_dir / "metrics.jsonl").exists() else []
                if "restore" in events and first_round(history, "aggregated", "hospital-01", events["restore"]):
                    assert flwr(home, "stop", str(run_id), "consortium").returncode == 0
                    status = wait_for_run(home, "consortium", run_id, 120)
                    break
                event = next((e for e in schedule if e not in events), None)
                if event and schedule[event](history):
                    events[event] = len(history) + 1  # the first round it can hit
                    if event == "kill":  # at once: a graceful stop may still deliver this round's reply
                        nodes["hospital-02"].kill()
                    elif event == "restart":
                        nodes["hospital-02"] = hospital("hospital-02", "hospital-02")
                    elif event == "cut":
                        net.cut("hospital-01")
                    else:
                        net.restore("hospital-01")
                time.sleep(1)
            assert status == "finished:stopped", run_log(home, "consortium", run_id)[-4000:]
            intruder_exit = intruder.process.wait(timeout=60)
            plain_log = plain.log_tail(200)

    history = read_history(run_dir)
    last = len(history)
    assert [r["round"] for r in history] == list(range(1, last + 1)) and last < MOST_ROUNDS
    by_round = {r["round"]: r for r in history}
    killed = first_round(history, "missing", "hospital-02", events["kill"])
    assert killed and killed < events["restart"]
    rejoined = first_round(history, "aggregated", "hospital-02", events["restart"])
    assert rejoined, "the restarted hospital never trained again"
    # it continued from the prototypes it saved in round 1, read back from its own state folder
    assert by_round[rejoined]["hospital_metrics"]["hospital-02"]["state-from-round"] == 1
    cut = first_round(history, "missing", "hospital-01", events["cut"])
    assert cut and cut < events["restore"]
    assert first_round(history, "aggregated", "hospital-01", events["restore"])
    for record in history:  # every round either aggregated enough hospitals or said why not
        assert len(record["aggregated"]) >= 2 or "min-train-hospitals" in record.get("skipped", "")
    everyone = {name for r in history for name in r["chosen"]}
    assert everyone == set(HOSPITALS)  # the unregistered key and the plain-text node never joined
    assert intruder_exit != 0 and "Failed to activate SuperNode" in intruder.log_tail(200)
    assert "Connection attempt failed" in plain_log and "SuperNode ID" not in plain_log
    summary = (run_dir / "summary.md").read_text()
    assert "Hospitals missing or refused" in summary and "hospital-02" in summary


def first_round(history: list[dict], field: str, hospital: str, since: int) -> int | None:
    """The first round from `since` on whose `field` ("missing" or "aggregated") lists the hospital, if any."""
    return next((r["round"] for r in history if r["round"] >= since and hospital in r[field]), None)
