"""A consortium's own ServerApp: FedProIn over a MONAI DenseNet121, or QFedPolyp over a MONAI U-Net followed by the
INT8 model of the final network; the network and the data loaders are named in the run config."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from strategies import FedProInStrategy, QFedPolypStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    if config["strategy"] == "fedproin":
        strategy = FedProInStrategy(num_prototypes=2, fraction_train=1.0, min_train_nodes=2, run_config=config)
    else:
        strategy = QFedPolypStrategy(bit_widths="8", fraction_train=1.0, min_train_nodes=2, run_config=config)
    result = strategy.start(grid, initial_arrays=strategy.initial_arrays(), num_rounds=int(config["rounds"]))
    summary = {"test": {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()},
               "train": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
               "arrays": len(result.arrays)}
    if config["strategy"] == "qfedpolyp":
        summary["int8"] = int8_model(strategy, Path(str(config["int8-file"])))
    Path(str(config["result-file"])).write_text(json.dumps(summary, indent=1, default=str))


def int8_model(strategy, path: Path) -> dict:
    """The final network as an INT8 ONNX model, calibrated and scored on the server's test images."""
    from common.quantization.onnx_int8 import OnnxSegmenter, export_int8

    engine = strategy.engine
    network = engine.method.evaluation_model()
    test = engine.test_data
    batches = [x for x, _ in engine.method.task.batches(test, 8, torch.device("cpu"), None, train=False)]
    export_int8(network, batches, path, {"image-size": strategy.job.image_size, "threshold": 0.5})
    return {"file": str(path), "float": engine.method.task.evaluate(network, test)["dice"],
            "int8": engine.method.task.evaluate(OnnxSegmenter(path), test)["dice"]}
