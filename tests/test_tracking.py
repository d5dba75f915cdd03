"""Experiment tracking (TensorBoard event files, an MLflow store) read back and checked against metrics.jsonl; the
plots people look at and the data behind them; `fedmed runs`; `fedmed evaluate --best`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time

import numpy as np
import pytest

from common.config import ConfigError, load_job_config
from common.engine.round_engine import RoundEngine
from server_app import tracking
from server_app.app import RoundSaver, finish
from server_app.checkpoint import checkpoint_dir, load_checkpoint, read_best
from server_app.results import (
    bit_width_traffic,
    hospital_validation_curves,
    influence_shares,
    parse_selection,
    plot_history,
    read_history,
    record_value,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"model": "small-cnn", "image-size": 16, "synthetic-samples": 120, "batch-size": 16, "min-partition-size": 5}


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """tag -> step -> value, as TensorBoard reads the event files (after any purge of a resumed run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}, events


def mlflow_run(run_dir):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=state["uri"])
    return client, client.get_run(state["run-id"])


def text_of(events, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")}


# --- a short FedProIn run, tracked both ways ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """3 hospitals, 3 rounds of FedProIn in one process, the ServerApp's RoundSaver after every round and its end
    of run; hospital-02 fails in round 2 (a refusal with its reason)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    import torch

    from common.engine.inprocess import run_rounds, simulated_sites
    from common.methods.base import HospitalMethod

    folder = tmp_path_factory.mktemp("tracked")
    cfg = load_job_config({**TINY, "strategy": "fedproin", "num-server-rounds": 3, "run-name": "tracked",
                           "results-dir": str(folder / "results"), "state-dir": str(folder / "state"),
                           "tracking": "tensorboard,mlflow", "select-by": "train.val-accuracy"})
    real = HospitalMethod.timed_train

    def failing(self, rnd, payload):
        if self.site.name == "hospital-02" and rnd == 2:
            raise RuntimeError("hospital-02: its data disk went away")
        return real(self, rnd, payload)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    saver = RoundSaver(plot_interval=0.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HospitalMethod, "timed_train", failing)
        engine = run_rounds(cfg, simulated_sites(cfg, 3, state_root=folder / "state"), on_round_end=saver)
    finish(cfg, engine.history, None, saver)
    torch.set_num_threads(threads)
    return cfg, engine


def test_tensorboard_holds_every_round_as_metrics_jsonl_does(tracked_run):
    cfg, engine = tracked_run
    history = read_history(cfg.run_dir)
    scalars, events = tensorboard_scalars(cfg.run_dir / "tensorboard")
    classes = engine.method.task.spec["class-names"].split(",")
    assert [r["round"] for r in history] == [1, 2, 3] and history[1]["refused"]
    for record in history:
        rnd = record["round"]
        for metric, value in record["test"].items():
            assert scalars[f"test/{metric}"][rnd] == pytest.approx(value, rel=1e-6)
        for hospital, metrics in record["hospital_metrics"].items():
            for key in ("train-loss", "val-accuracy", "val-loss", "num-examples"):
                assert scalars[f"hospital/{hospital}/{key}"][rnd] == pytest.approx(metrics[key], rel=1e-6)
        for hospital, traffic in record["traffic"].items():
            assert scalars[f"traffic/{hospital}/up-mb"][rnd] == pytest.approx(traffic["up"] / 1e6, rel=1e-6)
            assert scalars[f"traffic/{hospital}/down-mb"][rnd] == pytest.approx(traffic["down"] / 1e6, rel=1e-6)
        assert scalars["screening/refused"][rnd] == len(record["refused"])
        assert scalars["screening/aggregated"][rnd] == len(record["aggregated"])
        influence = record["method"]["influence"]
        totals = np.sum([np.sum(m, axis=1) for m in influence.values()], axis=0)
        for hospital, matrix in influence.items():
            for c, label in enumerate(classes):
                assert scalars[f"method/influence/{hospital}/{label}"][rnd] == np.sum(matrix[c])
                if totals[c]:
                    assert scalars[f"method/influence-share/{hospital}/{label}"][rnd] == pytest.approx(
                        np.sum(matrix[c]) / totals[c], rel=1e-6)
    assert "hospital/hospital-02/val-accuracy" in scalars and 2 not in scalars["hospital/hospital-02/val-accuracy"]
    refused = text_of(events, "screening/refused")
    assert list(refused) == [2] and "hospital-02" in refused[2] and "its data disk went away" in refused[2]
    best = max(((r["round"] - 1, r["train"]["val-accuracy"]) for r in history if r["round"] > 1),  # the model
               key=lambda b: (b[1], -b[0]))  # they received: round 2's val-* score the model after round 1
    assert scalars["best/value"][3] == pytest.approx(best[1], rel=1e-6) and scalars["best/round"][3] == best[0]
    assert "| strategy | fedproin |" in text_of(events, "config")[1]
    assert "# tracked" in text_of(events, "summary")[3]
    assert set(events.Tags()["images"]) == {"plots/test_metrics", "plots/traffic", "plots/hospitals",
                                            "plots/influence"}
    assert set(events.PluginTagToContent("hparams")) == {"_hparams_/experiment", "_hparams_/session_start_info",
                                                         "_hparams_/session_end_info"}
    assert "custom_scalars__config__" in events.PluginTagToContent("custom_scalars")


def test_mlflow_holds_every_round_the_config_and_the_result_files(tracked_run):
    cfg, _ = tracked_run
    history = read_history(cfg.run_dir)
    client, run = mlflow_run(cfg.run_dir)
    assert (cfg.run_dir / "mlruns").is_dir() and run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params == {key: str(value) for key, value in cfg.to_flat().items()}

    def series(name):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}

    for metric in ("accuracy", "f1_weighted", "mcc"):
        assert series(f"test/{metric}") == {r["round"]: pytest.approx(r["test"][metric]) for r in history}
    for hospital in ("hospital-00", "hospital-01", "hospital-02"):
        assert series(f"hospital/{hospital}/val-loss") == {
            r["round"]: pytest.approx(r["hospital_metrics"][hospital]["val-loss"]) for r in history
            if hospital in r["hospital_metrics"]}
        assert series(f"traffic/{hospital}/up-mb") == {r["round"]: pytest.approx(r["traffic"][hospital]["up"] / 1e6)
                                                       for r in history}
    assert series("screening/refused") == {1: 0, 2: 1, 3: 0}
    assert run.data.tags["refused.hospital-02"].startswith("round 2: hospital reported an error: RuntimeError")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.md", "metrics.jsonl", "config.json", "plots", "refusals"} <= artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} == {
        "plots/test_metrics.png", "plots/traffic.png", "plots/hospitals.png", "plots/influence.png"}
    refusal = client.download_artifacts(run.info.run_id, "refusals/round-00002.md", str(cfg.run_dir / "dl"))
    assert "its data disk went away" in open(refusal).read()


def test_evaluate_best_scores_the_round_select_by_chose(tracked_run, tmp_path, capsys):
    from cli.main import main as fedmed
    from common.data.export import write_site
    from common.data.sources import generate
    from server_app.results import best_round

    cfg, _ = tracked_run
    best = read_best(cfg.run_dir)
    assert (best["round"], best["value"]) == pytest.approx(best_round(read_history(cfg.run_dir), cfg.select_by))
    assert best["metric"] == "max:train.val-accuracy"
    external = tmp_path / "external"
    write_site(cfg, generate("classification", 40, cfg.image_size, seed=999), external, "test")
    out = tmp_path / "scores"
    assert fedmed(["evaluate", "--run", str(cfg.run_dir), "--data", str(external), "--best", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["after-round"] == best["round"] and result["best"]["round"] == best["round"]
    assert "chosen by max:train.val-accuracy" in capsys.readouterr().out
    assert fedmed(["evaluate", "--run", str(cfg.run_dir), "--data", str(external), "--best", "--round", "1"]) == 2
    assert "--best and --round" in capsys.readouterr().err


# --- what a round record becomes ---------------------------------------------------------------------------------
def test_each_methods_state_becomes_numbers_by_hospital():
    qfedpolyp = tracking.method_scalars({"bit-widths": {"hospital-00": 4, "hospital-01": 8}})
    assert qfedpolyp == {"method/bit-widths/hospital-00": 4.0, "method/bit-widths/hospital-01": 8.0}
    fedmepd = tracking.method_scalars({"personalised": {"hospital-00": {"all": 0.25, "decoder.up1": 0.5}},
                                       "masks": {"hospital-00": [255, 0, 3]}, "server-train-loss": 0.7})
    assert fedmepd == {"method/personalised/hospital-00/all": 0.25, "method/personalised-mean/decoder.up1": 0.5,
                       "method/server-train-loss": 0.7}
    fedproin = tracking.method_scalars({"influence": {"a": [[1, 1], [0, 0]], "b": [[2, 0], [0, 4]]},
                                        "prototype-usage": [[3, 1], [0, 4]], "unused-prototypes": ["x#0"]},
                                       class_names=["x", "y"])
    assert fedproin["method/influence/a/x"] == 2 and fedproin["method/influence-share/a/x"] == 0.5
    assert fedproin["method/influence-share/b/y"] == 1.0 and "method/influence-share/a/y" in fedproin
    assert fedproin["method/prototype-usage/y/1"] == 4 and fedproin["method/unused-prototypes"] == 1
    record = {"round": 1, "refused": {"h": "norm | too large"}, "missing": ["m"], "test": {"dice": float("nan")}}
    assert "test/dice" not in tracking.round_scalars(record)
    texts = tracking.round_texts(record)
    assert "| h | norm / too large |" in texts["screening/refused"] and "m" in texts["screening/missing"]


def test_record_values_by_name_and_which_way_is_better():
    assert parse_selection("test.dice") == ("max", "test.dice")
    assert parse_selection("test.loss") == ("min", "test.loss") and parse_selection("test.hd95")[0] == "min"
    assert parse_selection("max:test.hd95") == ("max", "test.hd95")
    record = {"test": {"dice": 0.5, "dice/site.a": 0.25}, "method": {"personalised": {"hospital.a": {"all": 0.3}}},
              "bytes_up": 10, "train": {"val-dice": None}}
    assert record_value(record, "test.dice") == 0.5 and record_value(record, "test.dice/site.a") == 0.25
    assert record_value(record, "method.personalised.hospital.a.all") == 0.3
    assert record_value(record, "bytes_up") == 10 and record_value(record, "train.val-dice") is None
    assert record_value(record, "test.iou") is None


@pytest.mark.parametrize("key,value,message", [
    ("tracking", "wandb", "unknown tracker 'wandb'"), ("select-by", "tests.dice", "is not a metric of the round"),
    ("select-by", "test", "is not a metric of the round"), ("tracking-uri", "http://me:secret@host:5000", "password")])
def test_bad_tracking_and_selection_keys_are_refused_before_round_1(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config({key: value})


def test_tracking_and_selection_keys_are_normalised():
    cfg = load_job_config({"tracking": "MLflow, tensorboard", "select-by": " min:test.loss "})
    assert cfg.tracking == "mlflow,tensorboard" and cfg.select_by == "min:test.loss"
    assert load_job_config({"tracking": ""}).tracking == "none"


def test_a_tracker_that_is_not_installed_stops_the_run_before_round_1_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from flwr.app import Context, RecordDict

    from server_app import app as server

    from .fake_grid import FakeGrid

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "mlflow" else
                        real(name, *args))
    monkeypatch.setattr(server, "setup_logging", lambda: None)
    config = {**TINY, "run-name": "r", "results-dir": str(tmp_path), "tracking": "mlflow"}
    grid = FakeGrid({})
    with pytest.raises(ConfigError, match=r"tracking='mlflow': mlflow-skinny is not installed .*"
                                          r"pip install 'fedmed-hospitals\[mlflow\]'"):
        server.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    assert grid.sent == []


# --- runs made of round records, without training ----------------------------------------------------------------
def round_record(rnd: int, accuracy: float, hospitals=("hospital-00", "hospital-01"), **extra) -> dict:
    return {"round": rnd, "chosen": list(hospitals), "aggregated": list(hospitals), "missing": [], "refused": {},
            "traffic": {h: {"up": 1000 * rnd, "down": 2000} for h in hospitals},
            "bytes_up": 1000 * rnd * len(hospitals), "bytes_down": 2000 * len(hospitals), "seconds": 0.1,
            "test": {"accuracy": accuracy, "loss": 1 - accuracy},
            "hospital_metrics": {h: {"val-accuracy": accuracy / (i + 1), "num-examples": 10}
                                 for i, h in enumerate(hospitals)}, **extra}


def saved_rounds(cfg, accuracies, saver=None, engine=None):
    engine = engine or RoundEngine(cfg)
    saver = saver or RoundSaver(plot_interval=1e9)
    for accuracy in accuracies:
        engine.history.append(round_record(engine.next_round, accuracy))
        saver(engine, engine.history[-1])
    return engine, saver


def test_a_resumed_run_continues_its_mlflow_run_and_tensorboard_drops_the_rounds_it_replaces(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    cfg = load_job_config({**TINY, "results-dir": str(tmp_path), "run-name": "r", "num-server-rounds": 4,
                           "tracking": "tensorboard,mlflow", "select-by": "test.accuracy"})
    engine, saver = saved_rounds(cfg, [0.1, 0.2, 0.3])
    saver.close(cfg, engine.history, "stopped")  # the process ended after round 3
    _, first = mlflow_run(cfg.run_dir)
    assert first.info.status == "KILLED"

    resumed = cfg.model_copy(update={"resume_from": str(checkpoint_dir(cfg.run_dir) / "round-00002.npz")})
    engine = RoundEngine(resumed)
    engine.load_state_dict(load_checkpoint(resumed.resume_from))
    saver = RoundSaver(plot_interval=1e9)
    saver.start(engine)
    saved_rounds(resumed, [0.25, 0.4], saver, engine)
    finish(resumed, engine.history, None, saver)

    client, run = mlflow_run(cfg.run_dir)
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    steps = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "test/accuracy")]
    assert sorted(steps) == [(1, 0.1), (2, 0.2), (3, 0.25), (3, 0.3), (4, 0.4)]  # MLflow keeps both round 3s
    scalars, _ = tensorboard_scalars(cfg.run_dir / "tensorboard")
    assert scalars["test/accuracy"] == {1: pytest.approx(0.1), 2: pytest.approx(0.2), 3: pytest.approx(0.25),
                                        4: pytest.approx(0.4)}
    assert scalars["best/round"][3] == 3 and scalars["best/round"][4] == 4
    assert read_best(cfg.run_dir)["round"] == 4


def test_a_tracker_that_fails_is_logged_left_out_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    calls = []

    def broken(self, *args):
        calls.append(args[0])
        raise OSError(28, "No space left on device")

    def unreachable(self, *args, **kwargs):
        raise ConnectionError("tracking server at http://10.0.0.9:5000 does not answer")

    monkeypatch.setattr(tracking.TensorBoardTracker, "log_round", broken)
    monkeypatch.setattr(tracking.MlflowTracker, "__init__", unreachable)
    cfg = load_job_config({**TINY, "results-dir": str(tmp_path), "run-name": "r", "num-server-rounds": 4,
                           "tracking": "tensorboard,mlflow"})
    with caplog.at_level("INFO", logger="fedmed"):
        engine, saver = saved_rounds(cfg, [0.1, 0.2, 0.3, 0.4])
        finish(cfg, engine.history, None, saver)
    assert calls == [1, 2, 3]  # dropped after three failures running
    assert "tracking (mlflow): could not start (ConnectionError: tracking server at" in caplog.text
    assert "tracking (tensorboard): round 3 failed (OSError" in caplog.text and "left out for the rest" in caplog.text
    assert [r["round"] for r in read_history(cfg.run_dir)] == [1, 2, 3, 4]
    assert json.loads((cfg.run_dir / "status.json").read_text())["status"] == "completed"


# --- the plots and the data behind them --------------------------------------------------------------------------
def test_the_plots_show_each_hospitals_validation_bit_widths_and_influence(tmp_path):
    from PIL import Image

    history = [round_record(1, 0.5), round_record(2, 0.7)]
    history[0]["method"] = {"bit-widths": {"hospital-00": 4, "hospital-01": 8},
                            "influence": {"hospital-00": [[1, 1], [0, 0]], "hospital-01": [[2, 0], [0, 4]]}}
    history[1]["method"] = {"bit-widths": {"hospital-00": 4, "hospital-01": 8},
                            "influence": {"hospital-00": [[4, 0], [1, 1]]}}
    curves = hospital_validation_curves(history)
    assert curves["accuracy"]["hospital-01"] == [(0, 0.25), (1, 0.35)]  # the model each received: after round r-1
    assert curves["accuracy"]["global test"] == [(1, 0.5), (2, 0.7)] and "num-examples" not in curves
    assert bit_width_traffic(history)["hospital-01"] == [(1, 8, 0.001, 0.002), (2, 8, 0.002, 0.002)]
    influence = influence_shares(history)
    assert influence["hospitals"] == ["hospital-00", "hospital-01"] and influence["rounds"] == [1, 2]
    np.testing.assert_allclose(influence["shares"][:, :, 0], [[0.5, 0.0], [0.5, 1.0]])
    np.testing.assert_allclose(influence["shares"][0, :, 1], [1.0, 1.0])
    assert np.isnan(influence["shares"][1, :, 1]).all()  # hospital-01 was not aggregated in round 2

    written = {p.name: p for p in plot_history(history, tmp_path, class_names=["benign", "malignant"])}
    assert set(written) == {"test_metrics.png", "traffic.png", "hospitals.png", "influence.png"}
    with Image.open(written["traffic.png"]) as image:
        assert image.size[0] == 1100  # two panels: totals, and each hospital's uplink at its bit-width
    without = {p.name for p in plot_history([round_record(1, 0.5)], tmp_path / "plain")}
    assert without == {"test_metrics.png", "traffic.png", "hospitals.png"}


# --- fedmed runs --------------------------------------------------------------------------------------------------
def test_fedmed_runs_lists_a_results_folders_runs_newest_first(tmp_path, capsys):
    from cli.main import main as fedmed

    results = tmp_path / "results"

    def run(name, accuracies, rounds, **keys):
        cfg = load_job_config({**TINY, "results-dir": str(results), "run-name": name, "num-server-rounds": rounds,
                               **keys})
        engine, saver = saved_rounds(cfg, accuracies)
        return cfg, engine, saver

    cfg, engine, saver = run("done", [0.5, 0.8, 0.6], 3, **{"strategy": "fedprox", "partitioner": "dirichlet"})
    finish(cfg, engine.history, None, saver)
    run("going", [0.3], 3)  # this process is its ServerApp, still running
    cfg, engine, saver = run("crashed", [0.2, 0.1], 3, **{"select-by": "min:test.loss"})
    saver.close(cfg, engine.history, "failed", error="RuntimeError: out of memory")
    _, _, _ = run("killed", [0.4], 3)
    status = json.loads((results / "killed" / "status.json").read_text())
    ended = subprocess.Popen(["true"])
    ended.wait()  # a process that has ended: its ServerApp died without a word (SIGKILL)
    status["process"]["pid"] = ended.pid
    (results / "killed" / "status.json").write_text(json.dumps(status))
    _, _, _ = run("elsewhere", [0.4], 3)
    status = json.loads((results / "elsewhere" / "status.json").read_text())
    status["process"]["host"], status["updated"] = "another-host", time.time() - 2 * 86400
    (results / "elsewhere" / "status.json").write_text(json.dumps(status))
    (results / "not-a-run").mkdir()
    now = time.time()
    for age, name in enumerate(["going", "killed", "crashed", "done", "elsewhere"]):
        for file in (results / name).iterdir():
            os.utime(file, (now - 60 * age, now - 60 * age))

    assert fedmed(["runs", "--results", str(results)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    rows = {line.split(" | ")[0][2:]: [cell.strip() for cell in line.strip("| ").split(" | ")] for line in lines[1:]}
    assert list(rows) == ["going", "killed", "crashed", "done", "elsewhere"]
    assert {name: row[1] for name, row in rows.items()} == {"going": "running", "killed": "stopped",
                                                            "crashed": "failed", "done": "completed",
                                                            "elsewhere": "stopped"}
    done = rows["done"]
    assert done[2:7] == ["fedprox", "classification", "synthetic dirichlet(0.5)", "2", "3/3"]
    assert done[7:10] == ["max:test.accuracy", "0.8000 (2)", "0.6000"] and done[10] == "0.0"
    assert rows["crashed"][7:10] == ["min:test.loss", "0.8000 (1)", "0.9000"]  # its own select-by
    assert fedmed(["runs", "--results", str(results), "--metric", "hospital_metrics.hospital-01.val-accuracy"]) == 0
    out = capsys.readouterr().out
    assert "| done | completed |" in out and "0.4000 (1)" in out  # round 2 scored the model after round 1
    assert fedmed(["runs", "--results", str(tmp_path / "absent")]) == 2


def test_finished_runs_record_their_status_and_a_heartbeat(tmp_path):
    cfg = load_job_config({**TINY, "results-dir": str(tmp_path), "run-name": "r", "num-server-rounds": 2})
    engine, saver = saved_rounds(cfg, [0.1])
    running = json.loads((cfg.run_dir / "status.json").read_text())
    assert running["status"] == "running" and running["process"]["pid"] == os.getpid() and running["rounds"] == 1
    saved_rounds(cfg, [0.2], saver, engine)
    finish(cfg, engine.history, None, saver)
    done = json.loads((cfg.run_dir / "status.json").read_text())
    assert done["status"] == "completed" and done["rounds"] == 2 and math.isclose(done["started"],
                                                                                     running["started"])


def test_the_serverapp_tracks_its_rounds_keeps_the_best_model_and_says_it_completed(tmp_path, monkeypatch):
    """fedmed's ServerApp main on a fake grid (a Flower run without processes), TensorBoard on."""
    pytest.importorskip("tensorboard")
    from flwr.app import Context, RecordDict

    from server_app import app as server

    from .fake_grid import FakeGrid, simulated_hospitals

    config = {**TINY, "run-name": "flwr", "results-dir": str(tmp_path / "results"), "state-dir": str(tmp_path / "s"),
              "num-server-rounds": 2, "tracking": "tensorboard", "select-by": "min:train.val-loss"}
    monkeypatch.setattr(server, "setup_logging", lambda: None)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    server.main(FakeGrid(simulated_hospitals(config, 2)), context)

    run_dir = tmp_path / "results" / "flwr"
    history = read_history(run_dir)
    scalars, _ = tensorboard_scalars(run_dir / "tensorboard")
    assert scalars["test/accuracy"] == {r["round"]: pytest.approx(r["test"]["accuracy"]) for r in history}
    assert scalars["train/val-loss"] == {r["round"]: pytest.approx(r["train"]["val-loss"]) for r in history}
    assert read_best(run_dir)["round"] == 1  # round 2's val-loss, of the model after round 1 (round 1's: the initial)
    assert read_best(run_dir)["value"] == history[1]["train"]["val-loss"]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert json.loads((run_dir / "tracking.json").read_text())["tensorboard"]["last-round"] == 2
