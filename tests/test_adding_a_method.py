"""docs/ARCHITECTURE.md's recipe for adding a method, followed to the letter: a toy method package written into a
temporary folder (FedAvg whose server counts the hospitals of each round against those connected, as FedDyn's
|P|/m does), registered by its line in ``METHOD_PACKAGES``, then run in one process, under secure aggregation and
under a hospital policy that names it; nothing else of fedmed is edited. The count is the trap the secure sum's
extension point once hid: it handed the method one stand-in hospital."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from common.methods import registry

from .test_secure_aggregation import SMALL_CLASSIFICATION, config_of

pytestmark = pytest.mark.usefixtures("one_thread")

#: the toy's package, file by file, as the recipe's steps 1 and 2 write one
TOY = {
    "__init__.py": '''
        """FedCount: FedAvg whose server counts the hospitals in each round's sum against those connected."""
        from common.methods.registry import TWO_D, MethodSpec

        METHODS = (MethodSpec("fedcount", TWO_D, server="fedcount.server:FedCountServer",
                              hospital="fedcount.hospital:FedCountHospital",
                              strategy="fedcount.strategy:FedCountStrategy",
                              summary="FedAvg, counting its hospitals (a test's toy)",
                              secure="common.trust.secure_aggregation.methods:MEAN_UPDATE",
                              privacy="common.methods.privacy:MODEL_UPDATE", flower_contract=True),)
        ''',
    "server.py": '''
        from common.methods.averaging import SampleWeightedAverage


        class FedCountServer(SampleWeightedAverage):
            name = "fedcount"
            connected = 0

            def hospitals_available(self, rnd, hospitals):
                self.connected = len(hospitals)

            def counted(self, count, samples):
                return {"in-sum": count, "connected": self.connected, "share": count / self.connected,
                        "samples": samples}

            def aggregate(self, rnd, updates):
                record = super().aggregate(rnd, updates)
                return {**record, **self.counted(len(updates), sum(u.num_examples for u in updates))}

            def aggregate_secure_mean(self, rnd, mean):
                record = super().aggregate_secure_mean(rnd, mean)
                return {**record, **self.counted(mean.count, mean.weight_total)}
        ''',
    "hospital.py": '''
        from common.methods.local_training import LocalTraining


        class FedCountHospital(LocalTraining):
            """FedAvg's local step."""
        ''',
    "strategy.py": '''
        from strategies.base import HospitalStrategy


        class FedCountStrategy(HospitalStrategy):
            method_name = "fedcount"
        ''',
}


@pytest.fixture
def toy_method(tmp_path, monkeypatch):
    """The toy package in a temporary folder on the import path, and its line in ``METHOD_PACKAGES``."""
    package = tmp_path / "toy" / "fedcount"
    package.mkdir(parents=True)
    for name, text in TOY.items():
        (package / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path / "toy"))
    monkeypatch.setattr(registry, "METHOD_PACKAGES", (*registry.METHOD_PACKAGES, "fedcount"))
    registry.methods.cache_clear()
    yield "fedcount"
    registry.methods.cache_clear()
    for module in [m for m in sys.modules if m == "fedcount" or m.startswith("fedcount.")]:
        del sys.modules[module]


def test_the_toy_method_runs_in_one_process_and_counts_its_hospitals(toy_method, tmp_path):
    from common.config import load_job_config
    from common.engine.inprocess import run_rounds, simulated_sites

    cfg = load_job_config({**SMALL_CLASSIFICATION, "strategy": toy_method, "num-server-rounds": 2,
                           "fraction-train": 0.5, "min-train-hospitals": 2, "run-name": "toy",
                           "results-dir": str(tmp_path / "results")})
    engine = run_rounds(cfg, simulated_sites(cfg, 4, tmp_path / "state"))
    for record in engine.history:
        counted = record["method"]
        assert counted["in-sum"] == len(record["aggregated"]) == 2 and counted["connected"] == 4
        assert counted["share"] == 0.5


def test_the_toy_method_counts_the_hospitals_of_a_secure_sum_under_a_policy_naming_it(toy_method, tmp_path):
    """Three hospitals whose policy allows the toy method: each secure round's server step is told the three in the
    sum and their samples as the protocol counts them, not one stand-in hospital."""
    from common.methods.registry import strategy_class

    from .fake_grid import FakeGrid
    from .test_secure_aggregation import secure_hospitals

    policy = tmp_path / "policy.toml"
    policy.write_text(f'methods = ["{toy_method}"]\nmin-hospitals-per-sum = 3\n')
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "secure", strategy=toy_method,
                       **{"secure-aggregation.enabled": True})
    strategy = strategy_class(toy_method)(min_train_nodes=3, min_available_nodes=3, run_config=config)
    grid = FakeGrid(secure_hospitals(config, 3, **{"policy-file": str(policy)}))
    strategy.start(grid, num_rounds=2)
    for record in strategy.engine.history:
        assert "skipped" not in record, record
        counted = record["method"]
        assert counted["in-sum"] == 3 == len(record["aggregated"]) and counted["connected"] == 3
        samples = sum(m["num-examples"] for m in record["hospital_metrics"].values())
        assert math.isclose(counted["samples"], samples, rel_tol=1e-4), (counted, samples)


def test_a_policy_that_does_not_name_the_toy_method_refuses_it(toy_method, tmp_path):
    from common.methods.registry import strategy_class

    from .fake_grid import FakeGrid
    from .test_secure_aggregation import secure_hospitals

    policy = tmp_path / "policy.toml"
    policy.write_text('methods = ["fedavg"]\n')
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "refused", strategy=toy_method,
                       **{"secure-aggregation.enabled": True})
    strategy = strategy_class(toy_method)(min_train_nodes=3, min_available_nodes=3, run_config=config)
    grid = FakeGrid(secure_hospitals(config, 3, **{"policy-file": str(policy)}))
    strategy.start(grid, num_rounds=1)
    assert strategy.engine.history == [] or "skipped" in strategy.engine.history[0]
    refusals = [m for m in grid.replies if m.has_error()]
    assert refusals and all(toy_method in m.error.reason for m in refusals), [m.error.reason for m in refusals]


def test_a_server_that_changes_the_mean_must_say_what_it_does_with_a_secure_sum(monkeypatch):
    """The trap closed: a FedAvg-family server with its own ``aggregate`` and no ``aggregate_secure_mean`` is refused
    when it is written, and a server naming FedAvg's secure sum without taking its mean is refused before round 1."""
    from common.methods.averaging import SampleWeightedAverage
    from common.methods.base import ServerMethod
    from common.trust.secure_aggregation.methods import MEAN_UPDATE

    with pytest.raises(TypeError, match="aggregate_secure_mean"):
        type("FedDynLike", (SampleWeightedAverage,), {"aggregate": lambda self, rnd, updates: {}})

    class Job:
        strategy = "elsewhere"

    class Silent(ServerMethod):
        def aggregate(self, rnd, updates):
            return {}

    monkeypatch.setattr(registry, "server_class", lambda name: Silent)
    assert "aggregate_secure_mean" in MEAN_UPDATE.refuse(Job())
