"""``fedmed runs --metric``: where a run has no value for the metric asked for, the table says n/a and why (what the
rounds record instead), so ``min:test.loss`` on a classification run points at the loss that is recorded."""

from __future__ import annotations

import argparse

import pytest

from cli.main import runs_command
from common.config import load_job_config
from common.engine.inprocess import run_rounds, simulated_sites
from server_app.app import save_round

pytestmark = pytest.mark.usefixtures("one_thread")


def test_na_for_a_metric_no_round_records_says_why_and_names_what_is_recorded(tmp_path, capsys):
    cfg = load_job_config({"model": "small-cnn", "image-size": 16, "synthetic-samples": 80, "batch-size": 16,
                           "min-partition-size": 5, "num-server-rounds": 1, "run-name": "classify",
                           "results-dir": str(tmp_path), "state-dir": str(tmp_path / "state")})
    run_rounds(cfg, simulated_sites(cfg, 2), on_round_end=save_round)

    assert runs_command(argparse.Namespace(results=tmp_path, metric="min:test.loss")) == 0
    table = capsys.readouterr().out
    assert "| n/a |" in table
    note = next(line for line in table.splitlines() if line.startswith("- classify: n/a: "))
    assert "no round records test.loss" in note and "its test holds accuracy" in note  # the server's metrics
    assert "train.val-loss" in note  # the hospitals' loss of the model they received is recorded

    runs_command(argparse.Namespace(results=tmp_path, metric="test.accuracy"))
    assert "n/a:" not in capsys.readouterr().out  # a metric that is recorded needs no note
