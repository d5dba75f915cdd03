"""Shared test fixtures: the real data folder (tests skip when it is absent), small job configs,
and a private decoded-image cache so tests never touch the user's."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from common.trust import sandbox

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = (ROOT.parent / "shared" / "data").resolve()

torch.set_num_threads(min(2, os.cpu_count() or 1))
sandbox.LIFETIME = "answer"  # tests answer as hospitals in pytest's own process: closed for each answer only


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    os.environ["FEDMED_CACHE_DIR"] = str(tmp_path_factory.mktemp("fedmed-cache"))


def shared_data(*parts: str) -> Path:
    """A path under ../shared/data, or skip the test with the reason."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data not available: {path} is absent (tests read ../shared/data beside the repository)")
    return path


@pytest.fixture
def one_thread():
    """One torch thread: two threads on a shared two-core machine spin against other jobs; one is many times
    faster here (modules that train use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_classification():
    from common.config import JobConfig

    return JobConfig(run_name="test", num_server_rounds=2, synthetic_samples=120, image_size=16, batch_size=16,
                     min_partition_size=5)


def _stop_on_sigterm(signum, frame):
    # A terminated test run still unwinds: `finally` blocks stop the Flower processes and remove the
    # network namespaces that integration tests started.
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _stop_on_sigterm)
