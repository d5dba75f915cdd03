"""The lying coordinator, enumerated (issue 64): a hospital's pre-mask contribution depends only on its own data,
policy and state, the model it trains from and the one round plan it signs. A secure round runs in process with
the real hospital handlers (FakeGrid, fedmed's ClientApp); every TRAIN message the server's own code sends at each
stage is recorded, and Hypothesis then changes, for one hospital at a time, one of them: a config key found in
the messages themselves (another number, another type, missing, one more key), an array record (another value,
another dtype, another type, missing, one more record), or a value of the round plan. For a value outside the
plan, every hospital's contribution (seen through ``hospital.contribution_masked``) is bit-identical to the honest
run's, or that hospital refused; for a plan value, the hospital told it refused or no hospital reveals anything.
The keys come from the messages, so a key added later is covered without touching this file. The fast tier draws a
few examples per method (seeded: ``derandomize``); ``-m slow`` sweeps more."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client_app.secure_aggregation import stage_of
from common.trust.identity import key_fingerprint
from common.trust.secure_aggregation import distributed_dp as ddp
from common.trust.secure_aggregation.messages import COLLECT, PLAN_KEY, UNMASK, plan_text
from strategies import (
    FedAvgStrategy,
    FedBNStrategy,
    FedMEPDStrategy,
    FedProInStrategy,
    FedProxStrategy,
    MoonStrategy,
    QFedPolypStrategy,
)
from strategies.secure_aggregation import with_secure_aggregation

from .fake_grid import FakeGrid
from .test_hostile_hospital import key_pair
from .test_secure_aggregation import SMALL_BRAIN, SMALL_CLASSIFICATION, SMALL_POLYP, secure_node

pytestmark = pytest.mark.usefixtures("one_thread")

BRAIN = {**SMALL_BRAIN, "brain.hospital-modalities": "flair,t1ce;flair,t2;flair,t1ce;flair,t2"}
#: every method with a secure sum: its strategy, its data, its run config
METHODS = {
    "fedavg": (FedAvgStrategy, SMALL_CLASSIFICATION, {}),
    "fedavg-distributed-dp": (FedAvgStrategy, SMALL_CLASSIFICATION, {
        "secure-aggregation.distributed-dp": "skellam", "secure-aggregation.noise-multiplier": 1.0}),
    "fedprox": (FedProxStrategy, SMALL_CLASSIFICATION, {}),
    "moon": (MoonStrategy, SMALL_CLASSIFICATION, {}),
    "fedbn": (FedBNStrategy, SMALL_CLASSIFICATION, {}),
    "fedproin": (FedProInStrategy, SMALL_CLASSIFICATION, {}),
    "qfedpolyp": (QFedPolypStrategy, SMALL_POLYP, {"qfedpolyp.bit-widths": "4,8,4,8"}),
    "fedmepd": (FedMEPDStrategy, BRAIN, {}),
    "fedmepd-fedavg": (FedMEPDStrategy, BRAIN, {"strategy": "fedmepd-fedavg"}),
    "fedmepd-federated-decoder": (FedMEPDStrategy, BRAIN, {"strategy": "fedmepd-federated-decoder"}),
}
HOSPITALS = 4
ROOT = Path(__file__).resolve().parents[1]
#: a hand-made hardened policy (the issue's); FedMEPD's parts are each held by two of the four hospitals
HARDENED = """require-secure-aggregation = true
min-hospitals-per-sum = {least}
min-threshold-fraction = 0.7
min-update-norm-bound = 0.5
max-sample-weight = 500
"""


def policy_text(method: str, hardened: bool, registered: Path) -> str:
    """Every hospital's policy: the shipped template (deploy/hospital-policy.toml, as make_hospital_policy.sh writes
    it) or the hand-made hardened one, each with a [peers] table pinning the four registered keys. FedMEPD's parts
    are each held by two of the four hospitals, so its sums may hold two."""
    fedmepd = method.startswith("fedmepd")
    if hardened:
        text = HARDENED.format(least=2 if fedmepd else 4)
    else:
        text = (ROOT / "deploy" / "hospital-policy.toml").read_text()
        if fedmepd:
            text = text.replace("min-hospitals-per-sum = 3", "min-hospitals-per-sum = 2")
    pins = "".join(f'"{key.stem}" = "{key_fingerprint(key)}"\n' for key in sorted(registered.glob("*.pub")))
    return f"{text}\n[peers]\n{pins}"


class LyingGrid(FakeGrid):
    """FakeGrid whose ``lie(stage, node, content)`` may give one message other content before it is delivered
    (the server's own copy is left as it built it); ``sent_stages`` records what the server sent, by stage."""

    def __init__(self, nodes, lie=None):
        super().__init__(nodes)
        self.lie = lie

    def push_messages(self, messages):
        delivered = []
        for message in messages:
            stage = stage_of(message)
            if stage is not None and self.lie is not None:
                content = self.lie(stage, message.metadata.dst_node_id, message.content)
                if content is not None:
                    message.content = content
            delivered.append(message)
        return super().push_messages(delivered)


def copied(content: RecordDict) -> RecordDict:
    """A message's content with its own records (a shared model record is not changed for the others)."""
    records = {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            records[name] = ArrayRecord({k: Array(np.array(v.numpy(), copy=True)) for k, v in record.items()})
        else:
            records[name] = type(record)(dict(record))
    return RecordDict(records)


class Round:
    """One secure round of a method over four hospitals, as the deployment ships them (each its identity key, the
    consortium's registered keys and a policy pinning them, shipped or hand-made hardened; the server
    ``hospital-keys``); every hospital's pre-mask contribution recorded. Randomness the server may choose
    (distributed DP's rotation) and the hospitals' own (stochastic rounding, noise) is fixed, so two honest runs are
    bit-identical."""

    def __init__(self, method: str, hardened: bool, folder: Path):
        self.method, self.hardened, self.folder = method, hardened, folder
        strategy, base, extra = METHODS[method]
        self.strategy_type = strategy
        self.registered = folder / "registered"
        self.registered.mkdir(parents=True, exist_ok=True)
        for pid in range(HOSPITALS):
            key_pair(self.registered, f"hospital-{pid:02d}")
        self.policy = folder / "policy.toml"
        self.policy.write_text(policy_text(method, hardened, self.registered))
        self.base = {**base, "run-name": "lying", "round-timeout": 1.0, "hospital-keys": str(self.registered),
                     "secure-aggregation.update-norm-bound": 5.0, **extra}
        self.runs = 0
        #: FedAvg runs two rounds: the first round's unmask request carries the second's setup (secagg.ahead.*)
        self.rounds = 2 if method == "fedavg" else 1

    def run(self, lie=None, run: str = "lying", state: str = "") -> tuple[dict[tuple[str, int], np.ndarray],
                                                                            LyingGrid]:
        """The round (``lie``: LyingGrid's), each hospital's contribution by name, and the grid; ``state``: the
        hospitals' state folder to keep between runs (default: a new one)."""
        self.runs += 1
        where = self.folder / f"run-{self.runs}"
        config = {**self.base, "run-name": run, "state-dir": str(self.folder / state if state else where / "state"),
                  "results-dir": str(where / "results")}
        nodes = {}
        for pid in range(HOSPITALS):
            node = {"partition-id": pid, "num-partitions": HOSPITALS,
                    "identity-key": str(self.registered / f"hospital-{pid:02d}"), "peer-keys": str(self.registered)}
            node["policy-file"] = str(self.policy)
            nodes[101 + pid] = seeded(secure_node(config, node, 101 + pid), 101 + pid)
        grid = LyingGrid(nodes, lie)
        strategy = with_secure_aggregation(self.strategy_type)(min_train_nodes=2, run_config=config)
        contributions.clear()
        strategy.start(grid, num_rounds=self.rounds)
        return dict(contributions), grid


contributions: dict[tuple[str, int], np.ndarray] = {}  #: (hospital, round) -> its pre-mask contribution


def seeded(node, seed: int):
    """A hospital whose randomness in the collect stage (Flower's stochastic rounding, distributed DP's noise) is
    fixed: so a contribution can be compared bit for bit."""
    def answer(message):
        try:
            collect = stage_of(message) == COLLECT
        except ValueError:  # a stage no hospital knows (a lie): the hospital itself refuses it
            collect = False
        if collect:
            np.random.seed(seed)
        return node(message)

    return answer


@pytest.fixture(autouse=True)
def observed(monkeypatch):
    """Every pre-mask contribution through the hospital's seam; fixed noise and rotation."""
    import common.trust.local_dp as local_dp
    from common.trust.secure_aggregation import hospital

    monkeypatch.setattr(hospital, "contribution_masked",
                        lambda name, rnd, vector: contributions.__setitem__((name, rnd), np.array(vector, copy=True)))
    monkeypatch.setattr(local_dp, "noise_rng", lambda: np.random.default_rng(7))
    planned = ddp.plan
    monkeypatch.setattr(ddp, "plan", lambda *a: dataclasses.replace(planned(*a), rotation_seed="ab" * 32))


# --- what a lying coordinator can change ------------------------------------------------------------------------
OUTSIDE = ("other number", "other type", "missing", "extra")
ARRAY_CHANGES = ("other number", "other dtype", "other type", "missing", "extra")


def other_number(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 1.0
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, bytes):
        return bytes([value[0] ^ 1]) + value[1:] if value else b"x"
    if isinstance(value, list):
        return value[:-1] if value else [0]
    return value


def other_type(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return float(value)
    if isinstance(value, float):
        return str(value)
    if isinstance(value, str):
        return 1
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def change_config(content: RecordDict, key: str, how: str) -> RecordDict:
    content = copied(content)
    record = next(r for r in content.values() if isinstance(r, ConfigRecord) and (key in r or how == "extra"))
    if how == "missing":
        del record[key]
    elif how == "extra":
        record[key + ".extra"] = record.get(key, 1)
    else:
        record[key] = (other_number if how == "other number" else other_type)(record[key])
    return content


def change_array(content: RecordDict, where: tuple[str, str], how: str) -> RecordDict:
    content = copied(content)
    record: ArrayRecord = content[where[0]]
    value = record[where[1]].numpy()
    if how == "missing":
        del record[where[1]]
    elif how == "extra":
        record[where[1] + ".extra"] = Array(np.ones(1, np.float32))
    elif how == "other number":
        changed = np.array(value, copy=True).reshape(-1)
        if changed.size:
            changed[len(changed) // 2] += 1
            changed = changed.reshape(value.shape)
        else:  # an empty array's other value: one element
            changed = np.ones(1, value.dtype)
        record[where[1]] = Array(changed)
    elif how == "other dtype":
        record[where[1]] = Array(value.astype(np.float64 if value.dtype != np.float64 else np.float32))
    else:
        record[where[1]] = Array(value.astype(np.int16))
    return content


def plan_leaves(value: Any, path: tuple = ()) -> list[tuple]:
    """The paths of every number, string and flag of a round plan (lists and objects walked)."""
    if isinstance(value, dict):
        return [leaf for key in sorted(value) for leaf in plan_leaves(value[key], (*path, key))]
    if isinstance(value, list):
        return [leaf for i, item in enumerate(value) for leaf in plan_leaves(item, (*path, i))] or [path]
    return [path]


def change_plan(text: str, path: tuple, how: str) -> str:
    plan = json.loads(text)
    holder = plan
    for step in path[:-1]:
        holder = holder[step]
    leaf = holder[path[-1]]
    holder[path[-1]] = other_number(leaf) if how == "other number" else other_type(leaf)
    return plan_text(plan)


# --- the honest round, recorded once per method -------------------------------------------------------------------
HONEST: dict[tuple[str, bool], tuple[Round, dict[str, np.ndarray], list[tuple]]] = {}


def honest(method: str, hardened: bool, twice: bool):
    """The method's round, its honest contributions and what a lying coordinator can change (from the messages the
    server sent: per stage, each config key and each array record; each leaf of the round plan). ``twice``: run it
    again and check the oracle (two honest runs agree bit for bit; in the fast tier every drawn example where a
    hospital contributes checks it too)."""
    if (method, hardened) not in HONEST:
        folder = Path(tempfile.mkdtemp(prefix=f"lying-{method}-"))
        round_ = Round(method, hardened, folder)
        seen, grid = round_.run()
        assert sorted(seen) == [(f"hospital-{pid:02d}", rnd) for pid in range(HOSPITALS)
                                for rnd in range(1, round_.rounds + 1)]
        if twice:
            again, _ = round_.run()
            for name, vector in seen.items():
                np.testing.assert_array_equal(again[name], vector)
        targets, plan = set(), None
        for message in grid.sent:
            stage = stage_of(message)
            if stage is None:
                continue
            for name, record in message.content.items():
                if isinstance(record, ConfigRecord):
                    targets |= {("config", stage, key) for key in record}
                    plan = record.get(PLAN_KEY, plan)
                elif isinstance(record, ArrayRecord):
                    targets |= {("array", stage, (name, key)) for key in record}
        targets |= {("plan", COLLECT, path) for path in plan_leaves(json.loads(plan))}
        HONEST[method, hardened] = round_, seen, sorted(targets, key=repr)
    return HONEST[method, hardened]


def check(method: str, hardened: bool, data, twice: bool = False) -> tuple[dict, set[int]]:
    """One drawn change, run and checked; the contributions seen, and the rounds whose plan the target was told
    alone."""
    round_, expected, targets = honest(method, hardened, twice)
    kind, stage, what = data.draw(st.sampled_from(targets), label="value")
    target = 101 + data.draw(st.integers(0, HOSPITALS - 1), label="hospital")
    how = data.draw(st.sampled_from(ARRAY_CHANGES if kind == "array" else OUTSIDE if kind == "config" else
                                    ("other number", "other type")), label="change")

    def lie(at: str, node: int, content: RecordDict):
        if at != stage or node != target:
            return None
        config = next((r for r in content.values() if isinstance(r, ConfigRecord)), {})
        if kind == "config":  # (a key of one round's message only, e.g. the next round's setup, is left alone)
            return change_config(content, what, how) if what in config or how == "extra" else None
        if kind == "array":
            return change_array(content, what, how) if what[1] in content.get(what[0], {}) else None
        changed = copied(content)
        record = next(r for r in changed.values() if isinstance(r, ConfigRecord) and PLAN_KEY in r)
        try:
            text = change_plan(record[PLAN_KEY], what, how)
        except (KeyError, IndexError, TypeError):  # this round's plan has no such value (another model's digest)
            return None
        if text == record[PLAN_KEY]:  # the change left the plan as it was (nothing was told to the target alone)
            return None
        record[PLAN_KEY] = text
        lied.add(record.get("server-round"))
        return changed

    lied: set[int] = set()  # the rounds whose plan was changed for the target

    seen, grid = round_.run(lie)
    name = f"hospital-{target - 101:02d}"
    round_of = {m.metadata.message_id: next(r for r in m.content.values() if isinstance(r, ConfigRecord)).get(
        "server-round") for m in grid.sent}
    unmasked = {round_of.get(m.metadata.reply_to_message_id) for m in grid.replies
                if not m.has_error() and stage_of(m) == UNMASK}
    changed = [rnd for rnd in range(1, round_.rounds + 1)  # a round whose sum differs moves the next model
               if {h for h, r in seen if r == rnd} != {h for h, r in expected if r == rnd} or rnd not in unmasked]
    for (hospital, rnd), vector in seen.items():  # bit-identical, or not given (refused)
        if changed and rnd > changed[0]:
            continue  # trained from another model than the honest round's: nothing to compare with
        if kind == "plan" and hospital == name and rnd in lied:  # masked under a plan the others were not told
            asked = {m.metadata.message_id: m.metadata.dst_node_id for m in grid.sent
                     if stage_of(m) == UNMASK and round_of[m.metadata.message_id] == rnd}
            answers = {m.metadata.src_node_id: m for m in grid.replies if m.metadata.reply_to_message_id in asked}
            # every hospital in the sum refuses at the start of unmask (the survivors' signatures of the survivor
            # set and the plan do not all verify: the consistency check), so no share leaves; the reason names it
            assert sorted(answers) == sorted(asked.values()) and len(answers) == len({h for h, r in seen if r == rnd})
            assert all(m.has_error() and "the round plan" in str(m.error.reason) for m in answers.values()), \
                (what, how, {n: str(m.error.reason)[:200] if m.has_error() else "shares" for n, m in answers.items()})
            assert rnd not in unmasked, (kind, what, how, rnd)
            continue
        assert np.array_equal(vector, expected[hospital, rnd]), (hospital, rnd, kind, stage, what, how)
    return seen, lied


FAST = settings(max_examples=4, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
#: the long tier's sweep: 8 values per method and configuration keep it near ten minutes on CI's two cores (about 4 s
#: a value); FEDMED_SWEEP_EXAMPLES=120 is the longer sweep (about 8 minutes for each of the 20 cases)
SWEEP = settings(max_examples=int(os.environ.get("FEDMED_SWEEP_EXAMPLES", "8")), deadline=None, derandomize=True,
                 database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("method", list(METHODS))
@FAST
@given(data=st.data())
def test_a_lying_coordinator_changes_no_contribution_hardened(method, data):
    """Fast tier: the hardened policy, every method with a secure sum, a few values drawn from its messages."""
    check(method, True, data)


@FAST
@given(data=st.data())
def test_a_lying_coordinator_changes_no_contribution_as_shipped(data):
    """Fast tier: the deployment's shipped configuration (keys, the shipped policy with pinned peers), FedAvg."""
    check("fedavg", False, data)


@pytest.mark.slow
@pytest.mark.parametrize("hardened", [False, True], ids=["shipped", "hardened"])
@pytest.mark.parametrize("method", list(METHODS))
@SWEEP
@given(data=st.data())
def test_a_lying_coordinator_changes_no_contribution_sweep(method, hardened, data):
    check(method, hardened, data, twice=True)


# --- the attacks, each in the shipped configuration and with a hand-made hardened policy -----------------
CONFIGURATIONS = pytest.mark.parametrize("hardened", [False, True], ids=["shipped", "hardened"])
TARGET = 104  #: hospital T


def refusals(grid: LyingGrid) -> dict[int, str]:
    return {m.metadata.src_node_id: str(m.error.reason) for m in grid.replies if m.has_error()}


@CONFIGURATIONS
def test_setup_values_outside_the_plan_sent_to_all_but_t_reveal_nothing(tmp_path, hardened):
    """The issue's first attack: clipping range 2^100 and quantisation range 2 in the setup stage of every hospital
    but T (each would add exactly 1 per coordinate, and the sum less 3 would be T's vector). Those values are not
    the plan's, so every hospital told them refuses before masking, and nothing is unmasked."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    def lie(stage, node, content):
        if stage != "setup" or node == TARGET:
            return None
        content = change_config(content, "secagg." + Key.CLIPPING_RANGE, "missing")
        record = next(r for r in content.values() if isinstance(r, ConfigRecord))
        record["secagg." + Key.CLIPPING_RANGE], record["secagg." + Key.TARGET_RANGE] = float(2**100), 2
        return content

    seen, grid = Round("fedavg", hardened, tmp_path).run(lie)
    assert {name for name, _ in seen} <= {"hospital-03"}  # only T masked anything
    refused = refusals(grid)
    assert all("not the ones its setup stage sent" in refused[n] or "min-hospitals-per-sum" in refused[n]
               for n in (101, 102, 103)), refused
    assert not [m for m in grid.replies if not m.has_error() and stage_of(m) == UNMASK]


@CONFIGURATIONS
@pytest.mark.parametrize("variant", ["extra-record", "float64-tensor"])
def test_the_same_model_with_an_extra_record_or_another_dtype_is_not_a_new_model(tmp_path, hardened, variant):
    """The issue's second attack: the model of a sum already unmasked, sent again under a new run name with one
    more 1-float array record, or one tensor as float64. The replay memory keys on the model as training reads it
    (the plan's arrays, cast to the network's dtypes), so every hospital refuses to train from it again."""
    round_ = Round("fedavg", hardened, tmp_path)
    round_.base["message-arrays"] = "per-tensor"  # one Array per tensor, as the probe sent them
    first, _ = round_.run(run="first", state="hospitals")
    assert len(first) == HOSPITALS * round_.rounds

    def lie(stage, node, content):
        if stage != COLLECT:
            return None
        content = copied(content)
        record = next(r for r in content.values() if isinstance(r, ArrayRecord))
        name = next(iter(record))
        if variant == "extra-record":
            record["extra"] = Array(np.ones(1, np.float32))
        else:
            record[name] = Array(record[name].numpy().astype(np.float64))
        return content

    seen, grid = round_.run(lie, run="second", state="hospitals")
    assert seen == {}
    refused = refusals(grid)
    assert sorted(refused) == [101, 102, 103, 104]
    assert all("already helped unmask a sum trained from this model" in r for r in refused.values()), refused


def test_a_poisson_mean_numpy_cannot_sample_exactly_is_refused():
    """The issue's fourth attack, on its own: a plan whose Poisson mean is 2^58 per hospital (NumPy then returns
    multiples of 32) is refused, as is any scale or rounding bound the hospital does not derive itself; at the
    largest mean allowed the sampler's low bits still vary."""
    honest = ddp.plan(1.0, 4, 0.5, 6388, 2**62, 4)
    greedy = math.sqrt(2 * 2**58 * 4) / (1.0 * 0.5)  # mu / 2 = 2^58
    lying = {**honest.to_plan(), "scale": greedy, "rounded_bound": ddp.rounded_bound(0.5 * greedy, honest.padded)}
    with pytest.raises(ValueError, match="not what the hospital derives"):
        ddp.Parameters.from_plan({ddp.PLAN_KEY: lying})
    assert ddp.Parameters.from_plan({ddp.PLAN_KEY: honest.to_plan()}) == honest
    assert honest.local_variance <= ddp.MAX_LOCAL_VARIANCE * (1 + 1e-9)
    draws = np.random.default_rng(0).poisson(ddp.MAX_LOCAL_VARIANCE / 2, 4000)
    assert len(set((draws % 32).tolist())) == 32  # exact: every residue, not multiples of 32
    assert np.std(draws) == pytest.approx(math.sqrt(ddp.MAX_LOCAL_VARIANCE / 2), rel=0.05)


@CONFIGURATIONS
def test_noise_the_coordinator_shrinks_is_refused_before_training(tmp_path, hardened):
    """The issue's fourth attack over the grid: the distributed-DP plan told to every hospital with a scale whose
    Poisson mean is 2^58 (and a rounding bound to match). The hospitals derive both from the plan themselves, so
    every hospital refuses before it trains."""
    round_ = Round("fedavg-distributed-dp", hardened, tmp_path)
    if hardened:
        round_.policy.write_text(round_.policy.read_text() + "[distributed-dp]\nmin-noise-multiplier = 0.5\n"
                                 "max-dropped-or-colluding = 1\n")

    def lie(stage, node, content):
        if stage != COLLECT:
            return None
        content = copied(content)
        record = next(r for r in content.values() if isinstance(r, ConfigRecord) and PLAN_KEY in r)
        plan = json.loads(record[PLAN_KEY])
        dp = plan[ddp.PLAN_KEY]
        dp["scale"] = math.sqrt(2 * 2**58 * dp["hospitals"]) / (dp["noise_multiplier"] * dp["norm_bound"])
        dp["rounded_bound"] = ddp.rounded_bound(dp["norm_bound"] * dp["scale"], dp["padded"])
        record[PLAN_KEY] = plan_text(plan)
        return content

    seen, grid = round_.run(lie)
    assert seen == {}
    refused = refusals(grid)
    assert sorted(refused) == [101, 102, 103, 104]
    assert all("not what the hospital derives" in r for r in refused.values()), refused


def test_the_replay_memory_keys_on_the_model_as_training_reads_it():
    """Item 3 on its own: the canonical model is the plan's arrays cast to the network's dtypes; one more record,
    a tensor as float64 (even with values float32 cannot hold, which loading rounds away) is the same model; a
    changed or missing array is refused; a plan that widens a dtype is caught against the network after training."""
    from common.trust.secure_aggregation.hospital import (
        SecureAggregationRefusal,
        canonical_model,
        dtype_problem,
        model_description,
    )

    weights = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    model = {"model": {"w": weights, "n": np.array(3, np.int64)}}
    described = model_description(model)
    _, digest = canonical_model(model, described)
    extra = {"model": {**model["model"], "extra": np.ones(1, np.float32)}, "more": {"x": np.ones(1)}}
    wider = {"model": {**model["model"], "w": weights.astype(np.float64) + 1e-12}}
    assert canonical_model(extra, described)[1] == canonical_model(wider, described)[1] == digest
    with pytest.raises(SecureAggregationRefusal, match="not the round plan's"):
        canonical_model({"model": {**model["model"], "w": weights + np.float32(1e-3)}}, described)
    with pytest.raises(SecureAggregationRefusal, match="does not carry"):
        canonical_model({"model": {"w": weights}}, described)
    widened = model_description({"model": {**model["model"], "w": weights.astype(np.float64)}})
    assert "the network holds it as float32" in dtype_problem(widened, model)
    assert dtype_problem(described, model) is None


@pytest.mark.parametrize("variant", ["other-norm-layers", "other-shared-array"])
def test_fedbn_trains_from_its_shared_model_alone(tmp_path, monkeypatch, variant):
    """Item 3 for FedBN: a hospital keeps its own normalisation layers (its hospital half never loads the server's),
    so what a server sends for them is no training input. The model of a sum already unmasked, sent again under a
    new run name with normalisation layers of other values (described in the round plan, so the plan's model is
    another), is the same training input: every hospital refuses it as a replay, before it masks anything. The same
    model with one shared array changed is a new one: every hospital trains from it and adds to the sum."""
    from strategies.fedbn.norm_layers import split_norm_layers
    from strategies.fedbn.server import FedBNServer

    round_ = Round("fedbn", True, tmp_path)
    first, _ = round_.run(run="first", state="hospitals")
    assert len(first) == HOSPITALS
    shared_only = FedBNServer.downlink

    def downlink(self, rnd, hospital):
        payload = shared_only(self, rnd, hospital)
        model = dict(payload.arrays["model"])
        if variant == "other-norm-layers":
            norms = split_norm_layers(self.global_arrays, self.norm_names)[1]
            assert norms and not set(norms) & set(model)
            model.update({k: v + np.asarray(0.5, v.dtype) if v.dtype.kind == "f" else v for k, v in norms.items()})
        else:
            name = next(k for k, v in model.items() if v.dtype.kind == "f")
            model[name] = model[name] + np.asarray(1e-3, model[name].dtype)
        payload.arrays = {**payload.arrays, "model": model}
        return payload

    monkeypatch.setattr(FedBNServer, "downlink", downlink)
    seen, grid = round_.run(run="second", state="hospitals")
    refused = refusals(grid)
    if variant == "other-norm-layers":
        assert seen == {}
        assert sorted(refused) == [101, 102, 103, 104]
        assert all("already helped unmask a sum trained from this model" in r for r in refused.values()), refused
    else:
        assert sorted(seen) == [(f"hospital-{pid:02d}", 1) for pid in range(HOSPITALS)] and not refused


class Drawn:
    """Hypothesis's ``data`` with the values chosen: the check of the harness for one given change."""

    def __init__(self, **values):
        self.values = values

    def draw(self, strategy, label):
        return self.values[label]


@pytest.mark.parametrize("value", [("secagg.norm-bound",), ("secagg.train-config", "local-epochs")])
def test_a_plan_value_told_to_one_hospital_alone_is_refused_by_every_hospital_at_unmask(value):
    """Item 2's property for plan values the hospital told them accepts (within its policy's bounds): it masks under
    its plan, and every hospital in the sum refuses at the start of the unmask stage, where the consistency check
    (every survivor's signature of the survivor set and the plan) is verified, naming the round plan; no share
    leaves (``check`` asserts each; the drawn examples of the harness assert it for any plan value)."""
    seen, lied = check("fedavg", True, Drawn(value=("plan", COLLECT, value), hospital=3, change="other number"))
    assert 1 in lied and ("hospital-03", 1) in seen  # it masked under the plan told to it alone
