"""Distributed DP under secure aggregation (issue 58), the mechanism and its accountant: every hospital's integer
share of Skellam noise adds up to the sum's noise, the sum stays exact otherwise, and what a hospital counts for a
sum is checked against independent computations (the Rényi divergence of the Skellam distribution itself, and
Google's dp-accounting for the Gaussian case)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from common.trust.secure_aggregation import distributed_dp as ddp

pytestmark = pytest.mark.usefixtures("one_thread")


def contributions(count: int, dimension: int, norm: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    vectors = []
    for _ in range(count):
        vector = rng.normal(size=dimension)
        vectors.append(vector * norm * rng.uniform(0.5, 1.5) / np.linalg.norm(vector))  # some above the bound
    return vectors


def noised_sum(vectors, params, seed=1):
    rng = np.random.default_rng(seed)
    total = np.zeros(params.padded, dtype=np.int64)
    for vector in vectors:
        total = np.mod(total + ddp.privatize(vector, params, rng), params.modulus)  # what unmasking gives
    return ddp.decode(total, params)


def clipped(vector, bound):
    norm = np.linalg.norm(vector)
    return vector * min(1.0, bound / norm)


def test_the_rotation_keeps_lengths_and_is_undone():
    params = ddp.plan(1.0, 4, 1.0, 1000, 2**32, 4)
    assert params.padded == 1024
    vector = np.random.default_rng(2).normal(size=1000)
    turned = ddp.rotate(vector, params)
    assert np.linalg.norm(turned) == pytest.approx(np.linalg.norm(vector))
    assert np.abs(turned).max() < 5 * np.linalg.norm(vector) / math.sqrt(1024)  # spread over every coordinate
    np.testing.assert_allclose(ddp.unrotate(turned, params), vector, atol=1e-12)


@pytest.mark.parametrize("count", [3, 10])
def test_the_noised_sum_is_the_plain_sum_plus_noise_of_the_stated_variance(count):
    """The statistical test the issue asks for: the decoded sum minus the sum of the clipped contributions is
    normal with standard deviation z x C on every coordinate (Kolmogorov-Smirnov), mean 0."""
    z, bound, dimension = 0.8, 2.0, 3000
    params = ddp.plan(z, count, bound, dimension, 2**32, count)
    vectors = contributions(count, dimension, bound)
    residual = noised_sum(vectors, params) - sum(clipped(v, bound) for v in vectors)
    assert stats.kstest(residual / (z * bound), "norm").pvalue > 1e-3
    assert abs(residual.mean()) < 5 * z * bound / math.sqrt(dimension)
    assert residual.std() == pytest.approx(z * bound, rel=0.06)


def test_without_noise_worth_the_name_the_sum_is_the_clipped_sum_and_aligned_vectors_do_not_wrap():
    """Ten contributions all pointing the same way at the norm bound (the worst case for the modulus): the sum
    decodes to theirs, within the (tiny) noise and rounding."""
    count, bound, dimension = 10, 1.0, 500
    params = ddp.plan(1e-6, count, bound, dimension, 2**32, count)
    direction = np.random.default_rng(4).normal(size=dimension)
    vectors = [direction / np.linalg.norm(direction) * bound] * count
    np.testing.assert_allclose(noised_sum(vectors, params), sum(vectors), atol=1e-5)


def renyi(alpha: int, mu: float, shift: int) -> float:
    """D_alpha(Sk(shift, mu) || Sk(0, mu)) of the one-dimensional Skellam distribution, summed over its support."""
    k = np.arange(-int(30 * math.sqrt(mu)) - 30, int(30 * math.sqrt(mu)) + 30 + shift)
    p = stats.skellam.logpmf(k - shift, mu / 2, mu / 2)
    q = stats.skellam.logpmf(k, mu / 2, mu / 2)
    terms = alpha * p + (1 - alpha) * q
    return float(np.logaddexp.reduce(terms[np.isfinite(terms)]) / (alpha - 1))


@pytest.mark.parametrize("mu,shift", [(20.0, 1), (200.0, 3), (2000.0, 10)])
@pytest.mark.parametrize("alpha", [2, 4, 16])
def test_the_skellam_bound_holds_against_the_distributions_own_renyi_divergence(mu, shift, alpha):
    exact = renyi(alpha, mu, shift)
    bound = ddp.skellam_rdp(alpha, mu, shift, shift)  # one dimension: L1 = L2 = the shift
    assert exact <= bound * (1 + 1e-9)
    assert bound <= 1.6 * exact + 1e-3  # and it is not a loose one


def test_the_gaussian_accounting_is_googles():
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting import rdp

    for z, rounds in ((1.0, 10), (0.5, 3), (2.0, 100)):
        accountant = rdp.RdpAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(z), rounds)
        theirs = accountant.get_epsilon(1e-5)
        ours = ddp.epsilon([{"mechanism": "gaussian", "noise-multiplier": z}] * rounds, 1e-5)
        assert theirs <= ours <= theirs * 1.05 + 1e-6  # integer orders only: never below, hardly above


def test_a_skellam_sum_costs_what_the_gaussian_with_its_effective_multiplier_costs():
    """With a large scale the Skellam sum's epsilon is the Gaussian mechanism's of noise multiplier z_eff / 2
    (z_eff: the noise of the honest shares only, over a sensitivity of 2C): the figure docs/privacy.md reports."""
    params = ddp.plan(1.0, 10, 1.0, 10_000, 2**32, 10)
    for honest in (10, 4):
        skellam = ddp.epsilon([ddp.release(params, honest)] * 5, 1e-5)
        z = ddp.effective_noise_multiplier(params, honest)
        gaussian = ddp.epsilon([{"mechanism": "gaussian", "noise-multiplier": z / 2}] * 5, 1e-5)
        assert gaussian <= skellam <= gaussian * 1.01
    assert ddp.epsilon([ddp.release(params, 4)], 1e-5) > ddp.epsilon([ddp.release(params, 10)], 1e-5)
    assert ddp.epsilon([ddp.release(params, 10), {"noise-multiplier": None}], 1e-5) == math.inf


def test_plan_parameters_travel_and_are_checked():
    params = ddp.plan(1.2, 5, 0.5, 777, 2**32, 6)
    assert ddp.Parameters.from_plan({ddp.PLAN_KEY: params.to_plan()}) == params
    assert ddp.Parameters.from_plan({}) is None
    with pytest.raises(ValueError, match="not what the hospital derives"):
        ddp.Parameters.from_plan({ddp.PLAN_KEY: {**params.to_plan(), "padded": 512}})
    with pytest.raises(ValueError, match="no room"):
        ddp.plan(1.0, 4, 1.0, 100, 16, 4)


# --- over the grid: the differencing attack of issue 58 -------------------------------------------------------------
POLICY = """min-hospitals-per-sum = 3
[distributed-dp]
min-noise-multiplier = 0.5
max-dropped-or-colluding = 1
delta = 1e-5
"""


def test_two_sums_differenced_reveal_no_more_of_a_hospital_than_the_noise_allows(tmp_path, monkeypatch):
    """The issue's attack against hospitals with distributed DP on: run 1 with all four hospitals, then a second run
    under a new name whose model differs by one unit in the last place of one weight, hospital T left out. The
    difference of the two sums is T's contribution plus two sums' noise: its correlation with T's contribution is
    what that noise allows (and far from the 0.99996 of noiseless sums), and every hospital's ledger counts the
    epsilon of each sum it was in."""
    import copy
    import importlib
    import json

    from common.trust.ledger import PrivacyLedger
    from common.trust.secure_aggregation.messages import OWN_NAME_KEY
    from strategies import FedAvgStrategy
    from strategies.records import arrays_of, into_arrayrecord
    from strategies.secure_aggregation import with_secure_aggregation

    from .fake_grid import FakeGrid
    from .test_secure_aggregation import SMALL_CLASSIFICATION, config_of, secure_node

    module = importlib.import_module("strategies.fedavg.secure")
    honest, seen = module.SECURE.contribution, {}

    def recording(received, reply, params, layout):
        values, metrics = honest(received, reply, params, layout)
        seen.setdefault(params[OWN_NAME_KEY], []).append({k: np.asarray(v, np.float64) for k, v in values.items()})
        return values, metrics

    monkeypatch.setattr(module.SECURE, "contribution", recording)
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    secure = {"secure-aggregation.distributed-dp": "skellam", "secure-aggregation.noise-multiplier": 1.0,
              "secure-aggregation.update-norm-bound": 0.5, "state-dir": str(tmp_path / "hospitals")}
    sums, clear = [], []  #: the unmasked sums; the metrics each masked reply carried in the clear

    def run(name: str, count: int, initial=None):
        config = config_of(tmp_path, SMALL_CLASSIFICATION, name, **secure)
        strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
        apply = strategy.secure_aggregation.method.apply

        def seeing(method, rnd, sums_, plan, updates):
            sums.append({k: np.asarray(v, np.float64) for k, v in sums_.items()})
            return apply(method, rnd, sums_, plan, updates)

        strategy.secure_aggregation.method = copy.copy(strategy.secure_aggregation.method)  # not the shared one
        strategy.secure_aggregation.method.apply = seeing
        nodes = {101 + pid: secure_node(config, {"partition-id": pid, "num-partitions": 4,
                                                 "policy-file": str(policy)}, 101 + pid) for pid in range(count)}
        grid = FakeGrid(nodes)
        strategy.start(grid, initial_arrays=initial, num_rounds=1)
        assert "skipped" not in strategy.engine.history[0], strategy.engine.history[0]
        masked = [m.content["metrics"] for m in grid.replies if not m.has_error()
                  and m.content.config_records.get("config", {}).get("secagg.stage") == "collect_masked_vectors"]
        clear.extend(set(metrics) for metrics in masked)
        return strategy

    first = run("first", 4)
    model = arrays_of(first.initial_arrays())
    name = next(k for k, v in model.items() if v.dtype.kind == "f")
    nudged = {k: v.copy() for k, v in model.items()}
    flat = nudged[name].reshape(-1)
    flat[0] = np.nextafter(flat[0], np.inf)  # one unit in the last place: a new model to the replay memory
    run("second", 3, into_arrayrecord(nudged))

    def model_vector(values):
        return np.concatenate([values[k].ravel() for k in sorted(values) if k.startswith("model/")])

    # under distributed DP a hospital's training loss, validation scores and clipping flag stay with it (outside
    # epsilon otherwise): only the counts the server checks leave in the clear, unless its policy releases more
    assert len(clear) == 7 and all(keys <= {"num-examples", "server-round"} for keys in clear), clear

    target = model_vector(seen["hospital-03"][0])
    difference = model_vector(sums[0]) - model_vector(sums[1])
    size, noise = difference.size, np.sqrt(2) * 1.0 * 0.5  # two sums' noise, std z C each
    expected = np.linalg.norm(target) / np.sqrt(np.linalg.norm(target) ** 2 + size * noise ** 2)
    measured = float(np.corrcoef(difference, target)[0, 1])
    print(f"difference vs T: correlation {measured:.4f}, the noise allows {expected:.4f}, {size} values")
    assert measured < expected + 5 / np.sqrt(size) and measured < 0.1, (measured, expected)
    assert np.std(difference - target) == pytest.approx(noise, rel=0.05)  # the noise the sums carry, as stated

    from common.trust.secure_aggregation import distributed_dp as ddp

    for pid, sums_in in ((0, 2), (3, 1)):
        ledger = PrivacyLedger(tmp_path / "hospitals" / f"hospital-{pid:02d}")
        releases = [json.loads(json.dumps(r)) for r in ledger.releases()]
        assert [r["run"] for r in releases] == ["first", "second"][:sums_in]
        assert all(r["distributed-dp"]["mechanism"] == "skellam" for r in releases)
        assert ledger.epsilon(1e-5) == pytest.approx(ddp.epsilon([r["distributed-dp"] for r in releases], 1e-5))
    assert PrivacyLedger(tmp_path / "hospitals" / "hospital-00").epsilon(1e-5) > \
        PrivacyLedger(tmp_path / "hospitals" / "hospital-03").epsilon(1e-5)  # two sums cost more than one


@pytest.mark.parametrize("round_kind,why", [
    ("less noise", "below its min-noise-multiplier=0.5"),
    ("no noise", "not part of a secure sum with distributed DP"),
    ("plain", "not part of a secure sum with distributed DP"),
    ("budget", "privacy budget spent"),
])
def test_a_hospital_requiring_distributed_dp_refuses_less_before_training(tmp_path, round_kind, why):
    """The hospital insists: a plan whose noise, counted from the honest hospitals its policy assumes, is below its
    minimum, a secure round without noise, and a plain round are refused before anything trains; so is one more
    sum past max-epsilon."""
    from strategies import FedAvgStrategy
    from strategies.secure_aggregation import with_secure_aggregation

    from .fake_grid import FakeGrid
    from .test_secure_aggregation import SMALL_CLASSIFICATION, config_of, secure_node

    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.replace('delta = 1e-5', 'delta = 1e-5\nmax-epsilon = 1.0'))
    # its peers are not pinned, so it counts its own share alone: 0.6 x sqrt(1/3) = 0.35 < 0.5; 1.0 x sqrt(1/3) = 0.58
    noise = {"less noise": 0.6, "budget": 1.0}.get(round_kind)
    extra = {"secure-aggregation.update-norm-bound": 0.5}
    if noise is not None:
        extra.update({"secure-aggregation.distributed-dp": "skellam", "secure-aggregation.noise-multiplier": noise})
    config = config_of(tmp_path, SMALL_CLASSIFICATION, round_kind.replace(" ", "-"), **extra)
    kind = FedAvgStrategy if round_kind == "plain" else with_secure_aggregation(FedAvgStrategy)
    strategy = kind(min_train_nodes=2, run_config=config)
    nodes = {101 + pid: secure_node(config, {"partition-id": pid, "num-partitions": 3, "policy-file": str(policy)},
                                    101 + pid) for pid in range(3)}
    grid = FakeGrid(nodes)
    strategy.start(grid, num_rounds=1)
    record = strategy.engine.history[0]
    reasons = {**record.get("refused", {}), **record.get("secure-aggregation", {}).get("lost", {})}
    assert sorted(reasons) == ["hospital-00", "hospital-01", "hospital-02"], record
    assert all(why in reason for reason in reasons.values()), reasons
    assert not any(m.content.config_records.get("config", {}).get("secagg.stage") == "collect_masked_vectors"
                   for m in grid.replies if not m.has_error())  # no masked update left a hospital


def test_distributed_dp_with_a_sum_of_more_than_a_model_update_is_refused_naming_the_methods_it_runs_with():
    """FedProIn sums counts beside its update, which the noise does not cover: refused when the strategy is built,
    naming every method whose secure sum distributed DP noises (from the registry)."""
    from common.settings import ConfigError
    from common.trust.secure_aggregation.methods import distributed_dp_method_names, secure_method
    from strategies import FedProInStrategy

    names = distributed_dp_method_names()
    assert "fedproin" not in names and all(secure_method(name).distributed_dp for name in names)
    with pytest.raises(ConfigError, match=f"it runs with {', '.join(names)}$"):
        FedProInStrategy(run_config={"secure-aggregation.enabled": True, "secure-aggregation.distributed-dp": "skellam",
                                     "secure-aggregation.update-norm-bound": 1.0})
