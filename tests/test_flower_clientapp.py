"""Flower's contract for the FedAvg family: a standard Flower ClientApp that trains itself (Flower's quickstart
ClientApp, unchanged) is served by FedAvgStrategy and FedProxStrategy as by Flower's FedAvg and FedProx: Flower's own
messages (one ArrayRecord of the network's tensors, the train config with ``server-round``; FedProx's
``proximal-mu``), its per-tensor replies under its own names accepted, the network taken from ``initial_arrays``;
and fedmed's screening, audit and round records still apply to them."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from common.config import ConfigError
from strategies import FedAvgStrategy, FedProInStrategy, FedProxStrategy

from .conftest import ROOT
from .fake_grid import FakeGrid, flower_clientapp_node

sys.path.insert(0, str(ROOT / "examples" / "quickstart_pytorch"))
from quickstart import client_app as quickstart_client  # noqa: E402  (Flower's quickstart ClientApp, as it is)
from quickstart.task import Net  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

APP_CONFIG = {"batch-size": 32, "local-epochs": 1}  # the quickstart app's own run config, as its ClientApp reads it


def quickstart_nodes(count: int, hostile: int | None = None) -> dict[int, object]:
    """``count`` nodes running the quickstart ClientApp on partitions of its generated images; node ``hostile``
    scales the model it trained by 1000 before replying."""
    nodes = {}
    for pid in range(count):
        answer = flower_clientapp_node(quickstart_client.app, APP_CONFIG,
                                       {"partition-id": pid, "num-partitions": count}, 101 + pid)
        if pid == hostile:
            answer = scaled(answer, 1000.0)
        nodes[101 + pid] = answer
    return nodes


def scaled(answer, factor: float):
    def hostile(message: Message) -> Message:
        reply = answer(message)
        if message.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        arrays = reply.content["arrays"].to_torch_state_dict()
        reply.content["arrays"] = ArrayRecord({k: v * factor for k, v in arrays.items()})
        return reply
    return hostile


def fedmed_job(tmp_path) -> dict:
    """Where fedmed writes (audit log, reply store) and its screening; nothing about the network: it is the app's."""
    return {"run-name": "quickstart", "results-dir": str(tmp_path / "results"), "state-dir": str(tmp_path / "state"),
            "screening.update-norm-limit": 10.0}


def central_accuracy(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """The quickstart ServerApp's evaluate_fn: the global model loads into Net as it is."""
    from quickstart.task import load_centralized_dataset, test

    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, accuracy = test(model, load_centralized_dataset(), torch.device("cpu"))
    return MetricRecord({"accuracy": accuracy, "loss": loss})


def train_replies(grid: FakeGrid, rnd: int) -> dict[int, Message]:
    sent = {m.metadata.message_id: m for m in grid.sent_of_type(MessageType.TRAIN)
            if m.content["config"]["server-round"] == rnd}
    return {m.metadata.src_node_id: m for m in grid.replies if m.metadata.reply_to_message_id in sent}


@pytest.mark.parametrize("strategy_type", [FedAvgStrategy, FedProxStrategy], ids=["FedAvg", "FedProx"])
def test_a_flower_clientapp_that_trains_itself_is_served_with_fedmeds_screening(tmp_path, strategy_type):
    grid = FakeGrid(quickstart_nodes(3, hostile=2))
    extra = {"proximal_mu": 0.1} if strategy_type is FedProxStrategy else {}
    strategy = strategy_type(fraction_evaluate=1.0, min_train_nodes=2, min_available_nodes=3,
                             settings=fedmed_job(tmp_path), **extra)
    initial = ArrayRecord(Net().state_dict())  # the quickstart ServerApp's: the network's shape comes from here
    result = strategy.start(grid, initial_arrays=initial, train_config=ConfigRecord({"lr": 0.05}), num_rounds=2,
                            evaluate_fn=central_accuracy)

    names = list(Net().state_dict())
    for message in grid.sent_of_type(MessageType.TRAIN):  # Flower's own messages, as its FedAvg/FedProx send them
        assert set(message.content) == {"arrays", "config"} and list(message.content["arrays"]) == names
        config = message.content["config"]
        assert config["lr"] == 0.05 and config["server-round"] in (1, 2)
        assert config.get("proximal-mu") == (0.1 if strategy_type is FedProxStrategy else None)
        assert not any(key.startswith("fedmed.") for key in config)
    replies = train_replies(grid, 2)
    assert all(list(reply.content["arrays"]) == names for reply in replies.values())  # per tensor, its own names
    assert len(grid.sent_of_type(MessageType.QUERY)) == 3  # the identity query only: no end-of-run query to them

    for record in strategy.engine.history:  # the hostile node is refused by the update-norm rule, the others averaged
        assert record["aggregated"] == ["node-101", "node-102"] and "skipped" not in record
        assert "node-103" in record["refused"] and "update" in record["refused"]["node-103"]
    honest = [replies[101], replies[102]]
    weights = np.array([r.content["metrics"]["num-examples"] for r in honest], dtype=np.float64)
    for name in names:  # the sample-weighted mean of the honest replies is the next global model
        expected = sum(w * r.content["arrays"][name].numpy() for w, r in zip(weights / weights.sum(), honest))
        np.testing.assert_allclose(result.arrays[name].numpy(), expected, rtol=1e-5, atol=1e-6)

    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]  # the app's evaluate_fn, on Net as it is
    assert 0.0 <= result.evaluate_metrics_serverapp[2]["accuracy"] <= 1.0
    assert "eval_acc" in result.evaluate_metrics_clientapp[2]  # Flower's evaluate phase, the ClientApp's evaluate
    assert result.train_metrics_clientapp[2]["hospitals-refused"] == 1
    audit = [json.loads(line) for line in (tmp_path / "results" / "quickstart" / "audit.jsonl").read_text().split("\n")
             if line]
    assert {line.get("peer") for line in audit if line.get("kind") == "train"} >= {"node-101", "node-102", "node-103"}


def test_record_keys_and_weighting_key_are_flowers_for_a_clientapp_that_trains_itself(tmp_path):
    """A ClientApp reading the strategy's own ``arrayrecord_key``/``configrecord_key`` and weighting by its key."""

    def own_keys_app(message: Message, context) -> Message:
        if message.metadata.message_type != MessageType.TRAIN:
            raise ValueError("No query function registered with name 'default'")
        weights = {k: v + 0.01 * (context.node_id - 100) for k, v in
                   message.content["weights"].to_torch_state_dict().items()}
        assert message.content["settings"]["server-round"] == 1
        return Message(RecordDict({"weights": ArrayRecord(weights),
                                   "stats": MetricRecord({"n": 10 * (context.node_id - 100)})}), reply_to=message)

    nodes = {node: flower_clientapp_node(own_keys_app, {}, {}, node) for node in (101, 102)}
    strategy = FedAvgStrategy(arrayrecord_key="weights", configrecord_key="settings", weighted_by_key="n",
                              settings={**fedmed_job(tmp_path), "screening.max-hospital-weight": 1.0})  # 2 of 3: uncut
    initial = ArrayRecord(Net().state_dict())
    result = strategy.start(FakeGrid(nodes), initial_arrays=initial, num_rounds=1)
    for name, value in initial.items():  # (10 x 0.01 + 20 x 0.02) / 30 added to every weight
        np.testing.assert_allclose(result.arrays[name].numpy(), value.numpy() + 0.5 / 30, rtol=1e-5, atol=1e-6)


def test_initial_arrays_that_do_not_fit_the_named_network_say_so(tmp_path):
    strategy = FedAvgStrategy(settings={**fedmed_job(tmp_path), "model": "small-cnn"})
    grid = FakeGrid(quickstart_nodes(2))
    with pytest.raises(ConfigError, match=r"missing .*unexpected .*conv1.* not a fedavg model of the network the run "
                                          r"config names \(model='small-cnn'\).* or leave model unset"):
        strategy.start(grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=1)
    assert grid.sent == []


def test_a_method_with_a_hospital_step_refuses_a_clientapp_that_trains_itself_saying_what_to_add(tmp_path):
    strategy = FedProInStrategy(settings={**fedmed_job(tmp_path), "model": "small-cnn"})
    with pytest.raises(ConfigError, match=r"node 101: a Flower ClientApp that trains the model itself .*but "
                                          r"fedproin's hospitals run fedmed's fedproin step: make its ClientApp a "
                                          r"HospitalClientApp"):
        strategy.start(FakeGrid(quickstart_nodes(2)), num_rounds=1)


class BatchNormNet(torch.nn.Module):
    """A small network with a BatchNorm layer, for FedBN."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def fedbn_clientapp(message: Message, context) -> Message:
    """A Flower ClientApp for FedBN as Flower's FedBN examples write one: the shared weights loaded with
    strict=False over its own BatchNorm layers (kept in context.state between rounds), its whole state sent back."""
    from quickstart.task import load_data

    if message.metadata.message_type != MessageType.TRAIN:
        raise ValueError("No query function registered with name 'default'")
    model = BatchNormNet()
    if "bn" in context.state:
        model.load_state_dict(context.state["bn"].to_torch_state_dict(), strict=False)
    model.load_state_dict(message.content["arrays"].to_torch_state_dict(), strict=False)
    trainloader, _ = load_data(context.node_config["partition-id"], 2, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for batch in trainloader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(batch["img"]), batch["label"]).backward()
        optimizer.step()
    context.state["bn"] = ArrayRecord({k: v for k, v in model.state_dict().items() if k.startswith("bn.")})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(trainloader.dataset)})}), reply_to=message)


def test_fedbn_serves_a_clientapp_that_trains_itself_and_keeps_its_normalisation_layers(tmp_path):
    from strategies import FedBNStrategy

    nodes = {101 + pid: flower_clientapp_node(fedbn_clientapp, {}, {"partition-id": pid}, 101 + pid) for pid in (0, 1)}
    grid = FakeGrid(nodes)
    initial = ArrayRecord(BatchNormNet().state_dict())
    result = FedBNStrategy(settings=fedmed_job(tmp_path)).start(grid, initial_arrays=initial, num_rounds=2)
    for message in grid.sent_of_type(MessageType.TRAIN):  # the shared weights only: BatchNorm stays at each hospital
        assert sorted(message.content["arrays"]) == ["conv.bias", "conv.weight", "fc.bias", "fc.weight"]
    replies = train_replies(grid, 2)
    assert all("bn.running_mean" in reply.content["arrays"] for reply in replies.values())
    expected = np.mean([r.content["arrays"]["conv.weight"].numpy() for r in replies.values()], axis=0)
    np.testing.assert_allclose(result.arrays["conv.weight"].numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.arrays["bn.running_var"].numpy(), initial["bn.running_var"].numpy())
    assert list(result.arrays) == list(initial)  # loads into the network as it is, counters included


def test_a_robust_aggregate_takes_the_median_of_clientapps_that_train_themselves(tmp_path):
    grid = FakeGrid(quickstart_nodes(3))
    strategy = FedAvgStrategy(min_train_nodes=3, min_available_nodes=3,
                              settings={**fedmed_job(tmp_path), "screening.robust-aggregate": "median"})
    result = strategy.start(grid, initial_arrays=ArrayRecord(Net().state_dict()),
                            train_config=ConfigRecord({"lr": 0.05}), num_rounds=1)
    replies = train_replies(grid, 1)
    for name in Net().state_dict():
        median = np.median([reply.content["arrays"][name].numpy() for reply in replies.values()], axis=0)
        np.testing.assert_allclose(result.arrays[name].numpy(), median, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("setting,says", [
    ({"secure-aggregation.enabled": True}, "secure aggregation masks every reply at the hospital: make its ClientApp a "
                                            "HospitalClientApp"),
    ({"hospital-keys": "KEYS"}, "hospital-keys is set and it cannot sign its name: make its ClientApp a "
                                "HospitalClientApp")], ids=["secure aggregation", "hospital-keys"])
def test_a_clientapp_with_nothing_of_fedmed_is_refused_where_the_job_needs_fedmed_at_the_hospital(tmp_path, setting,
                                                                                                 says):
    (tmp_path / "keys").mkdir()
    settings = {**fedmed_job(tmp_path), **{k: str(tmp_path / "keys") if v == "KEYS" else v for k, v in setting.items()}}
    grid = FakeGrid(quickstart_nodes(2))
    with pytest.raises(ConfigError, match=f"node 101: a Flower ClientApp that trains the model itself .*, but {says}"):
        FedAvgStrategy(settings=settings).start(grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=1)
    assert not grid.sent_of_type(MessageType.TRAIN)
