"""A consortium's own network and data, named by import path: each method checks what it needs of the network before
round 1 and names what is missing; a loader of one's own feeds torch Datasets to every method; and
``examples/own_model`` (a ServerApp and a ClientApp of a consortium's own, with its own mod) runs FedProIn over MONAI's
DenseNet121 on folders of labelled images and QFedPolyp over MONAI's U-Net with its INT8 model, in ``flwr run``
simulation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.config import ConfigError, load_job_config
from common.data.synthetic import make_classification, make_polyps
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.round_engine import RoundEngine

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_model"
TINY = {"image-size": 16, "synthetic-samples": 60, "batch-size": 8, "min-partition-size": 5}


@pytest.fixture
def example_modules(monkeypatch):
    """The example's own modules (``data``) importable, as Flower makes them for its apps."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield
    sys.modules.pop("data", None)


def write_classification(root: Path, count: int, size: int, seed: int) -> None:
    data = make_classification(count, size, seed, 3)
    for i, (image, label) in enumerate(zip(data.images, data.labels)):
        folder = root / f"class-{data.class_names[label]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i:04d}.png")


def write_polyps(root: Path, count: int, size: int, seed: int) -> None:
    data = make_polyps(count, size, seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i, (image, mask) in enumerate(zip(data.images, data.masks)):
        Image.fromarray(image).save(root / "images" / f"{i:04d}.png")
        Image.fromarray(mask * 255).save(root / "masks" / f"{i:04d}.png")


@pytest.mark.parametrize("overrides,message", [
    ({"model": "monai.networks.nets:UNet"}, "cannot be built with .*missing 2 required positional arguments"),
    ({"model": "no_such_package.nets:Net"}, "module 'no_such_package.nets' cannot be imported"),
    ({"model": "torch.nn:Flatten"}, "gives \\(2, 768\\) for inputs of \\(2, 3, 16, 16\\); the classification task "
                                    "needs \\(2, 4\\)"),
    ({"strategy": "moon", "model": "torch.nn:Conv2d", "model-args": '{"in_channels": 3, "out_channels": 4, '
      '"kernel_size": 16}'}, "gives \\(2, 4, 1, 1\\)"),
    ({"task": "polyp-segmentation", "strategy": "qfedpolyp", "model": "tests.test_own_model:attention_segmenter",
      "synthetic-samples": 30}, "layer 'attention' \\(MultiheadAttention\\) holds weights that QFedPolyp"),
    ({"model-args": "[1, 2]"}, "model-args: .*not a JSON object"),
])
def test_each_method_checks_the_network_before_round_1_and_names_what_is_missing(overrides, message):
    with pytest.raises(ConfigError, match=message):
        RoundEngine(load_job_config({**TINY, **overrides}))


def attention_segmenter(in_channels: int, out_channels: int):
    """A segmentation network with a layer QAT cannot fake-quantise (for the check above)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(in_channels, 8, 3, padding=1)
            self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = torch.nn.Conv2d(8, out_channels, 1)

        def forward(self, x):
            y = self.conv(x)
            n, c, h, w = y.shape
            tokens = y.flatten(2).transpose(1, 2)
            y = self.attention(tokens, tokens, tokens)[0].transpose(1, 2).reshape(n, c, h, w)
            return self.head(y)

    return Net()


@pytest.mark.parametrize("strategy", ["fedavg", "fedbn", "moon", "fedproto", "fedproin"])
def test_every_classification_method_trains_a_monai_network_on_a_loader_of_ones_own(tmp_path, strategy,
                                                                                      example_modules, one_thread):
    write_classification(tmp_path / "images" / "train", 48, 32, 0)
    write_classification(tmp_path / "images" / "test", 24, 32, 1)
    cfg = load_job_config({"strategy": strategy, "model": "monai.networks.nets:DenseNet121", "image-size": 32,
                           "dataset": "data:image_folders", "data-dir": str(tmp_path / "images"), "batch-size": 8,
                           "num-server-rounds": 1, "model-args": '{"spatial_dims": 2, "growth_rate": 8, '
                           '"init_features": 8, "block_config": [2, 2, 2, 2]}'})
    sites = simulated_sites(cfg, 2)
    assert sum(len(s.train) + len(s.val) for s in sites) == 48  # every image once, in one hospital's part
    engine = run_rounds(cfg, sites)
    record = engine.history[0]
    assert record["aggregated"] == ["hospital-00", "hospital-01"], record["refused"]
    assert 0.0 <= record["test"]["accuracy"] <= 1.0 and record["test"]["num-examples"] == 24


def test_a_loader_that_fails_or_returns_no_pair_is_named(tmp_path, example_modules):
    cfg = load_job_config({**TINY, "dataset": "data:image_folders", "data-dir": str(tmp_path / "absent")})
    from common.data.containers import DataError

    with pytest.raises(DataError, match="dataset 'data:image_folders' failed for the server: FileNotFoundError"):
        RoundEngine(cfg)
    cfg = load_job_config({**TINY, "dataset": "tests.test_own_model:not_a_pair", "num-classes": 4})
    with pytest.raises(DataError, match="returned list for hospital-00, not a \\(train, validation\\) pair"):
        simulated_sites(cfg, 1)


def not_a_pair(request):
    return None if request.role == "server" else [1, 2, 3]


@pytest.mark.integration
@pytest.mark.slow
def test_a_consortiums_own_serverapp_and_clientapp_run_monai_networks_in_simulation(tmp_path):
    from cli.launch import run_log, submit_run, wait_for_run

    from .flower_processes import simulation_superlink

    write_classification(tmp_path / "images" / "train", 60, 32, 0)
    write_classification(tmp_path / "images" / "test", 30, 32, 1)
    write_polyps(tmp_path / "polyps" / "train", 40, 16, 0)
    write_polyps(tmp_path / "polyps" / "test", 16, 16, 1)
    common = {"state-dir": str(tmp_path / "state"), "results-dir": str(tmp_path / "results"),
              "audit-file": str(tmp_path / "audit.jsonl")}
    runs = {
        "fedproin": {"data-dir": str(tmp_path / "images"), "run-name": "densenet",
                     "model-args": '{"spatial_dims": 2, "growth_rate": 8, "init_features": 8, '
                                   '"block_config": [2, 2, 2, 2]}'},
        "qfedpolyp": {"strategy": "qfedpolyp", "task": "polyp-segmentation", "data-dir": str(tmp_path / "polyps"),
                      "run-name": "unet", "model": "monai.networks.nets:UNet", "dataset": "data:mask_folders",
                      "image-size": 16, "int8-file": str(tmp_path / "unet.int8.onnx"),
                      "model-args": '{"spatial_dims": 2, "channels": [8, 16, 32], "strides": [2, 2]}'},
    }
    summaries = {}
    with simulation_superlink(tmp_path) as home:
        for name, overrides in runs.items():
            result = tmp_path / f"{name}.json"
            run_id = submit_run(home, "local", {**common, **overrides, "result-file": str(result)},
                                {"num-supernodes": 2}, app_dir=EXAMPLE)
            status = wait_for_run(home, "local", run_id, 600.0)
            assert status == "finished:completed", run_log(home, "local", run_id)[-4000:]
            summaries[name] = json.loads(result.read_text())

    densenet = summaries["fedproin"]
    for rnd in ("1", "2"):
        assert 0.0 <= densenet["test"][rnd]["accuracy"] <= 1.0
        train = densenet["train"][rnd]
        assert train["hospitals-aggregated"] == 2 and len(train["method.influence.hospital-00"]) == 3 * 2
    unet = summaries["qfedpolyp"]
    assert unet["train"]["2"]["method.bit-widths.hospital-00"] == 8 and Path(unet["int8"]["file"]).is_file()
    assert abs(unet["int8"]["int8"] - unet["int8"]["float"]) < 0.05  # the INT8 model keeps the float one's Dice
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    trained = [entry for entry in audit if entry["kind"] == "train" and not entry["error"]]
    assert len(trained) == 2 * 2 * 2 and len({entry["node"] for entry in trained}) >= 2  # the hospitals' own mod ran
    assert np.isfinite([m["accuracy"] for m in densenet["test"].values()]).all()
