"""The layout users rely on: every method is one package whose server and hospital halves run without Flower (a GPU
machine may have none), registered once, with its settings written once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.methods.registry import METHOD_PACKAGES, methods

ROOT = Path(__file__).resolve().parent.parent


def test_every_method_half_imports_without_flower():
    halves = sorted({path.split(":")[0] for spec in methods().values() for path in (spec.server, spec.hospital)})
    code = ("import sys; sys.modules['flwr'] = None\n"  # any import of Flower fails
            "import importlib\n"
            f"for name in {halves!r}: importlib.import_module(name)\n"
            "from common.config import load_job_config; from common.engine.inprocess import run_rounds\n"
            "print('ok', len(" + repr(halves) + "))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok")


def test_each_method_package_holds_its_halves_and_strategy():
    for spec in methods().values():
        for path in (spec.server, spec.hospital, spec.strategy, spec.settings or spec.strategy):
            module = path.split(":")[0]
            assert module.startswith("strategies."), (spec.name, path)
            assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), path
    assert {p.split(".")[1] for p in METHOD_PACKAGES} == {
        d.name for d in (ROOT / "strategies").iterdir() if (d / "__init__.py").is_file()}


@pytest.mark.parametrize("package", METHOD_PACKAGES)
def test_a_method_package_init_loads_nothing_heavy(package):
    code = (f"import sys, importlib; importlib.import_module({package!r}); "
            "heavy = [m for m in ('torch', 'flwr', 'monai') if m in sys.modules]; print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-1000:]
