"""monaiexample: A Flower / MONAI app."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from monaiexample.task import load_data, load_model, test_func, train_func

# Flower ClientApp
app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    model = load_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cpu")
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    trainloader, _ = load_data(num_partitions, partition_id, batch_size)
    train_loss = train_func(model, trainloader, epoch_num=1, device=device)
    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader)}
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    model = load_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cpu")
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    _, valloader = load_data(num_partitions, partition_id, batch_size)
    eval_loss, eval_acc = test_func(model, valloader, device)
    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
