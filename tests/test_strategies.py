"""The Flower layer on a fake Grid (no processes): each strategy class runs its own method and aggregates
as its core does, ``start()`` honours its arguments, the method's state is in the Result, hospitals are
re-identified after a restart, and unknown, failing, malformed and silent nodes are handled."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

import strategies
from common.config import ConfigError, JobConfig, load_job_config
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.wire import from_recorddict
from strategies import (
    FedAvgStrategy,
    FederatedDecoderStrategy,
    FedMEPDStrategy,
    FedProInStrategy,
    FedProtoStrategy,
    FedProxStrategy,
    LocalOnlyStrategy,
    MoonStrategy,
    QFedPolypStrategy,
    SharedEncoderFedAvgStrategy,
)
from strategies.records import arrays_of

from .fake_grid import FakeGrid, hospital_node, simulated_hospitals

SMALL_CLASSIFICATION = {"model": "small-cnn", "image-size": 16, "synthetic-samples": 120, "batch-size": 16,
                        "min-partition-size": 5}
SMALL_POLYP = {"task": "polyp-segmentation", "synthetic-samples": 30, "image-size": 16, "batch-size": 8,
               "min-partition-size": 5}
SMALL_BRAIN = {"task": "brain-tumour-segmentation", "batch-size": 2, "brain.widths": "4,8,16,32", "brain.crop-size": 16,
               "brain.synthetic-size": 24, "brain.synthetic-cases": 12, "brain.hospital-modalities": "t1ce;flair,t2",
               "device": "cpu", "fedmepd.warmup-rounds": 0, "fedmepd.patience": 1, "fedmepd.num-anchors": 2}
CASES = [(FedAvgStrategy, SMALL_CLASSIFICATION), (FedProxStrategy, SMALL_CLASSIFICATION),
         (MoonStrategy, SMALL_CLASSIFICATION), (FedProtoStrategy, SMALL_CLASSIFICATION),
         (FedProInStrategy, SMALL_CLASSIFICATION), (QFedPolypStrategy, {**SMALL_POLYP, "qfedpolyp.bit-widths": "4,8"}),
         (FedMEPDStrategy, SMALL_BRAIN), (SharedEncoderFedAvgStrategy, SMALL_BRAIN),
         (FederatedDecoderStrategy, SMALL_BRAIN), (LocalOnlyStrategy, SMALL_BRAIN)]


pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(tmp_path, base: dict, **extra) -> dict:
    """The hospitals' run config: the task's data, and deliberately another method than the strategy's."""
    return {**base, "run-name": "t", "state-dir": str(tmp_path / "state"), "results-dir": str(tmp_path / "results"),
            "strategy": "fedavg" if base is not SMALL_BRAIN else "fedmepd-local", **extra}


@pytest.mark.parametrize("strategy_type,base", CASES, ids=[c[0].__name__ for c in CASES])
def test_each_strategy_runs_its_own_method_and_aggregates_as_its_core_does(tmp_path, strategy_type, base):
    config = run_config(tmp_path, base)
    strategy = strategy_type(min_train_nodes=2, run_config=config)
    assert strategy.job.strategy == strategy_type.method_name  # the class names the method, not the run config
    grid = FakeGrid(simulated_hospitals(config, 2))
    result = strategy.start(grid, num_rounds=2)

    in_process = run_rounds(strategy.job.model_copy(update={"num_server_rounds": 2}),
                            simulated_sites(strategy.job, 2, tmp_path / "in-process"))
    assert [r["aggregated"] for r in strategy.engine.history] == [["hospital-00", "hospital-01"]] * 2
    final = arrays_of(result.arrays)
    assert set(final) == set(in_process.method.global_arrays)
    for name, value in in_process.method.global_arrays.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    metrics = result.train_metrics_clientapp[2]
    for hospital in ("hospital-00", "hospital-01"):
        assert metrics[f"bytes-up.{hospital}"] > 0 and metrics[f"bytes-down.{hospital}"] > 0
    assert metrics["hospitals-aggregated"] == 2 and metrics["hospitals-refused"] == 0


def test_method_state_is_in_the_result(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    result = FedProInStrategy(run_config=config).start(FakeGrid(simulated_hospitals(config, 2)), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    classes, per_class = 4, 2
    for hospital in ("hospital-00", "hospital-01"):
        influence = metrics[f"method.influence.{hospital}"]
        assert len(influence) == classes * per_class and sum(influence) > 0
    assert np.array_equal(metrics["method.prototype-usage"],
                          np.add(metrics["method.influence.hospital-00"], metrics["method.influence.hospital-01"]))

    polyp = run_config(tmp_path, SMALL_POLYP)
    result = QFedPolypStrategy(bit_widths="4,8", run_config=polyp).start(FakeGrid(simulated_hospitals(polyp, 2)),
                                                                        num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["method.bit-widths.hospital-00"] == 4 and metrics["method.bit-widths.hospital-01"] == 8
    assert metrics["bytes-up.hospital-01"] > 1.8 * metrics["bytes-up.hospital-00"]

    brain = run_config(tmp_path, SMALL_BRAIN)
    strategy = FedMEPDStrategy(warmup_rounds=0, patience=1, num_anchors=2, run_config=brain)
    grid = FakeGrid(simulated_hospitals(brain, 2))
    result = strategy.start(grid, num_rounds=2)
    metrics = result.train_metrics_clientapp[2]
    sizes = strategy.engine.method.personalisation.sizes
    for hospital in ("hospital-00", "hospital-01"):
        assert len(metrics[f"method.masks.{hospital}"]) == (sum(sizes.values()) + 7) // 8
        assert 0.0 <= metrics[f"method.personalised.{hospital}.all"] <= 1.0
        assert all(f"method.personalised.{hospital}.{layer}" in metrics for layer in sizes)
    assert metrics["method.server-train-loss"] > 0
    second_round = grid.sent_of_type(MessageType.TRAIN)[2:]
    recorded = strategy.engine.history[0]["method"]["masks"]
    for message, hospital in zip(second_round, ("hospital-00", "hospital-01")):  # the bytes each one received
        assert message.content["config"]["personal-mask"] == bytes(recorded[hospital])


def test_start_honours_its_arguments(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    strategy = FedAvgStrategy(fraction_evaluate=1.0, min_train_nodes=2, run_config=config)
    grid = FakeGrid(simulated_hospitals(config, 2))
    initial = {k: v * 0.5 if v.dtype.kind == "f" else v for k, v in arrays_of(strategy.initial_arrays()).items()}
    central_rounds = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        central_rounds.append(server_round)
        return MetricRecord({"norm": float(sum(np.square(a).sum() for a in arrays.to_numpy_ndarrays()))})

    # a user's state dict may carry BatchNorm's step counters, which stay local
    given = ArrayRecord({**{k: Array(v) for k, v in initial.items()}, "1.num_batches_tracked": Array(np.array(5))})
    result = strategy.start(grid, initial_arrays=given, num_rounds=1, timeout=30.0,
                            train_config=ConfigRecord({"local-epochs": 2, "note": "from the user"}),
                            evaluate_config=ConfigRecord({"note": "evaluate"}), evaluate_fn=central)
    train = grid.sent_of_type(MessageType.TRAIN)
    evaluate = grid.sent_of_type(MessageType.EVALUATE)
    assert len(train) == 2 and len(evaluate) == 2
    sent = from_recorddict(train[0].content).arrays["model"]
    for name, value in initial.items():  # the first round trains the given model
        np.testing.assert_array_equal(sent[name], value)
    assert train[0].content["config"]["local-epochs"] == 2 and train[0].content["config"]["note"] == "from the user"
    assert train[0].content["config"]["strategy"] == "fedavg" and train[0].content["config"]["server-round"] == 1
    assert evaluate[0].content["config"]["note"] == "evaluate"
    assert central_rounds == [0, 1] and sorted(result.evaluate_metrics_serverapp) == [0, 1]
    assert strategy.engine.history[-1]["central"]["norm"] == result.evaluate_metrics_serverapp[1]["norm"]
    assert 0.0 <= result.evaluate_metrics_clientapp[1]["accuracy"] <= 1.0
    assert len(strategy.engine.history) == 1 and strategy.job.round_timeout == 30.0


def test_every_message_layout_trains_the_same_model_and_auto_is_flat_in_our_own_loop(tmp_path):
    final, arrays_sent = {}, {}
    for layout in ("per-tensor", "flat", "packed", "auto"):
        config = run_config(tmp_path / layout, SMALL_CLASSIFICATION, **{"message-arrays": layout})
        grid = FakeGrid(simulated_hospitals(config, 2))
        result = FedProInStrategy(run_config=config).start(grid, num_rounds=2)
        final[layout] = arrays_of(result.arrays)
        sent = grid.sent_of_type(MessageType.TRAIN)[0]
        arrays_sent[layout] = sorted(sent.content["arrays"])
        replied = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN][0]
        assert sorted(replied.content["arrays"]) == arrays_sent[layout]  # the hospital answers in the same layout
    assert len(arrays_sent["per-tensor"]) > 10 and arrays_sent["packed"] == ["fedmed.npz"]
    assert arrays_sent["flat"] == arrays_sent["auto"] == ["fedmed.flat.float32.0"]
    for layout in ("flat", "packed", "auto"):
        for name, value in final["per-tensor"].items():
            np.testing.assert_array_equal(final[layout][name], value, err_msg=f"{layout}: {name}")


def test_a_hospital_applies_the_training_keys_the_server_sends(tmp_path):
    from common.config import hospital_job_config

    own = run_config(tmp_path, SMALL_CLASSIFICATION)
    cfg = hospital_job_config(own, {"strategy": "fedproin", "local-epochs": 2, "fedproin.fdl-weight": 0.5,
                                    "image-size": 32, "state-dir": "/elsewhere", "qfedpolyp.bit-width": 4, "note": "x"})
    assert (cfg.strategy, cfg.local_epochs, cfg.fedproin.fdl_weight) == ("fedproin", 2, 0.5)
    assert cfg.image_size == 32  # the server's model, as its ServerApp set it
    assert cfg.state_dir == own["state-dir"]  # where the hospital writes stays its own


def test_hospital_restarted_under_a_new_node_id_is_recognised_by_name(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    nodes = simulated_hospitals(config, 3)
    grid = FakeGrid(nodes)
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    strategy.start(grid, num_rounds=1)
    grid.nodes = {node: handler for node, handler in nodes.items() if node != 101}
    grid.nodes[777] = hospital_node(config, {"partition-id": 0, "num-partitions": 3}, 777)
    strategy.start(grid, num_rounds=2)
    assert strategy.hospitals[777].name == "hospital-00" and 101 not in strategy.hospitals
    last = strategy.engine.history[-1]
    assert last["round"] == 2 and "hospital-00" in last["aggregated"] and not last["missing"]
    assert grid.sent_of_type(MessageType.TRAIN)[-3].metadata.dst_node_id == 777


class LeavesAfterRoundOne(FakeGrid):
    """hospital-02's node is gone from the SuperLink's list after round 1 and back (a new node, as a restarted
    SuperNode) after ``away`` more looks at the list."""

    def __init__(self, nodes, config, away: int):
        super().__init__(nodes)
        self.config, self.away, self.looks = config, away, 0

    def get_node_ids(self):
        if self.sent_of_type(MessageType.TRAIN) and 103 in self.nodes:
            del self.nodes[103]
        if 103 not in self.nodes and 777 not in self.nodes:
            self.looks += 1
            if self.looks > self.away:
                self.nodes[777] = hospital_node(self.config, {"partition-id": 2, "num-partitions": 3}, 777)
        return super().get_node_ids()


@pytest.mark.parametrize("timeout,back_in_round_2", [(30.0, True), (1.0, False)])
def test_a_later_round_waits_up_to_the_round_timeout_for_min_available_hospitals(tmp_path, timeout, back_in_round_2):
    """As Flower's strategies wait for ``min_available_nodes`` before each round, round 2 waits for the third hospital
    while it restarts (here two looks at the list, 2 s apart) if the round timeout allows, and goes on with the two
    that are connected when it does not: a hospital that left is not written off at once, and a consortium that
    lost one for good still trains."""
    config = run_config(tmp_path, SMALL_CLASSIFICATION, **{"round-timeout": timeout})
    grid = LeavesAfterRoundOne(simulated_hospitals(config, 3), config, away=2)
    strategy = FedAvgStrategy(min_train_nodes=2, min_available_nodes=3, run_config=config)
    strategy.start(grid, num_rounds=2)
    second = strategy.engine.history[1]
    expected = ["hospital-00", "hospital-01", "hospital-02"] if back_in_round_2 else ["hospital-00", "hospital-01"]
    assert sorted(second["aggregated"]) == expected and not second["missing"]

def reply_with(content: RecordDict | Error):
    def answer(message: Message) -> Message:
        return Message(content, reply_to=message)
    return answer


def test_unknown_failing_malformed_and_silent_nodes(tmp_path, caplog):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    nodes = simulated_hospitals(config, 5)
    honest = {node: nodes[node] for node in (101, 102)}

    def impostor(message: Message) -> Message | None:  # answers as a node the server never met
        if message.metadata.message_type == MessageType.QUERY:
            return nodes[103](message)
        reply = nodes[103](message)
        reply.metadata.__dict__["_src_node_id"] = 999
        return reply

    def silent(message: Message) -> Message | None:
        return nodes[105](message) if message.metadata.message_type == MessageType.QUERY else None

    def failing(message: Message) -> Message:
        if message.metadata.message_type == MessageType.QUERY:
            return nodes[104](message)
        return Message(Error(code=1, reason="hospital-03: images/x.jpg cannot be read"), reply_to=message)

    def malformed(message: Message) -> Message:
        if message.metadata.message_type == MessageType.QUERY:
            return hospital_node(config, {"partition-id": 5, "num-partitions": 6}, 106)(message)
        return Message(RecordDict({"weights": ConfigRecord({"w": 1})}), reply_to=message)

    grid = FakeGrid({**honest, 103: impostor, 104: failing, 105: silent, 106: malformed})
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    with caplog.at_level("WARNING", logger="fedmed"):
        result = strategy.start(grid, num_rounds=1, timeout=1.0)
    record = strategy.engine.history[0]
    assert record["aggregated"] == ["hospital-00", "hospital-01"]
    assert "which was not asked to train, ignored" in caplog.text
    assert "images/x.jpg cannot be read" in record["refused"]["hospital-03"]
    assert "malformed reply: unexpected ConfigRecord 'weights'" in record["refused"]["hospital-05"]
    assert sorted(record["missing"]) == ["hospital-02", "hospital-04"]
    assert result.train_metrics_clientapp[1]["hospitals-missing"] == 2
    assert result.train_metrics_clientapp[1]["hospitals-refused"] == 2


def test_a_node_slow_to_say_who_it_is_is_asked_again_next_round(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    nodes = simulated_hospitals(config, 3)
    queries = []

    def slow(message: Message) -> Message | None:  # its first identity reply does not come in time
        if message.metadata.message_type == MessageType.QUERY:
            queries.append(message)
            if len(queries) == 1:
                return None
        return nodes[103](message)

    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    strategy.start(FakeGrid({101: nodes[101], 102: nodes[102], 103: slow}), num_rounds=2, timeout=1.0)
    first, second = strategy.engine.history
    assert first["aggregated"] == ["hospital-00", "hospital-01"]
    assert second["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"] and len(queries) >= 2


def test_identity_replies_without_a_usable_name_are_skipped(tmp_path, caplog):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    nodes = simulated_hospitals(config, 2)
    nameless = reply_with(RecordDict({"hospital": ConfigRecord({"num-examples": "abc"})}))
    grid = FakeGrid({**nodes, 300: nameless})
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    with caplog.at_level("WARNING", logger="fedmed"):
        strategy.start(grid, num_rounds=1)
    assert 300 not in strategy.hospitals and "node 300 gave no usable identity" in caplog.text
    assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01"]


def test_own_arguments_come_from_the_methods_settings_and_are_validated():
    from common.methods.registry import load, methods

    defaults = JobConfig()
    for spec in methods().values():
        strategy_type = load(spec.strategy)
        assert strategy_type.method_name == spec.name
        if spec.settings is None:
            assert strategy_type.own_arguments() == {}
            continue
        assert strategy_type.settings_type is load(spec.settings) and strategy_type.section == spec.section
        section = getattr(defaults, strategy_type.section)
        for argument, default in strategy_type.argument_defaults().items():  # the run config's defaults, one source
            assert default == getattr(section, strategy_type.own_arguments()[argument]), (spec.name, argument)
            assert getattr(strategy_type(), argument) == default  # an attribute, as Flower's FedProx.proximal_mu
    fedprox = FedProxStrategy(proximal_mu=0.3)
    assert fedprox.job.fedprox.mu == 0.3 and fedprox.proximal_mu == 0.3
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_prototype'"):
        FedProInStrategy(num_prototype=3)
    with pytest.raises(ConfigError, match="fedproin.num-prototypes"):
        FedProInStrategy(num_prototypes=9)
    with pytest.raises(ConfigError, match="does not support task"):
        FedProInStrategy(run_config={"task": "polyp-segmentation"})


def test_fedmeds_server_app_builds_the_strategy_from_the_validated_run_config():
    cfg = load_job_config({"strategy": "fedproin", "fraction-train": 0.3, "fedproin.fdl-weight": 0.25, "run-name": "x"})
    strategy = FedProInStrategy(**strategies.strategy_arguments(FedProInStrategy, cfg))
    assert strategy.job == cfg


def update_norm(after: dict, before: dict) -> float:
    return float(np.sqrt(sum(np.square(after[k].astype(np.float64) - before[k]).sum() for k in before)))


@pytest.mark.parametrize("strategy_type", [FedAvgStrategy, FedProInStrategy])
def test_flowers_central_dp_wrapper_clips_our_updates(tmp_path, strategy_type):
    config = run_config(tmp_path, SMALL_CLASSIFICATION, **{"learning-rate": 0.01})
    nodes = simulated_hospitals(config, 2)
    raw_updates = []

    def recorded(handler):
        def answer(message: Message) -> Message:
            reply = handler(message)
            if message.metadata.message_type == MessageType.TRAIN:
                raw_updates.append(update_norm(arrays_of(reply.content["arrays"]),
                                               arrays_of(message.content["arrays"])))
            return reply
        return answer

    clip = 0.05
    strategy = strategy_type(min_train_nodes=2, run_config=config)
    wrapped = DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier=0.0, clipping_norm=clip,
                                                        num_sampled_clients=2)
    initial = strategy.initial_arrays()
    grid = FakeGrid({node: recorded(handler) for node, handler in nodes.items()})
    result = wrapped.start(grid, initial_arrays=initial, num_rounds=2)
    sent = [arrays_of(m.content["arrays"]) for m in grid.sent_of_type(MessageType.TRAIN)]
    global_models = [sent[0], sent[2], arrays_of(result.arrays)]
    steps = [update_norm(global_models[i + 1], global_models[i]) for i in range(2)]
    assert len(raw_updates) == 4 and min(raw_updates) > 4 * clip  # the hospitals' own updates are far larger
    assert all(0.2 * clip < step <= clip * (1 + 1e-5) for step in steps)  # the aggregate of clipped updates
    assert [r["aggregated"] for r in strategy.engine.history] == [["hospital-00", "hospital-01"]] * 2


class ReversedGrid(FakeGrid):
    """Replies come back in the reverse order, as when another hospital happens to finish first."""

    def pull_messages(self, message_ids):
        return list(reversed(list(super().pull_messages(message_ids))))


def test_two_identical_runs_end_with_identical_models_whatever_order_replies_arrive_in(tmp_path):
    finals = []
    for grid_type in (FakeGrid, ReversedGrid):
        config = run_config(tmp_path / grid_type.__name__, SMALL_CLASSIFICATION)
        strategy = FedAvgStrategy(min_train_nodes=3, min_available_nodes=3, run_config=config)
        finals.append(arrays_of(strategy.start(grid_type(simulated_hospitals(config, 3)), num_rounds=2).arrays))
    assert finals[0].keys() == finals[1].keys()
    for name, value in finals[0].items():
        assert np.array_equal(value, finals[1][name]), name


class CountingGrid(FakeGrid):
    """Counts how many pushed messages are still unanswered at once (their replies not yet pulled)."""

    def __init__(self, nodes):
        super().__init__(nodes)
        self.pending: set[str] = set()
        self.most_pending = 0

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        self.pending |= set(ids)
        self.most_pending = max(self.most_pending, len(self.pending))
        return ids

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        self.pending -= {m.metadata.reply_to_message_id for m in replies}
        return replies


def test_messages_in_flight_keeps_at_most_that_many_pending_and_changes_nothing_else(tmp_path):
    finals, most = [], []
    for in_flight in (0, 2):
        config = {**run_config(tmp_path / str(in_flight), SMALL_CLASSIFICATION), "messages-in-flight": in_flight}
        strategy = FedAvgStrategy(min_train_nodes=5, min_available_nodes=5, run_config=config)
        grid = CountingGrid(simulated_hospitals(config, 5))
        finals.append(arrays_of(strategy.start(grid, num_rounds=2).arrays))
        most.append(grid.most_pending)
        assert [r["aggregated"] for r in strategy.engine.history] == [[f"hospital-{i:02d}" for i in range(5)]] * 2
    assert most == [5, 2]  # identity queries and training messages alike
    for name, value in finals[0].items():
        assert np.array_equal(value, finals[1][name]), name


def test_simulation_engine_gets_a_window_and_a_deployment_all_messages_at_once():
    from flwr.superlink.grid import InMemoryGrid

    from strategies.grid_messages import SIMULATION_IN_FLIGHT, SIMULATION_QUERIES_IN_FLIGHT, messages_in_flight

    job = JobConfig()
    simulation = InMemoryGrid.__new__(InMemoryGrid)  # only its type matters here
    assert messages_in_flight(job, simulation) == SIMULATION_IN_FLIGHT
    assert messages_in_flight(job, simulation, queries=True) == SIMULATION_QUERIES_IN_FLIGHT > SIMULATION_IN_FLIGHT
    assert messages_in_flight(job, FakeGrid({})) == messages_in_flight(job, FakeGrid({}), queries=True) == 0
    assert messages_in_flight(job.model_copy(update={"messages_in_flight": 7}), simulation) == 7


class StoppedMidRoundGrid(FakeGrid):
    """As Flower's SuperLink when ``flwr stop`` lands in round ``stop_in``: it deletes the run's messages, so the
    replies still pending come back as its own MESSAGE_UNAVAILABLE errors, and every later call of this
    ServerApp is refused (``stopped=False``: only the messages are lost, the run goes on)."""

    def __init__(self, nodes, stop_in: int, stopped: bool = True):
        super().__init__(nodes)
        self.stop_in, self.stopped, self.trains = stop_in, stopped, 0
        self.cut_off = False

    def push_messages(self, messages):
        messages = list(messages)
        self.trains += any(m.metadata.message_type == MessageType.TRAIN for m in messages)
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_ins_message

        if self.trains != self.stop_in or self.cut_off:
            return super().pull_messages(message_ids)
        self.cut_off = True  # the first hospital's reply was in before the stop, the others' are lost with it
        node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in self.sent}
        first, *lost = sorted(message_ids, key=node_of.get)
        replies = list(super().pull_messages([first]))
        return replies + [create_message_error_unavailable_ins_message(mid, 1) for mid in lost]

    def get_node_ids(self):
        if self.cut_off and self.stopped:
            raise RuntimeError("401 Unauthorized: Runtime task-token authentication failed.")
        return super().get_node_ids()


@pytest.mark.parametrize("stopped", [True, False], ids=["run-stopped", "messages-lost-run-on"])
def test_a_round_cut_short_by_a_stop_is_never_saved_and_one_that_only_lost_a_hospital_is(tmp_path, stopped):
    from strategies.base import RunStopped

    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    saved = []
    strategy = FedAvgStrategy(min_train_nodes=1, run_config=config,
                              on_round_end=lambda engine, record: saved.append(record["round"]))
    grid = StoppedMidRoundGrid(simulated_hospitals(config, 2), stop_in=2, stopped=stopped)
    if stopped:
        with pytest.raises(RunStopped, match=r"round 2 ended without hospital-01 .* not saved, so a resume repeats"):
            strategy.start(grid, num_rounds=3)
        assert saved == [1]  # the checkpoint a resume continues from is round 1's, whole
    else:  # a hospital lost in transit while the run is on: the round goes on without it and is saved
        strategy.start(grid, num_rounds=3)
        assert saved == [1, 2, 3]
        assert strategy.engine.history[1]["missing"] == ["hospital-01"]
        assert strategy.engine.history[1]["aggregated"] == ["hospital-00"]
