"""The FedProIn benchmark's bookkeeping: job configs per method, the Table-1 summary and the round scale."""

from __future__ import annotations

import json

import pytest

from benchmarks.fedproin.report import (
    ablation_table,
    curves,
    late_test,
    paired_differences,
    shift_table,
    table,
    write_report,
)
from benchmarks.fedproin.run import ABLATIONS, METHODS, PRESETS, PROTOCOL, job_config
from common.config import JobConfig


def run_record(method, partition, seed, accuracy, f1, mcc, rounds=(2, 4)):
    history = [{"round": r, "test": {"accuracy": accuracy * r / rounds[-1], "f1_weighted": f1, "mcc": mcc}}
               for r in rounds]
    return {"method": method, "partition": partition, "seed": seed, "seconds": 120.0,
            "config": {"fraction-train": 0.5}, "history": history}


def test_table_reports_mean_and_std_of_the_final_round_over_seeds():
    runs = [run_record("FedProIn", "dirichlet", 0, 0.6, 0.5, 0.30),
            run_record("FedProIn", "dirichlet", 1, 0.8, 0.7, 0.40),
            run_record("FedAvg", "dirichlet", 0, 0.7, 0.6, 0.25)]
    runs[0]["history"][-1]["method"] = {"prototype-usage": [[3, 0], [0, 1]]}  # two prototypes nobody chose
    runs[1]["history"][0]["method"] = {"prototype-usage": [[0, 0], [0, 1]]}  # an earlier round: not the last
    runs[1]["history"][-1]["method"] = {"prototype-usage": [[3, 2], [4, 1]]}
    text = table(runs, ["FedAvg", "FedProIn", "MOON"], ["dirichlet"])
    lines = text.splitlines()
    assert lines[0] == ("| method | Dir(0.5) Acc (%) | Dir(0.5) W-F1 (%) | Dir(0.5) MCC | "
                        "unused prototypes, last round (Dir(0.5)) | seeds | minutes / run |")
    assert lines[2] == "| FedAvg | 70.0 | 60.0 | 0.250 | - | 0 | 2.0 |"
    assert lines[3] == "| FedProIn | 70.0 ± 10.0 | 60.0 ± 10.0 | 0.350 ± 0.050 | 1.0 | 0,1 | 2.0 |"
    assert lines[4] == "| MOON | - | - | - | - | - | - |"


def test_the_steadier_score_averages_the_last_three_evaluated_rounds_only():
    run = run_record("FedProIn", "dirichlet", 0, 0.8, 0.5, 0.3, rounds=(2, 4, 6, 8))
    for record, mcc in zip(run["history"], (0.9, 0.1, 0.2, 0.6)):
        record["test"]["mcc"] = mcc
    run["history"].append({"round": 9})  # not evaluated: not counted
    late = late_test(run)
    assert late["mcc"] == pytest.approx(0.3) and late["accuracy"] == pytest.approx(0.8 * 6 / 8)
    lines = table([run], ["FedProIn"], ["dirichlet"], score=late_test).splitlines()
    assert lines[2].startswith("| FedProIn | 60.0 | 50.0 | 0.300 |")


def test_references_are_plotted_on_the_federated_round_scale():
    runs = [run_record("SOLO", "iid", 0, 0.5, 0.4, 0.2, rounds=(5,)), run_record("FedAvg", "iid", 0, 0.6, 0.5, 0.3)]
    rounds, accuracy = curves(runs, "SOLO", "iid", "accuracy")
    assert rounds.tolist() == [10.0] and accuracy.tolist() == [0.5]  # 5 rounds with all data = 10 at 50 %
    assert curves(runs, "FedAvg", "iid", "accuracy")[0].tolist() == [2, 4]


def test_job_configs_share_the_protocol_and_apply_each_methods_overrides():
    base = {**PROTOCOL, **PRESETS["cpu"]["job"], "partitioner": "dirichlet", "seed": 1}
    no_nia = job_config(base, *ABLATIONS["FedProIn no NIA"])
    assert (no_nia.strategy == "fedproin" and no_nia.fedproin.aggregation == "fedavg"
            and no_nia.fedproin.fdl_weight == 1.0)
    # the table's FedProIn rows are the paper's (MCEL) unless a row says otherwise; the platform's default is DCE
    assert JobConfig().fedproin.task_loss == "dce" and not JobConfig().fedproin.class_balanced
    paper = job_config(base, *METHODS["FedProIn"]).fedproin
    assert paper.task_loss == "mcel" and paper.class_balanced and paper.class_augmentation
    assert job_config(base, *ABLATIONS["FedProIn DCE"]).fedproin.task_loss == "dce"
    # the row the docs call "FedProIn, defaults" is the platform's FedProIn as shipped, field for field
    defaults_row = job_config(base, *ABLATIONS["FedProIn DCE no class balance"]).fedproin
    assert defaults_row == JobConfig().fedproin
    solo = job_config(base, "solo", {})
    assert solo.strategy == "fedavg" and solo.evaluate_every == base["num_server_rounds"] // 2
    for cfg in (no_nia, solo):
        assert (cfg.fraction_train, cfg.image_size, cfg.resnet_width, cfg.seed) == (0.5, 28, 0.25, 1)


def test_ablations_are_compared_with_fedproin_seed_by_seed():
    runs = [run_record("FedProIn", "dirichlet", 0, 0.6, 0.50, 0.30),
            run_record("FedProIn", "dirichlet", 1, 0.6, 0.70, 0.40),
            run_record("FedProIn M 1", "dirichlet", 0, 0.6, 0.52, 0.33),
            run_record("FedProIn M 1", "dirichlet", 1, 0.6, 0.70, 0.37),
            run_record("FedProIn no FDL", "dirichlet", 2, 0.6, 0.90, 0.90)]  # no FedProIn run of seed 2
    assert paired_differences(runs, "FedProIn M 1", "FedProIn", "dirichlet", "mcc") == pytest.approx([0.03, -0.03])
    lines = ablation_table(runs, ["FedProIn M 1", "FedProIn no FDL"], ["dirichlet"]).splitlines()
    assert lines[2] == "| FedProIn M 1 | 61.0 ± 9.0 | 0.350 ± 0.020 | 1.0 ± 1.0 | 0.000 ± 0.030 | 0,1 |"
    assert lines[3] == "| FedProIn no FDL | 90.0 | 0.900 | - | - | 2 |"


def test_report_lists_the_rows_that_were_run_and_the_commands_that_made_them(tmp_path):
    (tmp_path / "runs").mkdir()
    for index, record in enumerate([run_record("FedProIn", "iid", 0, 0.6, 0.5, 0.3),
                                    {**run_record("FedProIn M 1", "iid", 0, 0.6, 0.5, 0.2), "command": "python x"}]):
        (tmp_path / "runs" / f"{index}.json").write_text(json.dumps(record))
    text = write_report(tmp_path, ["FedAvg", "FedProIn"], ["FedProIn M 1", "FedProIn MCL"], "t", "python main")
    assert "    python main\n    python x\n" in text
    assert "| FedProIn |" in text and "| FedAvg |" not in text and "| FedProIn MCL |" not in text
    assert "| FedProIn M 1 | 50.0 | 0.200 | 0.0 | -0.100 | 0 |" in text
    assert (tmp_path / "accuracy.png").stat().st_size > 0


def test_shift_table_pairs_each_run_with_the_same_seed_before_and_skips_unpaired_ones():
    before = [run_record("FedAvg", "iid", 0, 0.7, 0.70, 0.50), run_record("FedAvg", "iid", 1, 0.7, 0.72, 0.52),
              run_record("FedAvg", "iid", 2, 0.7, 0.90, 0.90)]
    now = [run_record("FedAvg", "iid", 0, 0.7, 0.66, 0.45), run_record("FedAvg", "iid", 1, 0.7, 0.70, 0.49),
           run_record("FedAvg", "iid", 3, 0.7, 0.10, 0.10), run_record("FedProx", "iid", 0, 0.7, 0.6, 0.4)]
    lines = shift_table(now, before, ["FedAvg", "FedProx"], ["iid"]).splitlines()
    assert lines[2] == ("| FedAvg | IID | 0, 1 | 71.0 ± 1.0 | 68.0 ± 2.0 | -3.0 ± 1.0 | 0.510 ± 0.010 | "
                        "0.470 ± 0.020 | -0.040 ± 0.010 |")
    assert len(lines) == 3  # FedProx has no run before: no row
