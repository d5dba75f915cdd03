"""A real deployment on loopback: one SuperLink and hospital SuperNodes, each with its own data folder written
by ``fedmed partition``. A run completes on the hospitals' own data; the ServerApp stopped mid-run and resumed
from its checkpoint ends with the same model as an uninterrupted run; a hospital whose data file is corrupt is
reported by name while the others train; checkpoints already written stay readable when a save is interrupted."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from cli.launch import FlowerHome, flwr, free_port, run_log, run_status, start_superlink, start_supernode, submit_run
from cli.main import main as fedmed
from cli.site import app_hash
from server_app.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from server_app.results import read_history

from .conftest import ROOT
from .flower_processes import run_to_completion, stopped_at_exit

ROUNDS = 4


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("executor", [True, False], ids=["fedmed-supernode", "flower-superexec-warm-worker"])
def test_deployment_completes_resumes_exactly_and_names_a_corrupt_hospital(tmp_path, executor):
    """As deploy/ starts hospitals (fedmed-supernode: one long-lived ClientApp process each), and on stock
    SuperNodes (a ClientApp process per message, the work in the hospital's warm worker)."""
    sites = tmp_path / "sites"
    assert fedmed(["partition", "--hospitals", "2", "--out", str(sites),
                   "--run-config",
                   "synthetic-samples=160 image-size=16 min-partition-size=5 partitioner='dirichlet'"]) == 0
    manifest = json.loads((sites / "manifest.json").read_text())
    assert set(manifest["sites"]) == {"test", "hospital-00", "hospital-01"}
    broken = tmp_path / "broken-site"
    broken.mkdir()
    (broken / "data.npz").write_bytes(b"PK\x03\x04 this is not a whole npz file")

    home = FlowerHome(tmp_path / "flwr-home")
    port = free_port()
    superlink = start_superlink(home, port, simulation=False, connection="site")
    sites_of = [("hospital-00", sites / "hospital-00"), ("hospital-01", sites / "hospital-01"),
                ("hospital-broken", broken)]
    approved = {name: {} for name, _ in sites_of}
    if executor:  # fedmed-supernode runs only the apps a hospital approved: this app's hash, or another's
        this_app, _ = app_hash(ROOT)
        approved = {name: {"approved-apps": this_app} for name, _ in sites_of}
        sites_of.append(("hospital-unapproved", sites / "hospital-01"))
        approved["hospital-unapproved"] = {"approved-apps": "0" * 64}
    nodes = [start_supernode(home, f"127.0.0.1:{port}", free_port(),
                             {"hospital": name, "data-dir": str(folder), "state-dir": str(tmp_path / "state" / name),
                              "device": "cpu", **approved[name]}, executor=executor)
             for name, folder in sites_of]
    job = {"strategy": "fedproin", "model": "small-cnn", "dataset": "npz", "test-dir": str(sites / "test"),
           "image-size": 16, "batch-size": 16, "num-server-rounds": ROUNDS, "round-timeout": 300.0,
           "results-dir": str(tmp_path / "results")}
    with stopped_at_exit(superlink, *nodes):
        straight_id = run_to_completion(home, {**job, "run-name": "straight"}, connection="site", timeout=900)

        stopped_id = submit_run(home, "site", {**job, "run-name": "stopped"})
        stopped_dir = tmp_path / "results" / "stopped"
        deadline = time.time() + 900
        while not any(p.name == "round-00002.npz" for p in list_checkpoints(stopped_dir)):
            assert time.time() < deadline
            time.sleep(0.5)
        assert flwr(home, "stop", str(stopped_id), "site").returncode == 0  # the ServerApp is stopped mid-run
        while not run_status(home, "site", stopped_id).startswith("finished"):
            time.sleep(3)
        assert run_status(home, "site", stopped_id) == "finished:stopped"
        assert len(read_history(stopped_dir)) < ROUNDS

        run_to_completion(home, {**job, "run-name": "stopped", "resume-from": str(stopped_dir)}, connection="site",
                          timeout=900)
        server_log = run_log(home, "site", straight_id)

    history = read_history(tmp_path / "results" / "straight")
    assert [r["round"] for r in history] == list(range(1, ROUNDS + 1))
    assert all(sorted(r["aggregated"]) == ["hospital-00", "hospital-01"] for r in history)
    for name in ("hospital-00", "hospital-01"):  # each trained on its own folder, minus its validation share
        assert 0.8 * manifest["sites"][name]["samples"] <= history[-1]["hospital_metrics"][name]["num-examples"] \
            < manifest["sites"][name]["samples"]
    assert history[-1]["test"]["num-examples"] == manifest["sites"]["test"]["samples"]

    # every round of the stopped-and-resumed run is whole (a round the stop cut short was not saved, and was
    # repeated on resume), so its model must equal the straight run's bit for bit
    resumed_history = read_history(stopped_dir)
    assert [r["round"] for r in resumed_history] == list(range(1, ROUNDS + 1))
    assert [(r["round"], sorted(r["aggregated"]), r["missing"], r["refused"]) for r in resumed_history] == \
        [(rnd, ["hospital-00", "hospital-01"], [], {}) for rnd in range(1, ROUNDS + 1)]
    straight, resumed = load_checkpoint(tmp_path / "results" / "straight"), load_checkpoint(stopped_dir)
    model_keys = [k for k in straight if k.startswith("method/global/")]
    assert model_keys
    for key in model_keys:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)
    # the broken hospital never joined; the server's log names its file
    assert all(set(r["chosen"]) == {"hospital-00", "hospital-01"} for r in resumed_history)
    assert "hospital-broken" in server_log and "data.npz: cannot read npz" in server_log
    if executor:  # the hospital that approved another app never ran this one
        assert f"app bundle {this_app} is not among the apps this hospital approved" in server_log


def test_interrupted_checkpoint_write_leaves_the_last_checkpoint_readable(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"method/global/w": np.arange(3.0)})

    def crash(path, **arrays):
        with open(path, "wb") as handle:
            handle.write(b"PK\x03\x04 half written")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, {"method/global/w": np.arange(3.0) * 2})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00001.npz"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["round-00001.npz"]  # no debris
    np.testing.assert_array_equal(load_checkpoint(tmp_path)["method/global/w"], np.arange(3.0))


def test_a_results_folder_that_cannot_be_written_stops_the_run_before_round_1(tmp_path):
    from common.config import ConfigError
    from server_app.run_config import load_run_config

    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "run").write_text("a file where the run folder should be")
    with pytest.raises(ConfigError, match=r"results-dir: cannot write .*locked/run"):
        load_run_config({"results-dir": str(locked), "run-name": "run"})
    cfg, _ = load_run_config({"results-dir": str(tmp_path / "fine"), "run-name": "run"})
    assert (tmp_path / "fine" / "run" / "checkpoints").is_dir()


def test_a_failed_checkpoint_write_is_logged_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    from common.config import JobConfig
    from common.engine.round_engine import RoundEngine
    from server_app import app as server
    from server_app.results import read_history

    cfg = JobConfig(run_name="r", results_dir=str(tmp_path), synthetic_samples=40, image_size=8,
                    model="small-cnn")
    engine = RoundEngine(cfg)
    engine.history.append({"round": 1, "chosen": [], "aggregated": [], "missing": [], "refused": {},
                           "traffic": {}, "bytes_up": 0, "bytes_down": 0, "seconds": 0.1})
    saver = server.RoundSaver(plot_interval=1e9)
    saver(engine, engine.history[-1])
    engine.history.append({**engine.history[-1], "round": 2})

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(server, "save_checkpoint", full)
    with caplog.at_level("ERROR", logger="fedmed"):
        saver(engine, engine.history[-1])  # no exception: the run goes on
    assert "round 2: checkpoint not written" in caplog.text and "No space left" in caplog.text
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["round-00001.npz"]
    assert [r["round"] for r in read_history(cfg.run_dir)] == [1, 2]
