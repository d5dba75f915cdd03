"""``fedmed demo`` (cli/demo.py): its job is valid and its hospitals' data differ; the comparison of local
training, FedAvg and FedProIn is computed, written and plotted from the runs' records (here on a tiny job with the
federated runs in this process, seconds instead of the demo's minutes in Flower); a failed run stops it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli.demo import DEMO_RUN_CONFIG, FEDERATED, LOCAL, demo_run_config, run_demo
from common.config import load_job_config
from common.engine.inprocess import run_rounds, simulated_sites
from common.methods.site import HospitalStateStore

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"model": "small-cnn", "image-size": 16, "synthetic-samples": 160, "batch-size": 16,
        "min-partition-size": 10, "dirichlet-alpha": 1.0}


def test_the_demo_job_is_valid_and_each_hospital_holds_mostly_two_of_the_four_classes(tmp_path):
    cfg = load_job_config(demo_run_config(DEMO_RUN_CONFIG["num-server-rounds"], 42, tmp_path))
    counts = [np.bincount(site.train.labels, minlength=4) for site in simulated_sites(cfg, 3)]
    for count in counts:
        assert np.sort(count)[-2:].sum() >= 0.9 * count.sum(), counts  # non-IID: two classes make up >= 90 %
    assert (np.sum(counts, axis=0) > 0).all()  # together they hold every class the test set asks for


def in_process(hospitals: int):
    """The demo's federated runs in this process (common.engine.inprocess), as the Flower runs would record them."""
    def federate(strategy: str, run_config: dict) -> tuple[int, list[dict]]:
        cfg = load_job_config({**run_config, "strategy": strategy, "run-name": strategy})
        sites = simulated_sites(cfg, hospitals)
        for site in sites:
            site.state = HospitalStateStore(None, keep=1)
        return 0, run_rounds(cfg, sites).history

    return federate


def table_rows(text: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_the_comparison_of_local_training_fedavg_and_fedproin_is_written_printed_and_plotted(tmp_path, capsys):
    torch.manual_seed(0)
    out = tmp_path / "demo"
    assert run_demo(2, 2, 7, out, in_process(2), overrides=TINY) == 0
    printed = capsys.readouterr().out
    written = (out / "comparison.md").read_text()
    assert written in printed
    rows = table_rows(written)
    assert list(rows) == [LOCAL, *FEDERATED.values()]

    record = json.loads((out / "comparison.json").read_text())
    histories = record["histories"]
    assert record["run-config"]["dirichlet-alpha"] == 1.0 and record["run-config"]["seed"] == 7
    for name, cells in rows.items():
        final = histories[name][-1]
        assert final["round"] == 2 and cells[0] == "2"
        assert cells[1:4] == [f"{final['test'][m]:.3f}" for m in ("accuracy", "f1_weighted", "mcc")], name
    local = histories[LOCAL][-1]
    own = [m["accuracy"] for m in local["per_hospital"].values()]
    assert len(own) == 2 and local["test"]["accuracy"] == pytest.approx(np.mean(own))  # the mean of each alone
    assert rows[LOCAL][4] == f"{min(own):.3f} to {max(own):.3f}"
    assert rows["FedAvg"][4] == "one model for all"

    # local training ran on exactly the hospitals the federated runs had (the same split of the same data)
    fedavg_sizes = {h: m["num-examples"] for h, m in histories["FedAvg"][0]["hospital_metrics"].items()}
    cfg = load_job_config({**record["run-config"], "strategy": "fedavg"})
    assert fedavg_sizes == {s.name: len(s.train) for s in simulated_sites(cfg, 2)}
    assert all(r["train"]["val-loss"] > 0 for r in histories[LOCAL])

    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_federated_run_that_fails_stops_the_demo_with_its_exit_code_and_no_comparison(tmp_path, capsys):
    calls = []

    def failing(strategy, run_config):
        calls.append(strategy)
        return 124, []

    assert run_demo(3, 2, 0, tmp_path, failing, overrides=TINY) == 124
    assert calls == ["fedavg"] and not (tmp_path / "comparison.md").exists()
    assert "the FedAvg run did not complete" in capsys.readouterr().err
