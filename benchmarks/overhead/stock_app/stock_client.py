"""Stock-style ClientApp: train and evaluate handlers, as in Flower's PyTorch quickstart."""

import time

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from common.data.synthetic import make_classification
from common.models.small_cnn import build_small_cnn

app = ClientApp()


def local_data(context: Context):
    seed = int(context.node_config.get("partition-id", context.node_config.get("seed", 0)))
    data = make_classification(int(context.run_config["samples-per-hospital"]), int(context.run_config["image-size"]),
                               seed)
    x = torch.from_numpy(data.images).permute(0, 3, 1, 2).float() / 255.0
    return x, torch.from_numpy(data.labels)


@app.train()
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    model = build_small_cnn(4)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = local_data(context)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for start in range(0, len(y), 16):
        optimizer.zero_grad()
        F.cross_entropy(model(x[start:start + 16]), y[start:start + 16]).backward()
        optimizer.step()
    metrics = MetricRecord({"num-examples": len(y), "train-seconds": time.perf_counter() - started})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    model = build_small_cnn(4)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = local_data(context)
    model.eval()
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    metrics = MetricRecord({"num-examples": len(y), "accuracy": accuracy,
                            "eval-seconds": time.perf_counter() - started})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
