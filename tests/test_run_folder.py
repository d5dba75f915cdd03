"""A run's name, folder and checkpoints are safe: names stay inside results-dir, an earlier run is never
overwritten by accident, and a resume continues the same experiment from a checkpoint that is whole."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from common.config import ConfigError, JobConfig, load_job_config
from common.engine.round_engine import RoundEngine
from common.engine.run_lock import LOCK_FILE
from server_app.checkpoint import checkpoint_dir, save_checkpoint
from server_app.run_config import load_run_config

from .conftest import ROOT

TINY = {"synthetic-samples": 40, "image-size": 8, "model": "small-cnn", "run-name": "r"}


def finished_run(tmp_path, rounds=(1, 2), **extra) -> JobConfig:
    """A run folder with checkpoints after ``rounds`` and a metrics file, as the ServerApp leaves it."""
    cfg = load_job_config({**TINY, "results-dir": str(tmp_path), **extra})
    engine = RoundEngine(cfg)
    for rnd in rounds:
        engine.history.append({"round": rnd})
        save_checkpoint(cfg.run_dir, rnd, engine.state_dict())
    (cfg.run_dir / "metrics.jsonl").write_text("{}\n")
    return cfg


@pytest.mark.parametrize("name", ["../../../x", "a/b", "..", ".hidden", "x y", "/abs"])
def test_run_names_that_leave_the_results_folder_are_refused(name):
    with pytest.raises(ConfigError, match="run-name.*not a safe folder name"):
        load_job_config({"run-name": name})


@pytest.mark.parametrize("key,value", [("seed", -1), ("learning-rate", float("inf")),
                                       ("round-timeout", float("inf")), ("learning-rate", float("nan"))])
def test_impossible_numbers_are_refused_before_round_1(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_job_config({key: value})


def test_an_earlier_runs_folder_is_not_overwritten_unless_asked(tmp_path):
    cfg = finished_run(tmp_path)
    with pytest.raises(ConfigError, match="already holds the results of a run .*metrics.jsonl.*overwrite-run=true"):
        load_run_config({**TINY, "results-dir": str(tmp_path)})
    assert (cfg.run_dir / "metrics.jsonl").exists()
    load_run_config({**TINY, "results-dir": str(tmp_path), "overwrite-run": True})
    assert not (cfg.run_dir / "metrics.jsonl").exists() and not any(checkpoint_dir(cfg.run_dir).iterdir())


def test_a_resume_continues_in_its_own_folder_and_keeps_its_name(tmp_path):
    cfg = finished_run(tmp_path)
    resumed, checkpoint = load_run_config({**{k: v for k, v in TINY.items() if k != "run-name"},
                                           "results-dir": str(tmp_path), "resume-from": str(cfg.run_dir),
                                           "num-server-rounds": 9})
    assert resumed.run_dir == cfg.run_dir and len(checkpoint["run/history"]) > 0


@pytest.mark.parametrize("key,value", [("test-fraction", 0.3), ("model", "resnet18"), ("learning-rate", 0.5)])
def test_a_resume_that_changes_the_data_model_or_method_is_refused_naming_the_key(tmp_path, key, value):
    cfg = finished_run(tmp_path)
    with pytest.raises(ConfigError, match=f"resume-from: key '{key}' was .* now {value!r}"):
        load_run_config({**TINY, "results-dir": str(tmp_path), "resume-from": str(cfg.run_dir), key: value})


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before_it(tmp_path, caplog):
    cfg = finished_run(tmp_path)
    latest = checkpoint_dir(cfg.run_dir) / "round-00002.npz"
    latest.write_bytes(latest.read_bytes()[:200])  # a copy cut short
    with caplog.at_level("WARNING", logger="fedmed"):
        _, checkpoint = load_run_config({**TINY, "results-dir": str(tmp_path), "resume-from": str(cfg.run_dir)})
    assert "round-00002.npz: cannot read checkpoint" in caplog.text and "round-00001.npz" in caplog.text
    from common.methods.base import unpack_json

    assert [r["round"] for r in unpack_json(checkpoint["run/history"])] == [1]


def test_a_checkpoint_holding_nan_is_refused_naming_the_file_and_entry(tmp_path):
    cfg = load_job_config({**TINY, "results-dir": str(tmp_path)})
    engine = RoundEngine(cfg)
    state = engine.state_dict()
    name = next(k for k, v in state.items() if v.dtype.kind == "f")
    state[name] = np.full_like(state[name], np.nan)
    path = save_checkpoint(cfg.run_dir, 1, state)
    with pytest.raises(ConfigError, match=f"resume-from: {path}: {name} holds NaN or Inf"):
        load_run_config({**TINY, "run-name": "other", "results-dir": str(tmp_path), "resume-from": str(path)})


def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path):
    small = RoundEngine(load_job_config({**TINY, "results-dir": str(tmp_path)}))
    other = RoundEngine(load_job_config({**TINY, "model": "resnet18", "resnet-width": 0.25}))
    with pytest.raises(ValueError, match="the checkpoint's global model: missing"):
        other.load_state_dict(small.state_dict())
    assert other.history == []


def test_a_polyp_image_size_the_unet_cannot_take_is_refused_before_round_1():
    with pytest.raises(ConfigError, match="image-size=20: the polyp U-Net halves an image three times"):
        load_job_config({"task": "polyp-segmentation", "image-size": 20})


def test_a_deployed_node_config_without_a_hospital_name_is_refused_naming_the_key(tmp_path):
    from client_app.node_config import load_node_config

    with pytest.raises(ConfigError, match="node config of this node.*needs its name: hospital='...'"):
        load_node_config({"data-dir": str(tmp_path)})


def test_a_damaged_hospital_state_file_is_set_aside_and_the_one_before_it_used(tmp_path, caplog):
    from common.methods.site import HospitalStateStore

    store = HospitalStateStore(tmp_path)
    store.save(1, {"w": np.ones(3)})
    store.save(2, {"w": np.full(3, 2.0)})
    (tmp_path / "state-r00002.npz").write_bytes(b"PK\x03\x04 not a whole archive")
    with caplog.at_level("WARNING", logger="fedmed"):
        state = store.load(before_round=3)
    np.testing.assert_array_equal(state["w"], np.ones(3))
    assert store.loaded_round == 1 and (tmp_path / "state-r00002.npz.damaged").exists()
    assert f"hospital state {tmp_path / 'state-r00002.npz'} cannot be read" in caplog.text
    assert store.rounds() == [1]


# --- result files: strict JSON, and a folder that fills up after round 1 -----------------------------------------
def round_with(rnd: int, **test) -> dict:
    return {"round": rnd, "chosen": ["hospital-00", "hospital-01"], "aggregated": ["hospital-00", "hospital-01"],
            "missing": [], "refused": {}, "bytes_up": 1000, "bytes_down": 2000, "seconds": 0.5, "test": test,
            "hospital_metrics": {"hospital-00": {"val-loss": float("-inf"), "num-examples": 10}}}


def strict_loads(line: str):
    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_nan_and_inf_metrics_are_written_as_null_and_read_back(tmp_path):
    from server_app.results import plot_history, read_history, render_summary, write_results

    history = [round_with(1, accuracy=float("nan"), loss=float("inf"), f1=0.25), round_with(2, accuracy=0.75,
                                                                                             loss=0.5, f1=0.5)]
    config = {"run-name": "r", "num-server-rounds": 2}
    write_results(tmp_path, config, history)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [strict_loads(line) for line in lines]  # any JSON reader takes it
    assert records[0]["test"] == {"accuracy": None, "loss": None, "f1": 0.25}
    assert records[0]["hospital_metrics"]["hospital-00"] == {"val-loss": None, "num-examples": 10}
    assert math.isnan(history[0]["test"]["accuracy"])  # the run's own history is left as it was

    read = read_history(tmp_path)
    assert read == records
    summary = render_summary(config, read)  # the CLI's summary, from the file
    assert "| 1 | 2/2 | n/a | 0.2500 | n/a |" in summary and "| 2 | 2/2 | 0.7500 | 0.5000 | 0.5000 |" in summary
    assert {p.name for p in plot_history(read, tmp_path / "replotted")} == {"test_metrics.png", "traffic.png"}

    (tmp_path / "old").mkdir()  # a file written before: NaN as Python's json wrote it still reads
    (tmp_path / "old" / "metrics.jsonl").write_text(json.dumps(history[0]) + "\n")
    assert math.isnan(read_history(tmp_path / "old")[0]["test"]["accuracy"])


def test_a_cross_site_score_that_is_nan_is_written_as_null(tmp_path):
    from server_app.app import finish

    cfg = load_job_config({**TINY, "results-dir": str(tmp_path)})
    record = {"after-round": 1, "failed": {}, "missing": [],
              "scores": {"hospital-00": {"global": {"accuracy": float("nan"), "loss": 0.5}}}}
    finish(cfg, [round_with(1, accuracy=float("nan"))], record)
    saved = strict_loads((cfg.run_dir / "cross_site.json").read_text())
    assert saved["scores"]["hospital-00"]["global"] == {"accuracy": None, "loss": 0.5}
    assert "| hospital-00 | n/a |" in (cfg.run_dir / "cross_site.md").read_text()
    assert strict_loads((cfg.run_dir / "metrics.jsonl").read_text())["test"] == {"accuracy": None}


def test_a_results_folder_that_fills_up_after_round_1_ends_the_run_with_its_rounds_kept(tmp_path, monkeypatch,
                                                                                        caplog):
    """The ServerApp's main on a fake grid: after round 1 every write fails (disk full); the run still ends
    normally, round 1's checkpoint and result files stay, the log names the folder, the cross-site table is logged."""
    from flwr.app import Context, RecordDict

    from server_app import app as server
    from server_app import evaluation, results
    from server_app.checkpoint import list_checkpoints
    from server_app.results import read_history

    from .fake_grid import FakeGrid, simulated_hospitals

    config = {**TINY, "run-name": "full", "results-dir": str(tmp_path / "results"), "state-dir": str(tmp_path / "s"),
              "num-server-rounds": 2, "batch-size": 16, "min-partition-size": 5, "cross-site-evaluation": True}
    full: list[bool] = []

    def no_space(path):
        return OSError(errno.ENOSPC, "No space left on device", str(path))

    def failing(real):
        def write(path, *args, **kwargs):
            if full:
                raise no_space(path)
            return real(path, *args, **kwargs)
        return write

    def failing_figure(real):
        def save(fig, path):
            if full:
                raise no_space(path)
            return real(fig, path)
        return save

    for module in (results, evaluation):
        monkeypatch.setattr(module, "_write", failing(results._write))
        monkeypatch.setattr(module, "_save", failing_figure(results._save))
    monkeypatch.setattr(np, "savez", failing(np.savez))
    real_saver = server.RoundSaver.__call__

    def saver(self, engine, record):
        real_saver(self, engine, record)
        if record["round"] == 1:
            full.append(True)  # the disk fills up once round 1 is saved

    monkeypatch.setattr(server.RoundSaver, "__call__", saver)
    monkeypatch.setattr(server, "setup_logging", lambda: None)  # keep the log where caplog sees it
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    with caplog.at_level("INFO", logger="fedmed"):
        server.main(FakeGrid(simulated_hospitals(config, 2)), context)  # no exception: the run ends normally

    run_dir = tmp_path / "results" / "full"
    assert [p.name for p in list_checkpoints(run_dir)] == ["round-00001.npz"]
    assert [r["round"] for r in read_history(run_dir)] == [1]
    assert not [p.name for p in run_dir.rglob(".*") if p.name != LOCK_FILE]  # no partial files left beside them
    text = caplog.text
    assert f"round 2: checkpoint not written to {run_dir}" in text
    assert f"the final result files (metrics.jsonl, summary.md, plots) could not be written to {run_dir}" in text
    assert "No space left on device" in text and "kept there (round-00001.npz)" in text
    assert "finished full" in text and "2 of 2 rounds" in text  # the summary still goes to the log
    assert f"the cross-site evaluation could not be written to {run_dir}" in text and "| hospital-00 |" in text
    assert not (run_dir / "cross_site.json").exists()


# --- the best round's model (select-by) ----------------------------------------------------------------------------
def rounds_scored(cfg, scores: list[float], engine=None, saver=None, mark: bool = True):
    """Rounds through the ServerApp's RoundSaver, each with ``test.dice`` = its score and (``mark``) its own global
    model, every weight = the round number; returns the engine and the saver."""
    from server_app.app import RoundSaver

    engine = engine or RoundEngine(cfg)
    saver = saver or RoundSaver(plot_interval=1e9)
    for score in scores:
        rnd = engine.next_round
        if mark:
            engine.method.global_arrays = {k: np.full_like(v, rnd) for k, v in engine.method.global_arrays.items()}
        engine.history.append({**round_with(rnd, dice=score, loss=1.0 - score), "round": rnd,
                               "train": {"val-dice": score}})
        saver(engine, engine.history[-1])
    return engine, saver


def best_model_round(path) -> int:
    from server_app.checkpoint import read_checkpoint

    state = read_checkpoint(path)
    values = {float(v.flat[0]) for k, v in state.items() if k.startswith("method/global/") and v.dtype.kind == "f"}
    assert len(values) == 1
    return int(values.pop())


def test_the_best_checkpoint_holds_the_round_with_the_best_value(tmp_path):
    """test.dice goes up and down: best.npz holds the best round's model, its round and value, beside the latest
    checkpoints; min: (or a loss) keeps the lowest; it survives a resume, is replaced when the resume replays its
    round from an earlier checkpoint, and goes with a run resumed into another folder."""
    from server_app.app import RoundSaver
    from server_app.checkpoint import best_path, list_checkpoints, load_checkpoint, read_best

    cfg = load_job_config({**TINY, "results-dir": str(tmp_path), "num-server-rounds": 9, "select-by": "test.dice"})
    engine, _ = rounds_scored(cfg, [0.2, 0.5, 0.3, 0.6, 0.4, 0.55])
    best = read_best(cfg.run_dir)
    assert (best["round"], best["value"], best["metric"]) == (4, 0.6, "max:test.dice")
    assert best_model_round(best_path(cfg.run_dir)) == 4
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["round-00004.npz", "round-00005.npz", "round-00006.npz"]
    assert "round 4: 0.6000 (its model: checkpoints/best.npz)" in (cfg.run_dir / "summary.md").read_text()
    assert not [p.name for p in cfg.run_dir.rglob(".*")]  # written whole: no partial file left

    lowest = load_job_config({**TINY, "results-dir": str(tmp_path), "run-name": "low", "select-by": "test.loss"})
    rounds_scored(lowest, [0.2, 0.5, 0.3])
    assert read_best(lowest.run_dir)["round"] == 2 and read_best(lowest.run_dir)["metric"] == "min:test.loss"

    validated = load_job_config({**TINY, "results-dir": str(tmp_path), "run-name": "val",
                                 "select-by": "train.val-dice"})
    rounds_scored(validated, [0.9, 0.2, 0.5, 0.8, 0.4])  # hospitals' val-* score the model they received
    best = read_best(validated.run_dir)
    assert (best["round"], best["value"]) == (3, 0.8) and best_model_round(best_path(validated.run_dir)) == 3

    resumed = RoundEngine(cfg)  # a resume from the latest checkpoint: the best stays unless beaten
    resumed.load_state_dict(load_checkpoint(cfg.run_dir))
    rounds_scored(cfg, [0.58, 0.7], resumed)
    assert (read_best(cfg.run_dir)["round"], best_model_round(best_path(cfg.run_dir))) == (8, 8)

    replayed = RoundEngine(cfg)  # resumed from round 6's checkpoint: round 8's best is of rounds replayed now
    replayed.load_state_dict(load_checkpoint(checkpoint_dir(cfg.run_dir) / "round-00006.npz"))
    rounds_scored(cfg, [0.1], replayed)
    assert read_best(cfg.run_dir)["round"] == 7

    after_7 = checkpoint_dir(cfg.run_dir) / "round-00007.npz"
    moved = cfg.model_copy(update={"run_name": "moved", "resume_from": str(after_7)})
    carried = RoundEngine(moved)
    carried.load_state_dict(load_checkpoint(after_7))
    saver = RoundSaver(plot_interval=1e9)
    saver.start(carried)
    assert read_best(moved.run_dir)["round"] == 7  # the run it continues: round 7 is its best of rounds 1-7
    rounds_scored(moved, [0.05], carried, saver)
    assert read_best(moved.run_dir)["round"] == 7 and best_model_round(best_path(moved.run_dir)) == 7


def test_export_int8_and_segment_take_the_best_round(tmp_path, capsys):
    from PIL import Image

    from cli.main import main as fedmed
    from common.quantization.int8 import load_deployment

    cfg = load_job_config({"task": "polyp-segmentation", "strategy": "qfedpolyp", "synthetic-samples": 40,
                           "image-size": 32, "min-partition-size": 5, "results-dir": str(tmp_path), "run-name": "q",
                           "num-server-rounds": 5, "select-by": "test.dice"})
    engine, saver = rounds_scored(cfg, [0.3, 0.5, 0.4], mark=False)
    assert fedmed(["export-int8", "--run", str(cfg.run_dir), "--best", "--calibration-images", "8",
                   "--engine", "onnxruntime"]) == 0  # one engine: nothing built to be timed against it
    model, = (cfg.run_dir / "exports").glob("int8-best.*")
    _, metadata = load_deployment(model)
    assert metadata["rounds"] == 2 and metadata["checkpoint"].endswith("checkpoints/best.npz")
    frames = tmp_path / "frames"
    frames.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(frames / "a.png")
    assert fedmed(["segment", "--run", str(cfg.run_dir), "--best", "--images", str(frames),
                   "--out", str(tmp_path / "masks")]) == 0
    assert (tmp_path / "masks" / "a.png").exists()
    capsys.readouterr()

    rounds_scored(cfg, [0.9], engine, saver, mark=False)  # a better round since the export
    assert fedmed(["segment", "--run", str(cfg.run_dir), "--best", "--images", str(frames),
                   "--out", str(tmp_path / "masks")]) == 2
    assert "is the model after round 2, but the run's best round by max:test.dice is now 4" in capsys.readouterr().err
    other = load_job_config({**TINY, "results-dir": str(tmp_path), "run-name": "plain"})
    rounds_scored(other, [0.5])
    assert fedmed(["export-int8", "--run", str(other.run_dir), "--best"]) == 2
    error = capsys.readouterr().err
    assert "has no best model" in error and "select-by='test.dice'" in error


# --- two runs of one name at once ------------------------------------------------------------------------------------
HOLDER = ("import sys, time; from pathlib import Path; from common.engine.run_lock import claim; "
          "claim(Path(sys.argv[1])); "
          "print('held', flush=True); time.sleep(120)")


@contextlib.contextmanager
def run_in_progress(run_dir):
    """Another ServerApp process holding ``run_dir``, as a run in progress does."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_second_run_of_a_name_in_progress_is_refused_before_round_1(tmp_path):
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, simulated_hospitals
    from .test_strategies import SMALL_CLASSIFICATION, run_config

    config = run_config(tmp_path, SMALL_CLASSIFICATION)  # run-name 't'
    with run_in_progress(tmp_path / "results" / "t") as pid:
        with pytest.raises(ConfigError, match=rf"run-name 't': .*results/t is in use by a run in progress \(process "
                                              rf"{pid} on .*choose another run-name, or wait for that run to end"):
            load_run_config(config)  # fedmed's ServerApp
        grid = FakeGrid(simulated_hospitals(config, 2))
        with pytest.raises(ConfigError, match=f"in use by a run in progress \\(process {pid} "):
            FedAvgStrategy(run_config=config).start(grid, num_rounds=1)  # a user's own ServerApp
        assert grid.sent == []  # refused before anything was sent
    result = FedAvgStrategy(run_config=config).start(FakeGrid(simulated_hospitals(config, 2)), num_rounds=1)
    assert len(result.train_metrics_clientapp) == 1  # the folder is free again once that run has ended


def test_a_run_whose_name_was_chosen_for_it_takes_the_next_free_folder(tmp_path, monkeypatch):
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, simulated_hospitals
    from .test_strategies import SMALL_CLASSIFICATION, run_config

    config = {k: v for k, v in run_config(tmp_path, SMALL_CLASSIFICATION).items() if k != "run-name"}
    strategy = FedAvgStrategy(run_config=config)  # named by the time it was made, to the second
    taken = strategy.job.run_name
    with run_in_progress(tmp_path / "results" / taken):
        strategy.start(FakeGrid(simulated_hospitals(config, 2)), num_rounds=1)
        assert strategy.job.run_name == f"{taken}-2" and strategy.engine.cfg.run_name == f"{taken}-2"
        assert (tmp_path / "results" / f"{taken}-2" / "audit.jsonl").exists()
        assert not (tmp_path / "results" / taken / "audit.jsonl").exists()

        import server_app.run_config as server_run_config  # fedmed's ServerApp names a run the same way

        monkeypatch.setattr(server_run_config.time, "strftime", lambda *_: "20260101-000000")
        held = tmp_path / "results" / "classification-fedavg-20260101-000000"
        with run_in_progress(held):
            cfg, _ = load_run_config(config)
        assert cfg.run_name == "classification-fedavg-20260101-000000-2"
