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


# --- the direction of imports (docs/ARCHITECTURE.md) -----------------------------------------------------------------
#: the floors of the house, from the ground up: a package imports only its own floor's modules and those below
FLOORS = {"common": 0, "strategies": 1, "client_app": 1, "server_app": 2, "console": 3, "cli": 4}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in FLOORS:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, wherever the import stands (in a function, under TYPE_CHECKING)."""
    import ast

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {module: imports_of(path, module, modules) for module, path in modules.items()}


def test_no_module_imports_one_that_imports_it_back(import_graph):
    import networkx

    graph = networkx.DiGraph([(a, b) for a, targets in import_graph.items() for b in targets])
    circles = [sorted(c) for c in networkx.strongly_connected_components(graph) if len(c) > 1]
    assert circles == []


def test_a_floor_imports_only_its_own_and_those_below(import_graph):
    """common/ imports no package above it, nothing imports the command line (cli/), and the strategies and the
    ClientApp (one floor) do not import each other."""
    upward = [(a, b) for a, targets in import_graph.items() for b in targets
              if FLOORS[b.split(".")[0]] > FLOORS[a.split(".")[0]]
              or FLOORS[b.split(".")[0]] == FLOORS[a.split(".")[0]] and b.split(".")[0] != a.split(".")[0]]
    assert upward == []


def test_a_method_package_imports_no_other_method_package(import_graph):
    packages = {p.split(".")[1] for p in METHOD_PACKAGES}
    across = [(a, b) for a, targets in import_graph.items() for b in targets
              if a.split(".")[0] == b.split(".")[0] == "strategies" and len(a.split(".")) > 1 and len(b.split(".")) > 1
              and a.split(".")[1] in packages and b.split(".")[1] in packages and a.split(".")[1] != b.split(".")[1]]
    assert across == []


def test_the_policy_enforces_what_each_method_declares():
    """Every method states its privacy rules (its package's privacy.py, or the ground floor's plain model update), and
    what local DP can train is exactly what the methods declare."""
    from common.methods.privacy import MODEL_UPDATE, MODEL_UPDATE_WITH_TERM, PrivacyRules
    from common.methods.registry import load, local_dp_method_names, privacy_rules

    for spec in methods().values():
        assert spec.privacy, spec.name
        rules = load(spec.privacy)
        assert isinstance(rules, PrivacyRules) and rules is privacy_rules(spec.name)
        own = spec.privacy.startswith(f"strategies.{spec.strategy.split('.')[1]}.privacy:")
        assert own or rules in (MODEL_UPDATE, MODEL_UPDATE_WITH_TERM), spec.privacy
        assert rules.local_dp or rules.no_local_dp
    assert local_dp_method_names() == ["fedavg", "fedbn", "fedproin", "fedprox", "moon"]


#: HospitalStrategy no larger than Flower's Strategy and FedAvg together (283 + 319 lines in Flower 1.42), and each
#: part it is built from (one job per module) within a bound of its own.
SIZE_BOUNDS = {"strategies/base.py": 650, "strategies/hospitals.py": 260, "strategies/audit_trail.py": 130,
               "strategies/replies.py": 130, "strategies/cross_site.py": 90, "strategies/wrappers.py": 100,
               "strategies/run_folder.py": 50, "strategies/round_loop.py": 130, "strategies/round_workflow.py": 80,
               "common/engine/round_record.py": 100}


@pytest.mark.parametrize("module", SIZE_BOUNDS)
def test_the_strategy_and_each_of_its_parts_stay_within_their_size(module):
    lines = len((ROOT / module).read_text().splitlines())
    assert lines <= SIZE_BOUNDS[module], f"{module}: {lines} lines, more than its bound {SIZE_BOUNDS[module]}"
