"""Reference points for federated methods, in the same harness, on the same data, with the same budget.

SOLO: every hospital trains alone; the reported metrics are the mean over hospitals of each one's
test metrics. Centralised: all hospitals' training data pooled in one place. Both use FedAvg's
local step on a single site for round(rounds * fraction-train) rounds of local-epochs each, which
is the number of local epochs a hospital spends in the federated run on average (SOLO), or the
federated run's total compute (centralised). Round r of a reference is thus worth round
r / fraction-train of the federated run.
"""

from __future__ import annotations

from typing import Any

from common.config import JobConfig
from common.data.containers import concat
from common.engine.inprocess import run_rounds
from common.engine.round_engine import RoundEngine, weighted_mean_metrics
from common.methods.site import Site


def reference_config(cfg: JobConfig) -> JobConfig:
    """The job on a single site: FedAvg's local step, round(rounds * fraction-train) rounds."""
    rounds = max(1, round(cfg.num_server_rounds * cfg.fraction_train))
    return cfg.model_copy(update={"strategy": "fedavg", "num_server_rounds": rounds, "fraction_train": 1.0,
                                  "min_train_hospitals": 1, "min_available_hospitals": 1})


def train_alone(cfg: JobConfig, site: Site, test_data: Any) -> list[dict[str, Any]]:
    single = reference_config(cfg)
    return run_rounds(single, [site], RoundEngine(single, test_data=test_data)).history


def run_solo(cfg: JobConfig, sites: list[Site], test_data: Any) -> list[dict[str, Any]]:
    """Each hospital alone; per evaluated round, the mean over hospitals of their test metrics."""
    histories = {site.name: train_alone(cfg, site, test_data) for site in sites}
    records = []
    for index, first in enumerate(next(iter(histories.values()))):
        if "test" not in first:
            continue
        per_hospital = {name: history[index]["test"] for name, history in histories.items()}
        records.append({"round": first["round"],
                        "test": weighted_mean_metrics([(1.0, m) for m in per_hospital.values()]),
                        "per_hospital": per_hospital})
    return records


def pooled_site(sites: list[Site]) -> Site:
    """One site holding every hospital's training and validation data."""
    return Site("centralised", concat([s.train for s in sites]), concat([s.val for s in sites]), sites[0].device,
                seed=sites[0].seed)


def run_centralised(cfg: JobConfig, sites: list[Site], test_data: Any) -> list[dict[str, Any]]:
    return train_alone(cfg, pooled_site(sites), test_data)
