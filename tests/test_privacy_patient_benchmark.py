"""Bookkeeping of the patient-level DP-SGD benchmark (benchmarks/privacy/patient.py): each DP row is measured against
the no-DP run that trains the same layers, so a head trained alone under DP is not held to a network trained whole."""

from __future__ import annotations

import json
from types import SimpleNamespace

from benchmarks.privacy import patient


def record(start: str, epsilon: float | None, accuracy: float) -> dict:
    return {"dataset": "blood", "partition": "dirichlet", "method": "fedavg", "start": start, "epsilon": epsilon,
            "seed": 0, "trick": "", "test": {"accuracy": accuracy}, "spent": epsilon, "load": 1.0}


def test_each_start_has_its_own_no_dp_row_and_its_dp_rows_are_a_share_of_that_row(tmp_path):
    args = SimpleNamespace(datasets=["blood"], partitions=["dirichlet"], methods=["fedavg"],
                           starts=["pretrained", "pretrained-head"], epsilons=[8.0], seeds=[0], tricks=False,
                           trick=[], hospitals=[10])
    names = [name for name, _ in patient.rows(args)]
    assert names == ["blood-dirichlet-fedavg-pretrained-nodp-seed0", "blood-dirichlet-fedavg-pretrained-eps8-seed0",
                     "blood-dirichlet-fedavg-pretrained-head-nodp-seed0",
                     "blood-dirichlet-fedavg-pretrained-head-eps8-seed0"]
    (tmp_path / "runs").mkdir()
    for rec in (record("pretrained", None, 0.8), record("pretrained-head", None, 0.4),
                record("pretrained-head", 8.0, 0.38)):
        (tmp_path / "runs" / f"{patient.name(rec)}.json").write_text(json.dumps(rec))
    table = patient.report(tmp_path, "test")
    head = next(line for line in table.splitlines() if "| pretrained-head |" in line)
    whole = next(line for line in table.splitlines() if "| pretrained |" in line)
    assert "| 10 | 0.400 (n=1) |" in head and "0.380 (n=1) [95%], eps 8.00" in head  # not 48 % of the whole network's
    assert "| 0.800 (n=1) | not run | not run | not run |" in whole
    assert patient.NO_PRIVACY.max_grad_norm >= 1e6 and patient.NO_PRIVACY.noise_multiplier * 1e6 <= 1e-3


def test_tricks_run_on_each_partition_asked_and_each_is_measured_against_its_own_partitions_plan(tmp_path):
    args = SimpleNamespace(datasets=["blood"], partitions=["iid"], methods=["fedavg"], starts=["scratch"],
                           epsilons=[8.0], seeds=[0], tricks=True, trick=["parameter averaging"],
                           tricks_on=["iid", "dirichlet"], hospitals=[10])
    names = [name for name, _ in patient.rows(args)]
    assert names[-2:] == ["blood-iid-fedavg-scratch-eps8-parameter-averaging-0.9-seed0",
                          "blood-dirichlet-fedavg-scratch-eps8-parameter-averaging-0.9-seed0"]
    (tmp_path / "runs").mkdir()
    runs = [("iid", "", 0.6), ("iid", "parameter averaging 0.9", 0.5), ("dirichlet", "", 0.2),
            ("dirichlet", "parameter averaging 0.9", 0.35)]
    for partition, trick, accuracy in runs:
        rec = {**record("scratch", 8.0, accuracy), "partition": partition, "trick": trick}
        (tmp_path / "runs" / f"{patient.name(rec)}.json").write_text(json.dumps(rec))
    table = patient.report(tmp_path, "test")
    iid, dirichlet = table.split("(blood cells, IID,")[1], table.split("(blood cells, Dir(0.5),")[1]
    assert "| parameter averaging 0.9 | 0.500 (n=1) | -0.100 (the plan's same seeds) |" in iid.split("What each")[0]
    assert "| parameter averaging 0.9 | 0.350 (n=1) | +0.150 (the plan's same seeds) |" in dirichlet


def test_fewer_hospitals_are_rows_of_their_own_each_measured_against_its_own_no_dp_run(tmp_path):
    """The same patients split between fewer hospitals (more patients each, so more amplification by sampling) are
    other rows, never averaged with the ten-hospital runs; runs recorded before the column existed count as ten."""
    args = SimpleNamespace(datasets=["blood"], partitions=["iid"], methods=["fedavg"], starts=["scratch"],
                           epsilons=[8.0], seeds=[0], tricks=False, trick=[], hospitals=[1, 10])
    rows = dict(patient.rows(args))
    assert list(rows) == ["blood-iid-fedavg-scratch-1hospitals-nodp-seed0", "blood-iid-fedavg-scratch-nodp-seed0",
                          "blood-iid-fedavg-scratch-1hospitals-eps8-seed0", "blood-iid-fedavg-scratch-eps8-seed0"]
    cfg = patient.job("blood", "iid", "scratch", 0, patient.PLAN, rows["blood-iid-fedavg-scratch-1hospitals-eps8-seed0"]
                      ["hospitals"])
    assert cfg.min_train_hospitals == cfg.min_available_hospitals == 1
    (tmp_path / "runs").mkdir()
    old = {**record("scratch", None, 0.8), "partition": "iid"}  # recorded before the column: no "hospitals"
    for rec in (old, {**old, "epsilon": 8.0, "spent": 8.0, "test": {"accuracy": 0.6}},
                {**old, "hospitals": 1, "test": {"accuracy": 0.9}},
                {**old, "hospitals": 1, "epsilon": 8.0, "spent": 8.0, "test": {"accuracy": 0.81}}):
        (tmp_path / "runs" / f"{patient.name(rec)}.json").write_text(json.dumps(rec))
    table = patient.report(tmp_path, "test").splitlines()
    assert "| blood | iid | fedavg | scratch | 1 | 0.900 (n=1) | not run | not run | 0.810 (n=1) [90%], eps 8.00 |" \
        in table
    assert "| blood | iid | fedavg | scratch | 10 | 0.800 (n=1) | not run | not run | 0.600 (n=1) [75%], eps 8.00 |" \
        in table


def test_a_dp_row_whose_model_predicts_one_class_says_so_beside_its_share(tmp_path):
    """HAM10000's nevi are two thirds of it: a model that calls every lesion a nevus keeps a weighted F1 near 0.54,
    which as a share of the no-DP row reads like a model that learnt; the cell names the runs that predict one class."""
    (tmp_path / "runs").mkdir()
    base = {**record("scratch", None, 0.0), "dataset": "ham10000", "partition": "iid"}
    runs = [{**base, "test": {"f1_weighted": 0.68, "mcc": 0.39}},
            {**base, "epsilon": 8.0, "spent": 8.0, "test": {"f1_weighted": 0.54, "mcc": 0.0}},
            {**base, "epsilon": 8.0, "spent": 8.0, "seed": 1, "test": {"f1_weighted": 0.56, "mcc": 0.05}}]
    for rec in runs:
        (tmp_path / "runs" / f"{patient.name(rec)}.json").write_text(json.dumps(rec))
    row = next(line for line in patient.report(tmp_path, "test").splitlines() if line.startswith("| ham10000"))
    assert "| 0.680 (n=1) |" in row
    assert "| 0.550 ± 0.014 (n=2, 1 of 2 one class) [81%], eps 8.00 |" in row
