"""A run's models scored at every hospital at the end of the run (cross-site evaluation), and on a labelled
folder the run never saw (``fedmed evaluate``), on generated data."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
from flwr.app import Error, Message, MessageType

from common.config import ConfigError, load_job_config
from common.data.containers import DataError, SegmentationImages, concat
from common.data.export import write_site
from common.data.sources import generate
from common.engine.inprocess import run_rounds, simulated_sites
from common.quantization.int8 import load_deployment
from server_app.app import save_round
from server_app.evaluation import evaluate_run, render_evaluation, write_cross_site
from strategies import FedAvgStrategy, FedMEPDStrategy, FedProtoStrategy

from .fake_grid import FakeGrid, simulated_hospitals
from .test_strategies import SMALL_BRAIN, SMALL_CLASSIFICATION, SMALL_POLYP, run_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_hospital_scores_the_final_model_and_the_silent_and_failing_are_named(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION, **{"cross-site-evaluation": True})
    nodes = simulated_hospitals(config, 4)

    def failing_evaluation(message: Message) -> Message | None:
        if message.metadata.message_type == MessageType.EVALUATE:
            return Message(Error(code=1, reason="hospital-02: val/x.png cannot be read"), reply_to=message)
        return nodes[103](message)

    def silent_evaluation(message: Message) -> Message | None:
        return None if message.metadata.message_type == MessageType.EVALUATE else nodes[104](message)

    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    strategy.start(FakeGrid({101: nodes[101], 102: nodes[102], 103: failing_evaluation, 104: silent_evaluation}),
                   num_rounds=2, timeout=2.0)
    record = strategy.cross_site
    assert record["after-round"] == 2 and sorted(record["scores"]) == ["hospital-00", "hospital-01"]
    assert set(record["scores"]["hospital-00"]) == {"global"}
    assert 0.0 <= record["scores"]["hospital-00"]["global"]["accuracy"] <= 1.0
    assert "val/x.png cannot be read" in record["failed"]["hospital-02"] and record["missing"] == ["hospital-03"]

    text = write_cross_site(tmp_path / "run", record, "classification")
    assert "| hospital-00 |" in text and "No answer: hospital-03" in text and "hospital-02 (" in text
    assert json.loads((tmp_path / "run" / "cross_site.json").read_text())["missing"] == ["hospital-03"]
    assert (tmp_path / "run" / "plots" / "cross_site.png").stat().st_size > 1000


def test_personalised_methods_score_each_hospitals_own_model_too(tmp_path):
    brain = run_config(tmp_path / "brain", SMALL_BRAIN, **{"cross-site-evaluation": True})
    strategy = FedMEPDStrategy(min_train_nodes=2, run_config=brain)
    strategy.start(FakeGrid(simulated_hospitals(brain, 2)), num_rounds=1)
    scores = strategy.cross_site["scores"]
    assert sorted(scores) == ["hospital-00", "hospital-01"]
    assert all(set(by_model) == {"global", "own"} and "dice_mean" in by_model["own"] for by_model in scores.values())

    proto = run_config(tmp_path / "proto", SMALL_CLASSIFICATION, **{"cross-site-evaluation": True})
    strategy = FedProtoStrategy(min_train_nodes=2, run_config=proto)
    strategy.start(FakeGrid(simulated_hospitals(proto, 2)), num_rounds=2)
    assert all(set(by_model) == {"own"} for by_model in strategy.cross_site["scores"].values())


def finished_run(tmp_path, job: dict, rounds: int = 2):
    cfg = load_job_config({**job, "num-server-rounds": rounds, "results-dir": str(tmp_path / "results"),
                           "run-name": "done"})
    run_rounds(cfg, simulated_sites(cfg, 2), on_round_end=save_round)
    return cfg


def test_fedmed_evaluate_scores_the_global_model_on_a_new_folder(tmp_path):
    cfg = finished_run(tmp_path, {**SMALL_CLASSIFICATION, "strategy": "fedavg"})
    new_site = tmp_path / "external"
    unseen = generate("classification", 60, cfg.image_size, seed=999)
    write_site(cfg, unseen, new_site, "test")
    result = evaluate_run(cfg.run_dir, new_site)
    assert result["model"] == "global model" and result["after-round"] == 2 and result["dataset"] == "npz"
    assert result["overall"]["num-examples"] == 60 and -1.0 <= result["overall"]["mcc"] <= 1.0
    assert {"accuracy", "f1_weighted", "mcc"} <= set(result["overall"])
    assert "| all |" in render_evaluation(result)
    earlier = evaluate_run(cfg.run_dir, new_site, round_number=1)
    assert earlier["after-round"] == 1
    with pytest.raises(ConfigError, match="--round 9: .*round-00009.npz does not exist"):
        evaluate_run(cfg.run_dir, new_site, round_number=9)


def test_a_folder_whose_classes_do_not_fit_the_run_is_refused_naming_them(tmp_path):
    cfg = finished_run(tmp_path, {**SMALL_CLASSIFICATION, "strategy": "fedavg"}, rounds=1)
    other = tmp_path / "other-classes"
    write_site(cfg, generate("classification", 40, cfg.image_size, seed=5, num_classes=3), other, "test")
    with pytest.raises(DataError, match="its class-names is 'solid,ring,striped', but .* was trained with "
                                        "'solid,ring,striped,dotted'"):
        evaluate_run(cfg.run_dir, other)


def test_fedmed_evaluate_scores_a_fedproto_hospitals_own_model_and_per_source_polyp_scores(tmp_path):
    cfg = finished_run(tmp_path / "proto", {**SMALL_CLASSIFICATION, "strategy": "fedproto"}, rounds=1)
    folder = tmp_path / "external"
    write_site(cfg, generate("classification", 40, cfg.image_size, seed=3), folder, "test")
    result = evaluate_run(cfg.run_dir, folder, hospital="hospital-01")
    assert result["model"] == "hospital-01's own model" and "accuracy" in result["overall"]
    with pytest.raises(ValueError, match="FedProto has a model per hospital only; choose one of"):
        evaluate_run(cfg.run_dir, folder)

    polyp = finished_run(tmp_path / "polyp", {**SMALL_POLYP, "strategy": "fedavg"}, rounds=1)
    frames = tmp_path / "frames"
    parts = []
    for source, seed in (("clinic-a", 1), ("clinic-b", 2)):
        made = generate("polyp-segmentation", 6, polyp.image_size, seed=seed)
        parts.append(SegmentationImages(made.images, made.masks, made.names, np.full(len(made), source)))
    write_site(polyp, concat(parts), frames, "test")  # frames/clinic-a/{images,masks}, frames/clinic-b/...
    scores = evaluate_run(polyp.run_dir, frames)
    assert {"dice", "iou"} <= set(scores["overall"]) and scores["overall"]["num-examples"] == 12
    assert sorted(scores["sources"]) == ["clinic-a", "clinic-b"] and np.isfinite(scores["sources"]["clinic-a"]["dice"])


def test_the_evaluate_command_prints_and_writes_the_table_and_names_a_bad_folder(tmp_path, capsys):
    from cli.main import main

    cfg = finished_run(tmp_path, {**SMALL_CLASSIFICATION, "strategy": "fedavg"}, rounds=1)
    folder = tmp_path / "site-x"
    write_site(cfg, generate("classification", 40, cfg.image_size, seed=7), folder, "test")
    assert main(["evaluate", "--run", str(cfg.run_dir), "--data", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert "global model of" in printed and "| all |" in printed
    written = json.loads((cfg.run_dir / "evaluations" / "site-x.json").read_text())
    assert written["overall"]["num-examples"] == 40 and (cfg.run_dir / "evaluations" / "site-x.md").exists()
    assert main(["evaluate", "--run", str(cfg.run_dir), "--data", str(tmp_path / "nowhere")]) == 2
    assert "--data: " in capsys.readouterr().err


def test_fedmed_evaluate_scores_a_brain_model_on_case_folders_with_only_some_modalities(tmp_path):
    import nibabel as nib

    from common.data.brain_sources import _generated

    brain = finished_run(tmp_path, {**SMALL_BRAIN, "strategy": "fedmepd"}, rounds=1)
    folder = tmp_path / "brats-site"
    for case in list(_generated(2, 24, seed=123).values()):
        case_dir = folder / case.name
        case_dir.mkdir(parents=True)
        for index, modality in enumerate(("flair", "t1ce")):  # this site has two sequences only
            nib.save(nib.Nifti1Image(case.image[index], np.eye(4)),
                     case_dir / f"{case.name}_{modality}.nii.gz")
        seg = np.where(case.label == 3, 4, case.label).astype(np.uint8)
        nib.save(nib.Nifti1Image(seg, np.eye(4)), case_dir / f"{case.name}_seg.nii.gz")
    result = evaluate_run(brain.run_dir, folder, modalities="flair,t1ce")
    assert result["dataset"] == "brats" and result["overall"]["num-examples"] == 2
    assert 0.0 <= result["overall"]["dice_mean"] <= 1.0 and "dice_WT" in result["overall"]


OWN_NETS = '''
import torch


def segmenter(in_channels, out_channels):
    return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(4, out_channels, 1))
'''
OWN_DATA = '''
import torch


class Pairs(torch.utils.data.Dataset):
    """(image, mask) pairs with images in [0, 1], not normalised as ImageNet's: the consortium's own pipeline."""

    def __init__(self, count, size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.rand(count, 3, size, size, generator=generator)
        self.masks = (self.images[:, :1] > 0.5).float()

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], self.masks[index]


def load(request):
    size = int(request.args["size"])
    return Pairs(8, size, 1) if request.role == "server" else (Pairs(24, size, 2), Pairs(4, size, 3))
'''


@pytest.fixture
def consortium_code(tmp_path):
    """An app folder with a consortium's own network and loader (``consortium_code.nets``, ``.data``), on no path;
    its modules are forgotten after the test."""
    package = tmp_path / "app" / "consortium_code"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(OWN_NETS)
    (package / "data.py").write_text(OWN_DATA)
    yield package.parent
    forget_consortium_code()


def forget_consortium_code() -> None:
    """As a fresh process would: the modules imported from the app folder are not there."""
    for name in [name for name in sys.modules if name.split(".")[0] == "consortium_code"]:
        del sys.modules[name]


def test_post_run_tools_take_the_runs_own_network_loader_and_normalisation(tmp_path, consortium_code, capsys):
    from cli.int8_export import calibration_batches
    from cli.main import main as fedmed
    from common.engine.round_engine import RoundEngine
    from common.methods.base import unpack_json
    from server_app.checkpoint import save_best, save_checkpoint

    app = consortium_code
    cfg = load_job_config({**SMALL_POLYP, "strategy": "qfedpolyp", "model": "consortium_code.nets:segmenter",
                           "dataset": "consortium_code.data:load", "dataset-args": '{"size": 16}',
                           "run-name": "own", "results-dir": str(tmp_path / "results")})
    sys.path.insert(0, str(app))  # the run's ServerApp imported them from its app folder, as Flower runs an app
    try:
        engine = RoundEngine(cfg)
    finally:
        sys.path.remove(str(app))
    engine.history = [{"round": 1}]
    state = engine.state_dict()
    assert unpack_json(state["run/import-paths"]) == [str(app.resolve())]  # recorded in every checkpoint
    save_checkpoint(cfg.run_dir, 1, state)
    save_best(cfg.run_dir, 1, state, "max:test.dice", 0.5)
    forget_consortium_code()
    run, site = str(cfg.run_dir), tmp_path / "site"
    site.mkdir()

    # evaluate --best: no --dataset, no PYTHONPATH; the run's network and loader, imported from its app folder
    assert fedmed(["evaluate", "--run", run, "--data", str(site), "--best", "--out", str(tmp_path / "best")]) == 0
    scores = json.loads((tmp_path / "best.json").read_text())
    assert scores["dataset"] == "consortium_code.data:load" and scores["overall"]["num-examples"] == 8
    assert scores["model"] == "global model of the best round" and str(app) not in sys.path  # the path put back
    forget_consortium_code()

    # export-int8 calibrates on what the run trained on: the loader's [0, 1] images, not ImageNet-normalised ones
    model_file = tmp_path / "own.onnx"
    assert fedmed(["export-int8", "--run", run, "--best", "--out", str(model_file), "--engine", "onnxruntime",
                   "--calibration-images", "16"]) == 0
    _, metadata = load_deployment(model_file)
    low, high = metadata["calibration-range"]
    assert 0.0 <= low < 0.05 and 0.95 < high <= 1.0 and metadata["calibration-images"] == 16
    assert metadata["normalisation"] == "dataset consortium_code.data:load"
    built_in = load_job_config({**SMALL_POLYP, "strategy": "qfedpolyp"})  # a built-in format: ImageNet's statistics
    assert min(float(b.min()) for b in calibration_batches(built_in, None, 8)) < -1.0
    capsys.readouterr()
    assert fedmed(["segment", "--model", str(model_file), "--images", str(site), "--out", str(tmp_path / "m")]) == 2
    assert "normalised by the run's own dataset consortium_code.data:load" in capsys.readouterr().err
    forget_consortium_code()

    # the app folder gone: exactly what to pass; --app-dir where it is now
    moved = tmp_path / "elsewhere"
    shutil.move(str(app), moved)
    assert fedmed(["evaluate", "--run", run, "--data", str(site), "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err
    assert "model: module 'consortium_code.nets' of the run cannot be imported here" in error
    assert f"{app.resolve()} (gone now)" in error and "Pass --app-dir FOLDER" in error and "PYTHONPATH=" in error
    assert fedmed(["evaluate", "--run", run, "--data", str(site), "--app-dir", str(moved),
                   "--out", str(tmp_path / "moved")]) == 0
    assert json.loads((tmp_path / "moved.json").read_text())["overall"]["num-examples"] == 8
