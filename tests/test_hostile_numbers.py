"""A second round of hostile hospitals (issue 28): no declared size takes the aggregate over, hostile numbers are
bounded and checked before any arithmetic, a reply cannot change the global model's dtypes, metadata is bounded
where it is kept and logged, every metric a method reads is checked by type, replies are bound to their round,
free-riders are recorded (and can be refused), and a hospital name cannot lead outside the state folder."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from common.config import ConfigError, JobConfig
from common.engine.round_engine import RoundEngine, RoundReply
from common.engine.screening import capped_shares
from common.engine.wire import MalformedPayload, from_recorddict, to_recorddict
from common.methods.base import HospitalInfo, Payload
from strategies import FedAvgStrategy

from .fake_grid import FakeGrid, simulated_hospitals
from .test_hostile_hospital import SMALL, honest_arrays, identity_reply, reply

pytestmark = pytest.mark.usefixtures("one_thread")


def first_weight(arrays: dict) -> str:
    return next(k for k, v in arrays.items() if v.dtype.kind == "f" and not k.endswith("running_var"))


def test_a_hospital_declaring_an_enormous_size_is_refused_when_it_joins(tmp_path, caplog):
    config = {**{k.replace("_", "-"): v for k, v in SMALL.items()}, "state-dir": str(tmp_path / "s")}
    nodes = simulated_hospitals(config, 2)
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    with caplog.at_level("WARNING", logger="fedmed"):
        strategy.start(FakeGrid({**nodes, 300: identity_reply("hospital-x", 10**12),
                                 301: identity_reply("hospital-y", 2.5)}), num_rounds=1)
    assert 300 not in strategy.hospitals and 301 not in strategy.hospitals
    assert "num-examples=1000000000000 is more than screening.max-samples=10000000" in caplog.text
    assert "num-examples=2.5 is not a whole number" in caplog.text
    assert strategy.engine.history[0]["aggregated"] == ["hospital-00", "hospital-01"]


def test_no_reported_size_takes_the_aggregate_over():
    engine = RoundEngine(JobConfig(**SMALL))
    g = engine.method.global_arrays
    name = first_weight(g)
    big = 2**62  # as declared when it joined, under a cap the consortium raised
    replies = [reply("h-a", {**g, name: g[name] + 1.0}, n=10), reply("h-b", {**g, name: g[name] + 2.0}, n=10),
               RoundReply(HospitalInfo("h-big", big), Payload(arrays={"model": {**g, name: g[name] + 4.0}},
                                                                 metrics={"num-examples": big, "server-round": 1}))]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    # weights 10, 10 and at most 10 x the others' median (100), then no share above max-hospital-weight=0.5 by
    # default: the big one has half of the aggregate (100/120 with the ratio rule alone), not ~1
    np.testing.assert_allclose(engine.method.global_arrays[name], g[name] + 0.25 * 1 + 0.25 * 2 + 0.5 * 4, rtol=1e-5)
    assert "screening.sample-ratio-limit=10 x the others' median" in record["weight-cut"]["h-big"]
    plain = RoundEngine(JobConfig(**SMALL, screening={"max-hospital-weight": 1.0}))  # the ratio rule alone
    plain.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    np.testing.assert_allclose(plain.method.global_arrays[name], g[name] + (10 * 1 + 10 * 2 + 100 * 4) / 120,
                               rtol=1e-5)
    np.testing.assert_allclose(capped_shares([2**62, 10, 10], 0.5), [0.5, 0.25, 0.25])  # the cap holds whatever


@pytest.mark.parametrize("count,message", [(0.5, "not a whole number of samples"), (3.7, "not a whole number"),
                                           (0, "not a whole number")])
def test_fractional_or_zero_sample_counts_are_refused_and_the_model_stays_finite(count, message):
    engine = RoundEngine(JobConfig(**SMALL))
    replies = [reply(f"h-{i}", honest_arrays(engine.method.global_arrays, i), n=count) for i in range(3)]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == [] and all(message in why for why in record["refused"].values())
    assert all(np.isfinite(v).all() for v in engine.method.global_arrays.values() if v.dtype.kind == "f")


@pytest.mark.parametrize("influence,message", [
    ([2**62, 2**62 - 1] + [0] * 6, "more than the 40 the hospital trained on"),
    ([2**63 - 1, 2] + [0] * 6, "more than the 40"),
    ([1.5, 1] + [0] * 6, "fractional counts"),
])
def test_hostile_influence_counts_are_refused_before_any_arithmetic(influence, message):
    engine = RoundEngine(JobConfig(**{**SMALL, "strategy": "fedproin"}))
    g = engine.method.global_arrays
    honest = [reply(f"h-{i}", honest_arrays(g, i), influence=[5, 5] + [0] * 6) for i in range(2)]
    attacker = reply("h-x", {**honest_arrays(g, 7), "prototypes": g["prototypes"] + 100.0}, influence=influence)
    record = engine.complete_round(1, [r.hospital for r in honest + [attacker]], honest + [attacker], 0.0)
    assert record["aggregated"] == ["h-0", "h-1"] and message in record["refused"]["h-x"]
    assert np.abs(engine.method.global_arrays["prototypes"] - g["prototypes"]).max() < 1.0


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_a_reply_of_another_dtype_is_refused_and_the_global_model_keeps_the_servers(dtype):
    engine = RoundEngine(JobConfig(**SMALL))
    g = engine.method.global_arrays
    drifted = {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in honest_arrays(g, 9).items()}
    replies = [reply("h-a", honest_arrays(g, 1)), reply("h-b", honest_arrays(g, 2)), reply("h-x", drifted)]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert f"has dtype {np.dtype(dtype).name}, expected float32" in record["refused"]["h-x"]
    assert {v.dtype for v in engine.method.global_arrays.values() if v.dtype.kind == "f"} == {np.dtype(np.float32)}


def test_metadata_counts_against_the_reply_limit_and_a_hospitals_text_is_cut():
    content = to_recorddict(Payload(config={"note": "x" * 2_000_000}, metrics={"num-examples": 1}))
    with pytest.raises(MalformedPayload,
                       match=r"take 2,\d{3},\d{3} bytes \(2\.0 MB\), more than the 1,000,000 bytes \(1\.0 MB\)"):
        from_recorddict(content, limit=1_000_000)
    listed = RecordDict({"metrics": MetricRecord({"val-x": [1.0] * 200_000}), "config": ConfigRecord({})})
    with pytest.raises(MalformedPayload, match=r"more than the 1,000,000 bytes \(1\.0 MB\)"):
        from_recorddict(listed, limit=1_000_000)

    engine = RoundEngine(JobConfig(**SMALL))
    g = engine.method.global_arrays
    replies = [reply("h-a", honest_arrays(g, 1)), reply("h-b", honest_arrays(g, 2)),
               reply("h-long", honest_arrays(g, 3), **{"val-loss": [1.0] * 3_000_000}),
               reply("h-text", honest_arrays(g, 4), **{"val-loss": "y" * 5_000_000}),
               RoundReply(HospitalInfo("h-error", 40), None, "z" * 5_000_000)]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == ["h-a", "h-b"]
    assert "3000000 entries" in record["refused"]["h-long"]
    assert all(len(reason) < 1000 for reason in record["refused"].values())  # no 5 MB copies in the history
    assert "5000002 characters" in record["refused"]["h-text"]


def test_a_metric_the_method_reads_as_a_number_that_is_a_list_is_refused():
    engine = RoundEngine(JobConfig(**SMALL))
    g = engine.method.global_arrays
    replies = [reply("h-a", honest_arrays(g, 1), **{"val-dice": 0.5}),
               reply("h-b", honest_arrays(g, 2), **{"val-dice": 0.6}),
               reply("h-x", honest_arrays(g, 3), **{"val-dice": [1.0]})]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == ["h-a", "h-b"] and "'val-dice' is a list" in record["refused"]["h-x"]
    assert record["train"]["val-dice"] == pytest.approx(0.55)


def test_a_reply_from_another_round_is_refused():
    engine = RoundEngine(JobConfig(**SMALL))
    g = engine.method.global_arrays
    replies = [reply("h-a", honest_arrays(g, 1)), reply("h-b", honest_arrays(g, 2))]
    engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    replayed = [reply("h-a", honest_arrays(g, 1)), reply("h-b", honest_arrays(g, 5), **{"server-round": 2})]
    record = engine.complete_round(2, [r.hospital for r in replayed], replayed, 0.0)
    assert record["aggregated"] == ["h-b"] and "the reply is for round 1, not this round 2" in record["refused"]["h-a"]


@pytest.mark.parametrize("refuse", [False, True])
def test_a_free_rider_is_recorded_and_optionally_refused(refuse):
    engine = RoundEngine(JobConfig(**SMALL, screening={"refuse-unchanged": refuse}))
    g = engine.method.global_arrays
    replies = [reply("h-a", honest_arrays(g, 1)), reply("h-b", honest_arrays(g, 2)),
               reply("h-free", {k: v.copy() for k, v in g.items()})]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["update-norm-vs-median"]["h-free"] == 0.0 and record["update-norm-vs-median"]["h-a"] > 0.5
    assert ("h-free" in record["refused"]) is refuse
    if refuse:
        assert "returned the model it received unchanged" in record["refused"]["h-free"]


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "x" * 200])
def test_a_hospital_name_that_would_leave_the_state_folder_is_refused(name):
    from client_app.node_config import load_node_config

    with pytest.raises(ConfigError, match="is not a hospital name"):
        load_node_config({"hospital": name, "data-dir": "."})


def test_identity_properties_are_bounded(tmp_path, caplog):
    config = {**{k.replace("_", "-"): v for k, v in SMALL.items()}, "state-dir": str(tmp_path / "s")}
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    nodes = simulated_hospitals(config, 2)
    with caplog.at_level("WARNING", logger="fedmed"):
        strategy.start(FakeGrid({**nodes, 300: identity_reply("hospital-x", modalities="q" * 10_000_000)}),
                       num_rounds=1)
    assert 300 not in strategy.hospitals and "a hospital declares at most 32 short ones" in caplog.text
    assert len(caplog.text) < 100_000  # the 10 MB property is not in the log


def test_records_of_unknown_kinds_are_still_refused():
    with pytest.raises(MalformedPayload, match="unexpected"):
        from_recorddict(RecordDict({"x": ArrayRecord(), "settings": ConfigRecord({"a": 1})}))


# --- the weak rows of the last review (issue 40) ------------------------------------------------------------------
def test_by_default_no_declared_size_carries_more_than_half_of_the_model():
    """Three hospitals, one declaring a huge sample count: by default it gets at most half (it got 83 %)."""
    engine = RoundEngine(JobConfig(**SMALL))
    g = engine.method.global_arrays
    name = first_weight(g)
    big = 10**6
    replies = [reply("h-a", {**g, name: g[name] + 1.0}, n=10), reply("h-b", {**g, name: g[name] + 1.0}, n=10),
               RoundReply(HospitalInfo("h-big", big), Payload(arrays={"model": {**g, name: g[name] + 7.0}},
                                                                 metrics={"num-examples": big, "server-round": 1}))]
    engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    share_of_big = float(np.mean((engine.method.global_arrays[name] - g[name] - 1.0) / 6.0))
    assert share_of_big == pytest.approx(0.5, abs=1e-5)
    assert JobConfig().screening.max_hospital_weight == 0.5


def test_by_default_a_reply_of_the_received_model_unchanged_is_refused():
    engine = RoundEngine(JobConfig(**SMALL))
    g = engine.method.global_arrays
    replies = [reply("h-a", honest_arrays(g, 1)), reply("h-b", honest_arrays(g, 2)),
               reply("h-free", {k: v.copy() for k, v in g.items()})]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == ["h-a", "h-b"]
    assert "returned the model it received unchanged" in record["refused"]["h-free"]


def test_a_metric_out_of_its_range_is_refused_and_a_nan_one_kept_out_of_the_means(tmp_path):
    import json

    from server_app.results import write_results

    engine = RoundEngine(JobConfig(**{**SMALL, "run_name": "t", "results_dir": str(tmp_path)}))
    g = engine.method.global_arrays
    replies = [reply("h-a", honest_arrays(g, 1), **{"val-accuracy": 0.5, "val-loss": float("nan")}),
               reply("h-b", honest_arrays(g, 2), **{"val-accuracy": 0.7, "val-loss": 1.0}),
               reply("h-x", honest_arrays(g, 3), **{"val-accuracy": 1e9, "val-loss": 1.0}),
               reply("h-y", honest_arrays(g, 4), **{"val-mcc": -3.0})]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    assert record["aggregated"] == ["h-a", "h-b"]
    assert "'val-accuracy'=1000000000.0 is outside [0, 1]" in record["refused"]["h-x"]
    assert "'val-mcc'=-3.0 is outside [-1, 1]" in record["refused"]["h-y"]
    assert record["train"]["val-accuracy"] == pytest.approx(0.6)
    assert "val-loss" not in record["train"]  # one hospital's NaN: no mean
    write_results(engine.cfg.run_dir, engine.cfg.to_flat(), engine.history, plots=False)

    def refuse_constant(name):
        raise ValueError(f"{name} in metrics.jsonl")

    for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines():  # strict JSON, NaN as null
        record = json.loads(line, parse_constant=refuse_constant)
    assert record["hospital_metrics"]["h-a"]["val-loss"] is None


@pytest.mark.parametrize("attack", ["many arrays", "many flat entries"])
def test_a_reply_of_too_many_tensors_is_refused_before_any_is_decoded(attack):
    import time

    from flwr.app import Array

    from common.engine.wire import FLAT_ARRAY, FLAT_LAYOUT

    if attack == "many arrays":
        content = RecordDict({"arrays": ArrayRecord({f"t{i}": Array(np.zeros(1, np.float32))
                                                     for i in range(20_000)}),
                              "config": ConfigRecord({}), "metrics": MetricRecord({"num-examples": 1})})
    else:
        layout = "[" + ",".join(f'["t{i}","float32.0",[1]]' for i in range(2_000_000)) + "]"
        content = RecordDict({"arrays": ArrayRecord({FLAT_ARRAY + "float32.0": Array(np.zeros(2_000_000,
                                                                                                np.float32))}),
                              "config": ConfigRecord({FLAT_LAYOUT + "arrays": layout}),
                              "metrics": MetricRecord({"num-examples": 1})})
    started = time.perf_counter()
    with pytest.raises(MalformedPayload, match="more than"):
        from_recorddict(content, limit=10**9, max_tensors=200)
    assert time.perf_counter() - started < 1.0  # nothing was decoded or parsed


def test_a_header_of_deeply_nested_lists_is_refused_by_name():
    from common.quantization.codec import PayloadError, parse_header

    deep = ("[" * 100_000 + "]" * 100_000).encode()
    encoded = {"header": np.frombuffer(deep, np.uint8), "ranges": np.zeros(1), "data": np.zeros(1, np.uint8)}
    with pytest.raises(PayloadError, match="header"):
        parse_header(encoded, "weights", 1, "packed model")
    shallow = ("[" * 10_000 + "]" * 10_000).encode()
    with pytest.raises(PayloadError, match="nests"):
        parse_header({**encoded, "header": np.frombuffer(shallow, np.uint8)}, "weights", 1, "packed model")


SERVER_WITHOUT_TEST_SET = "def load(request):\n    return None if request.role == 'server' else (D(), D())\n"
BROKEN_LOADERS = {
    "no samples": ("def load(request):\n    return None if request.role == 'server' else ([], [])\n",
                   "no training samples"),
    "NaN images": ("import torch\nclass D(torch.utils.data.Dataset):\n    def __len__(self): return 8\n"
                   "    def __getitem__(self, i): return torch.full((3, 16, 16), float('nan')), i % 2\n"
                   + SERVER_WITHOUT_TEST_SET, "NaN or Inf"),
    "wrong shapes": ("import torch\nclass D(torch.utils.data.Dataset):\n    def __len__(self): return 8\n"
                     "    def __getitem__(self, i): return torch.zeros(16 + i), i % 2\n"
                     + SERVER_WITHOUT_TEST_SET, "has shape"),
    "shapes that differ later": ("import torch\nclass D(torch.utils.data.Dataset):\n    def __len__(self): return 40\n"
                                 "    def __getitem__(self, i): return torch.zeros(3, 16, 16 + (i > 20)), i % 2\n"
                                 + SERVER_WITHOUT_TEST_SET, "cannot be batched"),
}


@pytest.mark.parametrize("case", list(BROKEN_LOADERS))
def test_a_loader_returning_unusable_data_is_refused_at_the_hospital_naming_it(tmp_path, monkeypatch, case):
    source, message = BROKEN_LOADERS[case]
    module = f"broken_loader_{case.replace(' ', '_')}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {**{k.replace("_", "-"): v for k, v in SMALL.items()}, "state-dir": str(tmp_path / "s"),
              "dataset": f"{module}:load", "num-classes": 2}
    strategy = FedAvgStrategy(min_train_nodes=1, min_available_nodes=2, run_config=config)
    try:
        strategy.start(FakeGrid(simulated_hospitals(config, 2)), num_rounds=1)
    except ConfigError:  # refused when the hospitals load their data for the identity query, before round 1
        pass
    else:  # or in round 1: a Result, and the reason
        assert message in strategy.nothing_aggregated
    reasons = " ".join(list(strategy._refusals.values()) + [str(r.get("refused")) for r in strategy.engine.history])
    assert message in reasons and f"{module}:load" in reasons


def test_simulate_takes_the_old_key_classifier_as_model(monkeypatch, tmp_path):
    """`classifier=` passes fedmed's check and must not reach Flower, which knows only `model`."""
    import cli.main as cli
    import cli.simulate as simulation

    seen = {}

    def stop_before_flower(what, values):
        seen[what] = dict(values)
        raise ConfigError("stopped here")

    monkeypatch.setattr(simulation, "check_flower_config", stop_before_flower)
    assert cli.main(["simulate", "--home", str(tmp_path / "h"), "--run-config", "classifier='small-cnn'"]) == 2
    assert seen["--run-config"]["model"] == "small-cnn" and "classifier" not in seen["--run-config"]
