"""A Flower user's own ServerApp with one of our strategies prints the round lines on its stdout (which
``flwr run --stream`` and ``flwr log`` show), as Flower's strategies do, though nothing configured logging there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from .conftest import ROOT

USERS_SERVERAPP = textwrap.dedent("""
    import torch
    torch.set_num_threads(1)
    from strategies import FedAvgStrategy
    from tests.fake_grid import FakeGrid, simulated_hospitals
    from tests.test_strategies import SMALL_CLASSIFICATION, run_config

    config = run_config(__import__("pathlib").Path({folder!r}), SMALL_CLASSIFICATION)
    FedAvgStrategy(run_config=config).start(FakeGrid(simulated_hospitals(config, 2)), num_rounds=2)
""")


def test_round_lines_reach_the_stdout_of_a_serverapp_that_configured_no_logging(tmp_path):
    done = subprocess.run([sys.executable, "-c", USERS_SERVERAPP.format(folder=str(tmp_path))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for rnd in (1, 2):
        assert f"INFO : fedmed: [ROUND {rnd}/2]" in lines
        assert any(line.startswith(f"INFO : fedmed: round {rnd}/2: 2/2 hospitals") for line in lines), done.stdout
    assert sum("[ROUND 1/2]" in line for line in lines) == 1  # each line once, not again through a root handler
