"""Our strategies behave as Flower's do (``flwr.serverapp.strategy``), on a fake Grid: a subclass with arguments of
its own works; what ``configure_train`` is given is the current global model and what ``aggregate_train`` returns
(a subclass's change, a DP wrapper's noise) is the next one, the one scored, saved and sent; ``(None, None)`` when
nothing was accepted; the server's test metrics in ``evaluate_metrics_serverapp``; Flower's attributes; settings
given in Python reach the hospitals; a run that aggregated nobody returns a Result that says why."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)

from common.config import ConfigError
from common.engine.wire import from_recorddict
from common.methods.registry import load, methods
from server_app.app import RoundSaver
from server_app.checkpoint import checkpoint_dir, read_checkpoint
from strategies import FedAvgStrategy, FedProInStrategy, QFedPolypStrategy
from strategies.base import HospitalStrategy
from strategies.records import arrays_of
from strategies.secure_aggregation import with_secure_aggregation

from .fake_grid import FakeGrid, simulated_hospitals
from .test_strategies import SMALL_CLASSIFICATION, SMALL_POLYP, run_config

pytestmark = pytest.mark.usefixtures("one_thread")


class HalvingFedProIn(FedProInStrategy):
    """A user's subclass: an argument of its own, and an aggregate_train that changes the next global model."""

    def __init__(self, shrink: float, **kwargs):
        super().__init__(**kwargs)
        self.shrink = shrink
        self.given: list[dict[str, np.ndarray]] = []

    def configure_train(self, server_round, arrays, config, grid):
        self.given.append(arrays_of(arrays))
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        return ArrayRecord({k: Array(v * self.shrink if v.dtype.kind == "f" else v)
                            for k, v in arrays_of(arrays).items()}), metrics


def sent_models(grid: FakeGrid) -> list[dict[str, np.ndarray]]:
    return [from_recorddict(m.content).arrays["model"] for m in grid.sent_of_type(MessageType.TRAIN)]


def test_a_subclass_with_its_own_argument_decides_the_next_global_model(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    saved = []
    strategy = HalvingFedProIn(shrink=0.5, num_prototypes=3, run_config=config,
                               on_round_end=lambda engine, record: saved.append(
                                   {k: v.copy() for k, v in engine.method.global_arrays.items()}))
    assert strategy.shrink == 0.5 and strategy.num_prototypes == 3
    grid = FakeGrid(simulated_hospitals(config, 2))
    initial = strategy.initial_arrays()
    scored = []
    evaluate = strategy.engine.method.evaluate
    strategy.engine.method.evaluate = lambda test: scored.append(dict(strategy.engine.method.global_arrays)) or \
        evaluate(test)
    result = strategy.start(grid, initial_arrays=initial, num_rounds=2)

    after_round_1 = saved[0]
    assert strategy.given[1].keys() == after_round_1.keys()
    for name, value in after_round_1.items():  # configure_train of round 2 is given round 1's released model ...
        np.testing.assert_array_equal(strategy.given[1][name], value)
        np.testing.assert_array_equal(sent_models(grid)[2][name], value)  # ... and that is what hospitals get
    assert strategy.given[0]["prototypes"].shape[1] == 3  # round 1 is given the initial model, not an empty record
    final = arrays_of(result.arrays)
    for name, value in saved[1].items():  # the checkpointed model is the one the subclass returned
        np.testing.assert_array_equal(final[name], value)
    assert len(scored) == 2
    for rnd in (0, 1):  # each round's test metrics are of the model the subclass returned
        for name, value in saved[rnd].items():
            np.testing.assert_array_equal(scored[rnd][name], value)


def test_under_flowers_dp_wrapper_the_noised_model_is_the_one_scored_and_saved(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    saved = []
    strategy = FedAvgStrategy(run_config=config, on_round_end=lambda engine, record: saved.append(
        ({k: v.copy() for k, v in engine.method.global_arrays.items()}, dict(record.get("test", {})))))
    wrapped = DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier=5.0, clipping_norm=0.5,
                                                        num_sampled_clients=2)
    grid = FakeGrid(simulated_hospitals(config, 2))
    result = wrapped.start(grid, initial_arrays=strategy.initial_arrays(), num_rounds=2,
                           evaluate_fn=strategy.test_metrics)
    released = arrays_of(result.arrays)
    checkpointed, test = saved[-1]
    for name, value in released.items():  # the checkpoint holds the released (noised) model
        np.testing.assert_array_equal(checkpointed[name], value)
    second = sent_models(grid)[2]
    for name, value in saved[0][0].items():  # and round 2 trained the noised model of round 1
        np.testing.assert_array_equal(second[name], value)
    assert result.evaluate_metrics_serverapp[2]["accuracy"] == test["accuracy"]
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]


def failing(message: Message) -> Message:
    if message.metadata.message_type == MessageType.TRAIN:
        return Message(Error(code=1, reason="disk full"), reply_to=message)
    return None


def test_nothing_accepted_is_none_none_and_a_run_that_aggregated_nobody_returns_a_result_saying_why(tmp_path, caplog):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    nodes = simulated_hospitals(config, 2)
    answers = {node: (lambda message, handler=handler: failing(message) if message.metadata.message_type
                      == MessageType.TRAIN else handler(message)) for node, handler in nodes.items()}
    strategy = FedAvgStrategy(run_config=config)
    before = arrays_of(strategy.initial_arrays())
    grid = FakeGrid(answers)
    list(strategy.configure_train(1, strategy.initial_arrays(), None, grid))
    replies = grid.pull_messages([m.metadata.message_id for m in grid.sent_of_type(MessageType.TRAIN)])
    assert strategy.aggregate_train(1, replies) == (None, None)
    for name, value in before.items():
        np.testing.assert_array_equal(strategy.engine.method.global_arrays[name], value)

    strategy = FedAvgStrategy(run_config=config)  # as Flower's start(): a Result without arrays (only an aggregate's)
    result = strategy.start(FakeGrid(answers), num_rounds=2)
    flowers = Strategy.start(FedAvgStrategy(run_config={**config, "run-name": "flowers"}), FakeGrid(answers),
                             initial_arrays=strategy.initial_arrays(), num_rounds=2)
    assert len(result.arrays) == len(flowers.arrays) == 0 and not result.train_metrics_clientapp
    assert re.search("no round of 1..2 aggregated any hospital: .*hospital-00 refused .*disk full",
                     strategy.nothing_aggregated)
    logged = [r for r in caplog.records if r.levelname == "ERROR" and "aggregated any hospital" in r.getMessage()]
    assert logged and "the Result holds no arrays, as Flower's" in logged[0].getMessage()
    audit = [json.loads(line) for line in (strategy.job.run_dir / "audit.jsonl").read_text().splitlines()]
    [outcome] = [line for line in audit if line["event"] == "run"]
    assert outcome["outcome"] == "nothing aggregated" and "disk full" in outcome["reason"]


def test_server_test_metrics_flowers_attributes_and_fraction_zero(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    strategy = FedAvgStrategy(fraction_train=0.0, min_train_nodes=2, min_available_nodes=3, run_config=config)
    assert (strategy.fraction_train, strategy.min_train_nodes, strategy.min_available_nodes) == (0.0, 2, 3)
    assert (strategy.weighted_by_key, strategy.arrayrecord_key, strategy.configrecord_key) == (
        "num-examples", "arrays", "config")
    grid = FakeGrid(simulated_hospitals(config, 3))
    result = strategy.start(grid, num_rounds=2)
    assert [len(r["chosen"]) for r in strategy.engine.history] == [2, 2]  # fraction 0: min_train_nodes of 3
    for rnd in (1, 2):
        assert result.evaluate_metrics_serverapp[rnd]["accuracy"] == strategy.engine.history[rnd - 1]["test"][
            "accuracy"]
        assert "test.accuracy" not in result.train_metrics_clientapp[rnd]  # the server's metrics are not clients'


def test_record_names_weighting_key_and_metric_aggregation_are_flowers(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    seen = []

    def total_samples(records, weighting_key):
        seen.append(weighting_key)
        return {"samples": sum(r["metrics"][weighting_key] for r in records)}

    strategy = FedAvgStrategy(arrayrecord_key="weights", configrecord_key="settings", weighted_by_key="n",
                              train_metrics_aggr_fn=total_samples, run_config=config)
    grid = FakeGrid(simulated_hospitals(config, 2))
    result = strategy.start(grid, num_rounds=1)
    message = grid.sent_of_type(MessageType.TRAIN)[0]
    assert "weights" in message.content.array_records and "settings" in message.content.config_records
    reply = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN][0]
    assert "weights" in reply.content.array_records and reply.content["metrics"]["n"] > 0
    assert seen == ["n"] and result.train_metrics_clientapp[1]["samples"] == sum(
        strategy.hospitals[node].num_examples for node in strategy.hospitals)


def test_settings_given_in_python_reach_the_hospitals(tmp_path):
    hospitals_config = run_config(tmp_path, SMALL_CLASSIFICATION)  # what the hospitals' run config says
    polyp = {k: v for k, v in run_config(tmp_path, SMALL_POLYP).items() if k != "strategy"}
    strategy = QFedPolypStrategy(bit_widths="4", run_config=polyp)  # the task is chosen in Python only
    grid = FakeGrid(simulated_hospitals(hospitals_config, 2))
    strategy.start(grid, num_rounds=1)
    assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    assert "dice" in strategy.engine.history[0]["test"]


def test_hospitals_that_refuse_the_job_stop_the_run_before_round_1(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    strategy = FedAvgStrategy(run_config=config)
    grid = FakeGrid(simulated_hospitals(config, 2, **{"data-dir": str(tmp_path / "missing")}))
    with pytest.raises(ConfigError, match="round 1 cannot start: 0 hospital.*node 101: .*missing.*does not exist"):
        list(strategy.configure_train(1, strategy.initial_arrays(), None, grid))
    assert not grid.sent_of_type(MessageType.TRAIN)


def test_a_whole_flower_run_config_is_accepted_and_a_misspelt_key_of_ours_is_not(tmp_path, caplog):
    config = {**run_config(tmp_path, SMALL_CLASSIFICATION), "lr": 0.1, "result-file": "x.json"}
    with caplog.at_level("INFO", logger="fedmed"):
        strategy = FedProInStrategy(run_config=config)
    assert strategy.job.image_size == 16 and "left to the app: lr, result-file" in caplog.text
    with pytest.raises(ConfigError, match="'num-server-round'.*did you mean 'num-server-rounds'"):
        FedProInStrategy(run_config={**config, "num-server-round": 3})
    with pytest.raises(ConfigError, match="'fedproin.num-prototype'"):
        FedProInStrategy(run_config={**config, "fedproin.num-prototype": 3})


class DecliningFedAvg(FedAvgStrategy):
    """A user's aggregate_train that returns ``(None, None)`` in the rounds ``decline`` (Flower's way to skip a round),
    after calling ours through super() or without it."""

    def __init__(self, decline: int, after_ours: bool, **kwargs):
        super().__init__(**kwargs)
        self.decline, self.after_ours = decline, after_ours
        self.given: dict[int, dict[str, np.ndarray]] = {}

    def configure_train(self, server_round, arrays, config, grid):
        self.given[server_round] = arrays_of(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        if server_round != self.decline:
            return super().aggregate_train(server_round, replies)
        if self.after_ours:
            super().aggregate_train(server_round, replies)
        return None, None


def assert_same_model(actual, expected, what):
    assert set(expected) <= set(actual), what
    for name, value in expected.items():
        np.testing.assert_array_equal(actual[name], value, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("after_ours", [True, False], ids=["after-ours", "without-ours"])
@pytest.mark.parametrize("declined", [1, 3])
@pytest.mark.parametrize("loop", ["ours", "flowers"])
def test_none_from_aggregate_train_in_any_round_keeps_the_previous_model_and_the_run_goes_on(tmp_path, loop, declined,
                                                                                            after_ours):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    strategy = DecliningFedAvg(declined, after_ours, run_config=config, on_round_end=RoundSaver(plot_interval=1e9))
    grid = FakeGrid(simulated_hospitals(config, 2))
    scored = {}

    def evaluate_fn(server_round, arrays):
        scored[server_round] = arrays_of(arrays)
        return None

    initial = strategy.initial_arrays()
    start = strategy.start if loop == "ours" else functools.partial(Strategy.start, strategy)  # Flower's own loop
    result = start(grid, initial_arrays=initial, num_rounds=3, evaluate_fn=evaluate_fn)

    run_dir = strategy.job.run_dir
    saved = {}
    for rnd in (1, 2, 3):
        state = read_checkpoint(checkpoint_dir(run_dir) / f"round-{rnd:05d}.npz")
        saved[rnd] = {k.removeprefix("method/global/"): v for k, v in state.items() if k.startswith("method/global/")}
    previous = arrays_of(initial) if declined == 1 else saved[declined - 1]
    assert_same_model(saved[declined], previous, "the checkpoint of the declined round")
    assert_same_model(scored[declined], previous, "what evaluate_fn scored after the declined round")
    if declined < 3:
        assert_same_model(strategy.given[declined + 1], previous, "configure_train of the next round")
        for sent in sent_models(grid)[2 * declined:2 * declined + 2]:
            assert_same_model(sent, previous, "what the hospitals trained next")
    else:
        assert_same_model(arrays_of(result.arrays), previous, "Result.arrays")
    if declined == 1:  # the run went on: round 2 trained from the kept model and changed it
        assert not all(np.array_equal(saved[2][k], v) for k, v in previous.items())

    history = strategy.engine.history
    assert [r["round"] for r in history] == [1, 2, 3]
    skipped = history[declined - 1]
    assert "DecliningFedAvg.aggregate_train returned no arrays" in skipped["skipped"] and skipped["aggregated"] == []
    kept = "initial global model is kept" if declined == 1 else "global model of round 2 is kept"
    assert kept in skipped["skipped"]
    assert skipped.get("discarded", []) == (["hospital-00", "hospital-01"] if after_ours else [])
    others = [r for r in history if r["round"] != declined]
    assert all(r["aggregated"] == ["hospital-00", "hospital-01"] and "skipped" not in r for r in others)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[declined - 1]["skipped"] == skipped["skipped"]  # the run's own history says why


FLOWERS_ARGUMENTS = [name for name in inspect.signature(FedAvg.__init__).parameters if name != "self"]


def test_flowers_fedavg_arguments_come_first_in_its_order_so_they_may_be_positional():
    ours = [p for name, p in inspect.signature(HospitalStrategy.__init__).parameters.items() if name != "self"]
    assert [p.name for p in ours[:len(FLOWERS_ARGUMENTS)]] == FLOWERS_ARGUMENTS
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in ours[:len(FLOWERS_ARGUMENTS)])
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in ours[len(FLOWERS_ARGUMENTS):])


@pytest.mark.parametrize("spec", sorted(methods().values(), key=lambda s: s.name), ids=lambda s: s.name)
def test_every_strategy_takes_flowers_arguments_by_position_and_its_own_by_keyword(spec):
    def total(records, key):
        return None

    strategy_type = load(spec.strategy)
    assert FedAvg(0.5).fraction_train == 0.5
    strategy = strategy_type(0.5)  # as FedAvg(0.5)
    assert strategy.fraction_train == 0.5
    strategy = strategy_type(0.25, 0.5, 3, 2, 4, "n", "weights", "settings", total, total)
    assert (strategy.fraction_train, strategy.fraction_evaluate, strategy.min_train_nodes, strategy.min_evaluate_nodes,
            strategy.min_available_nodes, strategy.weighted_by_key, strategy.arrayrecord_key,
            strategy.configrecord_key) == (0.25, 0.5, 3, 2, 4, "n", "weights", "settings")
    assert strategy.train_metrics_aggr_fn is total and strategy.evaluate_metrics_aggr_fn is total
    assert strategy.job.strategy == spec.name
    with pytest.raises(TypeError, match="positional"):  # the method's own arguments are keyword-only
        strategy_type(0.25, 0.5, 3, 2, 4, "n", "weights", "settings", total, total, 1.0)
    own = strategy_type.argument_defaults()
    if own:  # and still work by keyword, beside positional ones
        name, default = next(iter(own.items()))
        assert getattr(strategy_type(0.5, **{name: default}), name) == default


DP_WRAPPERS = {
    "server-fixed": lambda strategy: DifferentialPrivacyServerSideFixedClipping(strategy, 1.0, 0.5, 2),
    "client-fixed": lambda strategy: DifferentialPrivacyClientSideFixedClipping(strategy, 1.0, 0.5, 2),
    "server-adaptive": lambda strategy: DifferentialPrivacyServerSideAdaptiveClipping(strategy, 0.05, 2),
    "client-adaptive": lambda strategy: DifferentialPrivacyClientSideAdaptiveClipping(strategy, 0.05, 2),
}
UNFIT_FOR_DP = {"qfedpolyp": "quantised codes", "fedbn": "normalisation layers", "fedproto": "prototypes",
                "fedmepd": "encoders of its own modalities", "fedmepd-federated-decoder": "encoders of its own",
                "fedmepd-local": "trains alone"}


def silent_hospitals() -> FakeGrid:
    return FakeGrid({101: lambda message: None, 102: lambda message: None})


@pytest.mark.parametrize("wrap", DP_WRAPPERS)
@pytest.mark.parametrize("method", UNFIT_FOR_DP)
def test_flowers_dp_wrappers_refuse_a_method_they_cannot_clip_before_anything_is_sent(wrap, method):
    strategy = load(methods()[method].strategy)()
    wrapped = DP_WRAPPERS[wrap](strategy)
    grid = silent_hospitals()
    refusal = f"{type(wrapped).__name__} cannot wrap {type(strategy).__name__} \\(method '{method}'\\): .*" + \
        UNFIT_FOR_DP[method]
    with pytest.raises(ConfigError, match=refusal):  # Flower's loop: at its first step, before evaluate_fn and round 1
        wrapped.start(grid, initial_arrays=ArrayRecord(), num_rounds=1, evaluate_fn=lambda rnd, arrays: pytest.fail())
    with pytest.raises(ConfigError, match=refusal):  # a wrapper driven by hand: at round 1's configure_train
        wrapped.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
    assert grid.sent == []


@pytest.mark.parametrize("wrap", DP_WRAPPERS)
@pytest.mark.parametrize("how", ["run-config", "mixin"])
def test_flowers_dp_wrappers_refuse_a_strategy_with_secure_aggregation(wrap, how):
    strategy = (FedAvgStrategy(run_config={"secure-aggregation.enabled": True}) if how == "run-config"
                else with_secure_aggregation(FedProInStrategy)())
    wrapped = DP_WRAPPERS[wrap](strategy)
    grid = silent_hospitals()
    with pytest.raises(ConfigError, match=f"{type(wrapped).__name__} cannot wrap .* with secure aggregation .*masked"):
        wrapped.start(grid, initial_arrays=ArrayRecord(), num_rounds=1)
    assert grid.sent == []


@pytest.mark.parametrize("wrap", DP_WRAPPERS)
def test_flowers_dp_wrappers_still_take_the_methods_whose_reply_is_the_model(wrap, caplog):
    fit = sorted(name for name, spec in methods().items() if not spec.not_for_central_dp)
    assert fit and set(fit).isdisjoint(UNFIT_FOR_DP)
    for method in fit:
        strategy = load(methods()[method].strategy)()
        with caplog.at_level("WARNING", logger="fedmed"):
            DP_WRAPPERS[wrap](strategy).summary()  # what Flower's loop calls first: no refusal
        assert ("fedmed's own ClientApp does not install it" in caplog.text) == wrap.startswith("client")
        caplog.clear()


def test_a_round_the_dp_wrapper_declines_is_recorded_and_the_run_goes_on(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    nodes = simulated_hospitals(config, 2)
    calls = []

    def fails_once(message):
        calls.append(message.metadata.message_type)
        return failing(message) if calls.count(MessageType.TRAIN) == 1 else nodes[102](message)

    strategy = FedAvgStrategy(run_config=config)
    wrapped = DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier=0.0, clipping_norm=10.0,
                                                        num_sampled_clients=2)
    initial = strategy.initial_arrays()
    result = wrapped.start(FakeGrid({101: nodes[101], 102: fails_once}), initial_arrays=initial, num_rounds=2)
    first, second = strategy.engine.history
    assert "never reached fedmed's aggregate_train" in first["skipped"] and first["aggregated"] == []
    assert "initial global model is kept" in first["skipped"]
    assert second["aggregated"] == ["hospital-00", "hospital-01"]
    assert not all(np.array_equal(arrays_of(result.arrays)[k], v) for k, v in arrays_of(initial).items())


@pytest.fixture
def fedmed_logger_kept():
    """fedmed's ServerApp gives the 'fedmed' logger a handler of its own and stops propagation (as a process of its
    own should); in-process, the logger is put back as it was for the tests after."""
    logger = logging.getLogger("fedmed")
    before = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate = before[0], before[1]
    logger.setLevel(before[2])


def test_fedmeds_own_serverapp_still_fails_a_run_that_aggregated_nobody(tmp_path, fedmed_logger_kept):
    from server_app.app import main
    from strategies.base import NoHospitalAggregated

    config = {**run_config(tmp_path, SMALL_CLASSIFICATION), "num-server-rounds": 1}
    nodes = simulated_hospitals(config, 2)
    answers = {node: (lambda message, handler=handler: failing(message) if message.metadata.message_type
                      == MessageType.TRAIN else handler(message)) for node, handler in nodes.items()}
    server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(config))
    with pytest.raises(NoHospitalAggregated, match="hospital-00 refused .*disk full"):
        main(FakeGrid(answers), server)
    assert json.loads((tmp_path / "results" / "t" / "status.json").read_text())["status"] == "failed"


def test_fedmeds_serverapp_serves_a_clientapp_that_reads_run_config_keys_of_its_own(tmp_path, fedmed_logger_kept):
    from client_app.api import Hospital
    from server_app.app import main

    config = {**run_config(tmp_path, SMALL_CLASSIFICATION), "num-server-rounds": 1, "mode": "strict", "lr": 0.1,
              "seeds": "1,2", "myapp.threshold": 0.5}
    seen = []

    def users_clientapp(node_id: int, partition: int):  # the hospitals' own ClientApp: a key of its own, our API
        context = Context(run_id=1, node_id=node_id, node_config={"partition-id": partition, "num-partitions": 2},
                          state=RecordDict(), run_config=dict(config))

        def answer(message: Message) -> Message:
            seen.append((context.run_config["mode"], context.run_config["myapp.threshold"]))
            return Hospital(context).answer(message)
        return answer

    grid = FakeGrid({101: users_clientapp(101, 0), 102: users_clientapp(102, 1)})
    server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(config))
    main(grid, server)
    run_dir = tmp_path / "results" / "t"
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds[0]["aggregated"] == ["hospital-00", "hospital-01"]
    assert seen and set(seen) == {("strict", 0.5)}  # every message reached a hospital whose app read its own keys
    assert "mode" not in json.loads((run_dir / "config.json").read_text())  # fedmed's run record: fedmed's keys

    grid = FakeGrid({101: users_clientapp(101, 0), 102: users_clientapp(102, 1)})
    server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                     run_config={**config, "run-name": "typo", "scrrening.max-reply-mb": 5})
    with pytest.raises(ConfigError, match="'scrrening.max-reply-mb'.*did you mean 'screening.max-reply-mb'"):
        main(grid, server)
    assert grid.sent == []  # refused before round 1


class OwnMeanFedAvg(FedAvgStrategy):
    """A user's aggregate_train that averages the replies itself, never calling ours."""

    def aggregate_train(self, server_round, replies):
        models = [from_recorddict(reply.content).arrays["model"] for reply in replies if not reply.has_error()]
        return ArrayRecord({k: Array(np.mean([m[k] for m in models], axis=0).astype(v.dtype))
                            for k, v in models[0].items()}), None


def test_an_aggregate_train_of_ones_own_that_never_calls_ours_decides_the_model_and_its_round_is_recorded(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    strategy = OwnMeanFedAvg(run_config=config, on_round_end=RoundSaver(plot_interval=1e9))
    result = strategy.start(FakeGrid(simulated_hospitals(config, 2)), num_rounds=2)
    assert [r["aggregated-by"] for r in strategy.engine.history] == ["OwnMeanFedAvg.aggregate_train, on its own"] * 2
    assert all(r["aggregated"] == ["hospital-00", "hospital-01"] and "skipped" not in r
               for r in strategy.engine.history)
    state = read_checkpoint(checkpoint_dir(strategy.job.run_dir) / "round-00002.npz")
    assert_same_model({k.removeprefix("method/global/"): v for k, v in state.items()}, arrays_of(result.arrays),
                      "the checkpoint holds the model the override returned")
