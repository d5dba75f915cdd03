"""A Flower user's app as Flower's examples write it, with our strategies: the user's mods see every message
(fedmed's included) in Flower's order, Flower's own client-side mods work beside ours or are refused before round 1,
Flower's metric names and Result are kept, and Flower's legacy-API arguments are refused naming their Message-API
equivalent."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType
from flwr.client.mod import secagg_mod, secaggplus_mod
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

from client_app.hospital_mod import HospitalClientApp
from common.config import ConfigError
from strategies import FedAvgStrategy, FedProInStrategy, FedProxStrategy, QFedPolypStrategy, legacy_api

from .conftest import ROOT
from .fake_grid import FakeGrid, flower_clientapp_node
from .test_strategies import SMALL_CLASSIFICATION, run_config

sys.path.insert(0, str(ROOT / "examples" / "quickstart_pytorch"))
from quickstart import client_app as quickstart_client  # noqa: E402  (Flower's quickstart ClientApp, as it is)
from quickstart.task import Net  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
APP_CONFIG = {"batch-size": 32, "local-epochs": 1}  # the quickstart app's own run config


def job(tmp_path, name: str, **more) -> dict:
    """Where fedmed writes for a run named ``name`` (results, state), and ``more``; nothing of the app's network."""
    return {"run-name": name, "results-dir": str(tmp_path / name), "state-dir": str(tmp_path / name / "s"), **more}


def nodes_of(app, config: dict, count: int = 2) -> FakeGrid:
    return FakeGrid({101 + pid: flower_clientapp_node(app, config, {"partition-id": pid, "num-partitions": count},
                                                      101 + pid) for pid in range(count)})


def recording_mod(log: list, tag: str):
    def mod(message, context, call_next):
        log.append((tag, message.metadata.message_type))
        reply = call_next(message, context)
        log.append((f"{tag}-reply", message.metadata.message_type))
        return reply
    return mod


def test_the_users_mods_see_every_message_ours_included_in_flowers_order(tmp_path):
    """FedProIn's rounds are fedmed's hospital step: the app's mod and its train handler's mod still see them, the
    app's outermost, as Flower wraps them; the handler itself is not asked."""
    seen: list = []
    app = HospitalClientApp(mods=[recording_mod(seen, "app")])

    @app.train(mods=[recording_mod(seen, "handler")])
    def train(message, context):
        raise AssertionError("FedProIn's rounds are fedmed's step")

    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    FedProInStrategy(run_config=config, num_prototypes=1).start(nodes_of(app, config), num_rounds=1)
    kinds = [kind for tag, kind in seen if tag == "app"]
    assert kinds.count(MessageType.TRAIN) == 2 and kinds.count(MessageType.QUERY) >= 2  # identity, and the run's end
    trains = [tag for tag, kind in seen if kind == MessageType.TRAIN]
    assert trains[:4] == ["app", "handler", "handler-reply", "app-reply"]  # Flower's order: the app's mod outermost


@pytest.mark.parametrize("mod", [secaggplus_mod, secagg_mod], ids=lambda m: m.__name__)
@pytest.mark.parametrize("where", ["app", "train"])
def test_flowers_legacy_secure_aggregation_mods_are_refused_when_the_app_is_built(mod, where):
    with pytest.raises(ValueError, match=f"{mod.__name__} .*legacy SecAggPlusWorkflow.*secure-aggregation.enabled"):
        if where == "app":
            HospitalClientApp(mods=[mod])
        else:
            HospitalClientApp().train(mods=[mod])


@pytest.mark.parametrize("mod", [fixedclipping_mod, adaptiveclipping_mod], ids=lambda m: m.__name__)
def test_flowers_clipping_mods_belong_on_the_train_handler_as_flowers_docs_install_them(mod):
    with pytest.raises(ValueError, match=rf"install it on the train handler, @app.train\(mods=\[{mod.__name__}\]\)"):
        HospitalClientApp(mods=[mod])
    with pytest.raises(ValueError, match="evaluate handler"):
        HospitalClientApp().evaluate(mods=[mod])
    HospitalClientApp().train(mods=[mod])  # accepted there


def test_flowers_fixedclipping_mod_clips_the_users_own_training_beside_our_mod(tmp_path):
    """Flower's client-side DP: the wrapper sends the clipping norm, the app's own train handler trains, Flower's
    fixedclipping_mod on it clips the reply (our mod, innermost, passes Flower's messages on)."""
    app = HospitalClientApp()
    app.train(mods=[fixedclipping_mod])(quickstart_client.train)
    app.evaluate()(quickstart_client.evaluate)
    grid = nodes_of(app, APP_CONFIG)
    strategy = FedAvgStrategy(run_config=job(tmp_path, "dp"))
    wrapper = DifferentialPrivacyClientSideFixedClipping(strategy, noise_multiplier=0.0, clipping_norm=0.05,
                                                         num_sampled_clients=2)
    initial = ArrayRecord(Net().state_dict())
    wrapper.start(grid, initial_arrays=initial, num_rounds=1, train_config=ConfigRecord({"lr": 0.1}))
    replies = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]
    assert len(replies) == 2 and not [m for m in replies if m.has_error()]
    start = {k: v.numpy() for k, v in initial.items()}
    for reply in replies:
        assert "train_loss" in reply.content["metrics"]  # the user's own train loop answered
        update = [reply.content["arrays"][k].numpy() - start[k] for k in start]
        assert np.sqrt(sum(float(np.sum(u.astype(np.float64) ** 2)) for u in update)) <= 0.05 + 1e-5


@pytest.mark.parametrize("strategy_type", [FedProInStrategy, QFedPolypStrategy], ids=lambda s: s.__name__)
def test_a_bare_one_line_swap_is_refused_naming_everything_the_app_also_needs(tmp_path, strategy_type):
    """Flower's quickstart with only the import and constructor changed: refused before round 1, naming the network,
    the initial arrays, the ClientApp and the data loader the method also needs."""
    strategy = strategy_type(run_config=job(tmp_path, "swap"))
    grid = nodes_of(quickstart_client.app, APP_CONFIG)
    with pytest.raises(ConfigError) as refused:
        strategy.start(grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=1)
    for needed in ("model='package.module:Net'", "initial_arrays", "HospitalClientApp", "dataset="):
        assert needed in str(refused.value)
    assert not grid.sent_of_type(MessageType.TRAIN)


@pytest.mark.parametrize("name", sorted(legacy_api.ARGUMENTS))
@pytest.mark.parametrize("strategy_type", [FedAvgStrategy, FedProxStrategy, FedProInStrategy], ids=lambda s: s.__name__)
def test_a_legacy_api_argument_is_refused_naming_its_message_api_equivalent(strategy_type, name):
    with pytest.raises(TypeError) as refused:
        strategy_type(**{name: None})
    text = str(refused.value)
    assert f"legacy-API argument {name!r}" in text and "Message-API strategy" in text
    assert legacy_api.ARGUMENTS[name] in text


@pytest.mark.parametrize("name", sorted(legacy_api.METHODS))
def test_a_legacy_server_calling_a_legacy_method_is_told_the_message_api_equivalent(name):
    equivalent = re.escape(legacy_api.METHODS[name])
    with pytest.raises(AttributeError, match=rf"no legacy {name}\(\).*@app.main\(\).*{equivalent}"):
        getattr(FedAvgStrategy(), name)


def test_the_users_metric_names_are_kept_as_flowers_fedavg_aggregates_them_ours_beside_them_prefixed(tmp_path):
    """Flower's quickstart ClientApp replies with ``train_loss``: the Result has it under that name, with the value
    Flower's own aggregation gives (``aggregate_metricrecords``), and fedmed's metrics beside it, prefixed."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    grid = nodes_of(quickstart_client.app, APP_CONFIG)
    strategy = FedAvgStrategy(run_config=job(tmp_path, "names"))
    result = strategy.start(grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=1,
                            train_config=ConfigRecord({"lr": 0.1}))
    replies = [m.content for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]
    flowers = aggregate_metricrecords(replies, "num-examples")
    metrics = result.train_metrics_clientapp[1]
    assert set(flowers) == {"train_loss"}
    assert metrics["train_loss"] == pytest.approx(flowers["train_loss"], rel=1e-12)
    assert "num-examples" not in metrics  # the weighting key, left out as Flower's aggregation leaves it out
    ours = set(metrics) - set(flowers)
    assert ours and all(name.startswith(("train.", "bytes-", "hospitals-", "update-norm.")) for name in ours), ours


def test_flowers_no_query_function_noise_is_quieted_and_said_once_per_node_in_words(tmp_path, caplog):
    """A Flower ClientApp without a query handler answers our identity query with Flower's error; the simulation
    engine would log it twice per node (error and traceback): those records of Flower's logger are dropped, and the
    strategy says once per node what the answer means."""
    import logging

    grid = nodes_of(quickstart_client.app, APP_CONFIG)
    strategy = FedAvgStrategy(run_config=job(tmp_path, "quiet"))
    with caplog.at_level(logging.INFO, logger="fedmed"):
        strategy.start(grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=2,
                       train_config=ConfigRecord({"lr": 0.1}))
    errors = [m for m in grid.replies if m.has_error()]
    assert len(errors) == 2  # one identity query per node, not one per round nor at the run's end
    flower = logging.getLogger("flwr")
    for reply in errors:  # what Flower's simulation engine logs for each: the exception, then its traceback
        for text in (reply.error.reason, f"Traceback (most recent call last):\n ... {reply.error.reason}"):
            assert not flower.filter(logging.LogRecord("flwr", logging.ERROR, __file__, 1, text, None, None))
    assert flower.filter(logging.LogRecord("flwr", logging.ERROR, __file__, 1, "another ClientApp error", None, None))
    said = [r.getMessage() for r in caplog.records if "is a Flower ClientApp that trains the model itself" in
            r.getMessage()]
    assert sorted(said) == [f"node {n} is a Flower ClientApp that trains the model itself: hospital node-{n}, sent "
                            "Flower's own messages" for n in (101, 102)]


def own_training_app(trained: list) -> HospitalClientApp:
    """Flower's quickstart ClientApp made a HospitalClientApp, its own handlers marking each call."""
    app = HospitalClientApp()

    @app.train()
    def train(message, context):
        trained.append(context.node_id)
        torch.manual_seed(context.node_id)  # its loader's shuffle: the same draws whichever node trains first
        return quickstart_client.train(message, context)

    app.evaluate()(quickstart_client.evaluate)
    return app


def test_under_secure_aggregation_the_users_own_train_loop_trains_and_our_mod_masks_its_reply(tmp_path, monkeypatch):
    """FedAvg's family with secure aggregation: the app's own train handler trains (as under Flower's secaggplus_mod),
    fedmed's mod masks what it returns; the mean is the plain run's, but for the quantisation of the masked sum."""
    from strategies.records import arrays_of

    from .test_secure_aggregation import STEP, masked_replies

    monkeypatch.chdir(tmp_path)  # the hospitals keep their state (the replay memory) in ./state
    initial = ArrayRecord(Net().state_dict())
    finals, trained = {}, {}
    for name, secure in (("plain", False), ("secure", True)):
        trained[name] = []
        grid = nodes_of(own_training_app(trained[name]), APP_CONFIG, count=3)
        strategy = FedAvgStrategy(min_train_nodes=3, min_available_nodes=3, run_config=job(
            tmp_path, name, **{"round-timeout": 5.0, "secure-aggregation.enabled": secure,
                               "screening.max-samples": 1000}))  # its weight cap: the app declares no count
        result = strategy.start(grid, initial_arrays=initial, num_rounds=1, train_config=ConfigRecord({"lr": 0.1}))
        finals[name] = arrays_of(result.arrays)
        assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"]
        if secure:
            masked = masked_replies(grid)
            assert len(masked) == 3 and all("train_loss" in m.content["metrics"] for m in masked)
            assert not [m for m in masked if set(m.content.array_records.get("arrays", {})) & set(initial)]
    assert sorted(trained["secure"]) == sorted(trained["plain"]) == [101, 102, 103]  # the app's own loop, each node
    for tensor, value in finals["plain"].items():
        np.testing.assert_allclose(finals["secure"][tensor], value, atol=3 * STEP + 1e-6, err_msg=tensor)


@pytest.mark.parametrize(("strategy_type", "secure", "said"), [
    (FedAvgStrategy, False, "a ClientApp that trains the model itself trains fedavg's rounds with its own train loop"),
    (FedProxStrategy, True, "under secure aggregation a HospitalClientApp's mod masks what the app's own train "
                            "handler returns"),
    (FedProInStrategy, False, "fedproin's hospitals run fedmed's fedproin step (its own local training): a "
                              "HospitalClientApp's own train handler is not asked"),
    (FedProInStrategy, True, "fedproin's hospitals run fedmed's fedproin step")])
def test_the_runs_first_lines_say_whose_train_loop_trains(tmp_path, caplog, strategy_type, secure, said):
    import logging

    strategy = strategy_type(run_config=job(tmp_path, "who", **{"secure-aggregation.enabled": secure}))
    with caplog.at_level(logging.INFO, logger="fedmed"):
        strategy.summary()  # what start() and Flower's loop log first
    assert said in caplog.records[1].getMessage()
