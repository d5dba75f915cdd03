"""The deployment's edges (issue 65): each refused in one line before anything slow starts, or fixed: a node config
fedmed-supernode cannot read, an --approve that is not a hash, the app bundle a hospital reviews, a run Flower ends
from outside, an edited audit log's refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import MessageType

from cli.launch import SUPERNODE_WITH_EXECUTOR

from .conftest import ROOT
from .test_secure_by_default import SMALL, answer


@pytest.mark.parametrize("node_config", ["hospital='x", "a=[1", "hospital=", "a b"])
def test_fedmed_supernode_refuses_a_node_config_it_cannot_read_in_one_line(tmp_path, node_config):
    done = subprocess.run([sys.executable, str(SUPERNODE_WITH_EXECUTOR), "--insecure", "--superlink", "127.0.0.1:9",
                           "--node-config", node_config], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "--node-config" in done.stderr


def start_supernode(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, bool]:
    """deploy/start_supernode.sh with ``args``; whether it ran Python at all (the app's hash, the SuperNode)."""
    marker = tmp_path / "python-ran"
    python = tmp_path / "python"
    python.write_text(f"#!/usr/bin/env bash\ntouch {marker}\nexit 1\n")
    python.chmod(0o755)
    done = subprocess.run(["bash", str(ROOT / "deploy" / "start_supernode.sh"), *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "FEDMED_PYTHON": str(python)})
    return done, marker.exists()


@pytest.mark.parametrize("approve", ["not-a-hash", "0" * 63, "0" * 64 + ",abc", "g" * 64, ","])
def test_start_supernode_checks_approve_before_it_hashes_anything(tmp_path, approve):
    done, python_ran = start_supernode(tmp_path, "--insecure", "--approve", approve, "h", "127.0.0.1:9", "-", "-",
                                       "-", str(tmp_path), str(tmp_path / "state"))
    assert done.returncode == 2 and "--approve" in done.stderr and not python_ran, done.stderr
    assert not (tmp_path / "state").exists()


def test_start_supernode_checks_the_keys_before_it_hashes_the_app(tmp_path):
    done, python_ran = start_supernode(tmp_path, "h", "127.0.0.1:9", str(tmp_path / "ca.crt"), str(tmp_path / "none"),
                                       str(tmp_path / "none"), str(tmp_path), str(tmp_path / "state"))
    assert done.returncode == 2 and "KEY" in done.stderr and not python_ran, done.stderr


def test_the_app_bundle_holds_the_app_and_nothing_else():
    """What `fedmed app-hash .` lists for an officer to review: the ServerApp's and ClientApp's packages (and
    pyproject.toml), never benchmark results, tests, docs, deployment scripts or the command line."""
    from cli.site import app_hash

    _, files = app_hash(ROOT)
    tops = {path.split("/")[0] for path, _, _ in files}
    assert tops == {"common", "strategies", "server_app", "client_app", "pyproject.toml", ".info"}, tops
    assert len(files) < 250


def open_run(tmp_path: Path):
    """A run the ServerApp has started (status running) with Flower's exit handler registered: its config and saver."""
    from common.config import load_job_config
    from common.engine.round_engine import RoundEngine
    from server_app.app import RoundSaver, closed_on_exit

    cfg = load_job_config({**SMALL, "results-dir": str(tmp_path / "results"), "state-dir": str(tmp_path / "state"),
                           "num-server-rounds": 3})
    cfg.run_dir.mkdir(parents=True)
    engine, saver = RoundEngine(cfg), RoundSaver()
    saver.start(engine)
    closed_on_exit(saver, cfg, engine)
    return cfg, saver


def test_a_run_flower_ends_from_outside_is_not_left_running(tmp_path):
    """Flower ends a ServerApp whose SuperLink restarted (its heartbeat is refused) through its exit handlers, then
    forces the exit: status.json says stopped (interrupted) before that."""
    from flwr.supercore.exit.exit_handler import trigger_exit_handlers

    from server_app.results import read_status

    cfg, _ = open_run(tmp_path)
    assert read_status(cfg.run_dir)["status"] == "running"
    trigger_exit_handlers(run_before_force_exit=True)  # what flwr_exit does first
    status = read_status(cfg.run_dir)
    assert status["status"] == "stopped" and status["error"].startswith("interrupted")


def test_a_run_that_ended_is_left_as_it_ended(tmp_path):
    from flwr.supercore.exit.exit_handler import trigger_exit_handlers

    from server_app.results import read_status

    cfg, saver = open_run(tmp_path)
    saver.close(cfg, [], "failed", error="no hospital")
    trigger_exit_handlers(run_before_force_exit=True)
    assert read_status(cfg.run_dir)["status"] == "failed"


@pytest.mark.parametrize("edit", ["a line changed", "the last line cut short"])
def test_the_refusal_for_an_edited_audit_log_names_its_file_not_its_folder(tmp_path, edit):
    node = {"hospital": "h-a", "partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "state")}
    first = answer(node, {}, MessageType.QUERY, run_config=SMALL)
    assert not first.has_error(), first.error.reason if first.has_error() else ""
    log = tmp_path / "state" / "audit.jsonl"
    lines = log.read_text().splitlines()
    if edit == "a line changed":
        record = json.loads(lines[-1])
        record["direction"] = "nowhere"
        lines[-1] = json.dumps(record)
        log.write_text("\n".join(lines) + "\n")
    else:
        log.write_text("\n".join(lines)[:-5])
    reply = answer(node, {}, MessageType.QUERY, run_config=SMALL)
    assert reply.has_error() and "audit.jsonl" in reply.error.reason
    assert str(tmp_path) not in reply.error.reason


def test_make_hospital_policy_pins_keys_named_from_where_the_officer_stands(tmp_path):
    """docs/deployment.md's step: `deploy/make_hospital_policy.sh POLICY deploy/keys/*.pub` from the consortium's
    folder; the key paths are relative to it, not to the project the script lies in."""
    from common.trust.identity import key_fingerprint
    from common.trust.policy import read_policy

    env = {**os.environ, "FEDMED_PYTHON": sys.executable}
    subprocess.run(["bash", str(ROOT / "deploy" / "make_hospital_keys.sh"), "deploy/keys", "hospital-a", "hospital-b"],
                   cwd=tmp_path, env=env, check=True, capture_output=True)
    done = subprocess.run(["bash", str(ROOT / "deploy" / "make_hospital_policy.sh"), "deploy/policies/a.toml",
                           "deploy/keys/hospital-a.pub", "deploy/keys/hospital-b.pub"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    policy, _ = read_policy(tmp_path / "deploy" / "policies" / "a.toml")
    assert policy.require_secure_aggregation
    assert policy.peers == {name: key_fingerprint(tmp_path / "deploy" / "keys" / f"{name}.pub")
                            for name in ("hospital-a", "hospital-b")}
