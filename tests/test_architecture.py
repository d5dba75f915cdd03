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
    # a hospital's policy with local DP allows exactly the methods whose rules local DP can bound
    from common.trust.policy import Policy

    dp = {"clip-norm": 0.5, "noise-multiplier": 1.0, "delta": 1e-5}
    allowed = []
    for name in methods():
        try:
            Policy.model_validate({"methods": [name], "local-dp": dp})
            allowed.append(name)
        except ValueError as error:
            assert privacy_rules(name).no_local_dp in str(error), name
    assert sorted(allowed) == local_dp_method_names() and allowed


# --- lists of methods follow the registry ---------------------------------------------------------------------------
def registered_names() -> set[str]:
    """Every method's run-config name and strategy class name."""
    return set(methods()) | {spec.strategy.rpartition(":")[2] for spec in methods().values()}


def hand_kept_lists(path: Path) -> list[tuple[int, list[str]]]:
    """The literals in ``path`` that name three or more registered methods: a list, tuple or set of names, or a
    message naming them (docstrings, which describe, are not counted); in a test, a list compared in an assert."""
    import ast
    import re

    names, test = registered_names(), path.parent.name == "tests"
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    asserted = {id(child) for node in ast.walk(tree) if isinstance(node, ast.Assert) for child in ast.walk(node.test)}
    found = []
    for node in ast.walk(tree):
        if test and id(node) not in asserted:
            continue
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            named = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            named = sorted(set(re.findall(r"[A-Za-z][\w-]*", node.value)) & names)
        else:
            continue
        if len(named) >= 3:
            found.append((node.lineno, named))
    return found


def test_no_list_of_methods_is_kept_by_hand():
    """``__all__``, settings texts, refusals and the tests' expected lists derive from the registry, so a method added
    by docs/ARCHITECTURE.md's recipe (tests/test_adding_a_method.py) needs no edit elsewhere."""
    kept = {str(path.relative_to(ROOT)): lists for package in [*FLOORS, "tests"]
            for path in sorted((ROOT / package).rglob("*.py")) if (lists := hand_kept_lists(path))}
    assert kept == {}


def registry_table() -> str:
    """The registry as README.md's method table."""
    from common.methods.registry import load, privacy_rules

    rows = ["| strategy | Flower strategy | tasks | secure aggregation | local DP | what it is |",
            "|---|---|---|---|---|---|"]
    for name, spec in methods().items():
        secure = "yes" if spec.secure else "no"
        if spec.secure and load(spec.secure).distributed_dp:
            secure += ", distributed DP"
        rows.append(f"| `{name}` | `{spec.strategy.rpartition(':')[2]}` | {', '.join(spec.tasks)} | {secure} | "
                    f"{'no' if privacy_rules(name).no_local_dp else 'yes'} | {spec.summary} |")
    return "\n".join(rows)


def test_the_readmes_method_table_is_the_registry():
    """README.md lists every registered method once, in the registry's order, with its strategy class, tasks, what it
    runs under (secure aggregation, distributed DP, local DP) and its summary (the MethodSpec's)."""
    text = (ROOT / "README.md").read_text()
    marker = "<!-- methods: from the registry (tests/test_architecture.py's registry_table) -->\n"
    assert marker in text
    assert text.split(marker, 1)[1].startswith(registry_table() + "\n"), registry_table()


def test_the_swap_table_of_docs_own_serverapp_names_every_registered_strategy():
    """docs/own-serverapp.md's table of what a swap from Flower's FedAvg takes names each registered strategy class
    (and none that is not)."""
    import re

    text = (ROOT / "docs" / "own-serverapp.md").read_text()
    table = text.split("| strategy | ServerApp | ClientApp | run config |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+Strategy)`", table))
    assert named == {spec.strategy.rpartition(":")[2] for spec in methods().values()}


def doc_table_rows(doc: str, header: str) -> dict[str, str]:
    """Each registered name a row of ``doc``'s table (the one under ``header``) names in its first column, mapped to
    that whole row; a name in two rows fails."""
    import re

    table = (ROOT / "docs" / doc).read_text().split(header, 1)[1].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for row in table.splitlines()[2:]:
        for name in re.findall(r"`([\w-]+)`", row.split(" | ", 1)[0]):
            assert name not in rows, f"docs/{doc} names {name} in two rows"
            rows[name] = row
    return rows


def test_the_secure_sum_table_of_docs_secure_aggregation_is_the_registry():
    """docs/secure-aggregation.md's table of what each method sums names exactly the registered methods with a
    secure sum (``MethodSpec.secure``), each in one row."""
    rows = doc_table_rows("secure-aggregation.md", "| method | what a hospital adds to the sum |")
    assert set(rows) == {name for name, spec in methods().items() if spec.secure}


def test_the_reply_table_of_docs_privacy_is_the_registry():
    """docs/privacy.md's table of what each method's reply tells names every registered method in one row, and says
    "refused" under local DP exactly where the method's privacy rules refuse it."""
    from common.methods.registry import privacy_rules

    rows = doc_table_rows("privacy.md", "| method | the reply (what the server and SuperLink see) |")
    assert set(rows) == set(methods())
    refused = {name for name, row in rows.items() if row.rstrip(" |").rsplit(" | ", 1)[1].startswith("refused")}
    assert refused == {name for name in methods() if privacy_rules(name).no_local_dp}


# --- the ground floor's tools ----------------------------------------------------------------------------------------
def test_quantisation_is_plain_pytorch(import_graph):
    """common/quantization holds models and codecs only: what loads a run, its config, data or task (``fedmed
    export-int8``, ``segment``) is a tool beside the command line (cli/int8_export.py)."""
    tools = ("common.config", "common.data", "common.tasks", "common.methods", "common.engine")
    reaching = sorted((a, b) for a, targets in import_graph.items() if a.startswith("common.quantization")
                      for b in targets if b.startswith(tools))
    assert reaching == []


#: HospitalStrategy no larger than Flower's Strategy and FedAvg together (283 + 319 lines in Flower 1.42), and each
#: part it is built from (one job per module) within a bound of its own.
SIZE_BOUNDS = {"strategies/base.py": 650, "strategies/hospitals.py": 260, "strategies/audit_trail.py": 130,
               "strategies/replies.py": 130, "strategies/cross_site.py": 90, "strategies/wrappers.py": 100,
               "strategies/run_folder.py": 50, "strategies/round_loop.py": 160, "strategies/round_workflow.py": 80,
               "common/engine/round_record.py": 100}


@pytest.mark.parametrize("module", SIZE_BOUNDS)
def test_the_strategy_and_each_of_its_parts_stay_within_their_size(module):
    lines = len((ROOT / module).read_text().splitlines())
    assert lines <= SIZE_BOUNDS[module], f"{module}: {lines} lines, more than its bound {SIZE_BOUNDS[module]}"
