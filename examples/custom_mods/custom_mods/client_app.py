"""custom_mods: A Flower app with custom mods."""

import os

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from custom_mods.mods import get_tensorboard_mod, get_wandb_mod
from custom_mods.task import Net, load_data
from custom_mods.task import test as test_fn
from custom_mods.task import train as train_fn

TRACKER_DIR = os.environ.get("CUSTOM_MODS_TRACKER_DIR", ".runs_history")

# Flower ClientApp
app = ClientApp(
    mods=[
        get_tensorboard_mod(TRACKER_DIR),
        get_wandb_mod("Custom mods example", TRACKER_DIR),
    ],
)


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    model = Net()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    device = torch.device("cpu")
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    batch_size = int(context.run_config["batch-size"])
    trainloader, _ = load_data(partition_id, num_partitions, batch_size)
    train_loss = train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"], device)
    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cpu")
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    batch_size = int(context.run_config["batch-size"])
    _, valloader = load_data(partition_id, num_partitions, batch_size)
    eval_loss, eval_acc = test_fn(model, valloader, device)
    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader.dataset)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
