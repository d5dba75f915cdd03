"""Every code block of README.md and docs/*.md runs as written, or names only what exists.

- Each block says what it is (a fence's language, or an indented block whose kind is plain from its first line).
- Python blocks compile and use no name they never define (ruff's F821); a block after
  ``<!-- snippet: PATH -->`` is that file's text, verbatim; the README's ServerApp and ClientApp run a round together
  in this process (as does the example ClientApp that docs/own-clientapp.md quotes).
- Shell blocks name only commands, subcommands and options that exist (``fedmed``'s argparse, ``flwr``'s click
  commands, the benchmarks' and scripts' own options, the package's extras), and every ``--run-config`` names only
  run-config keys that exist (common/config.py) with values that validate, or keys of the app it runs.
- TOML and JSON blocks parse; run configs and hospital policies in them validate.
- Every relative link and anchor, and every test file the docs name, exists.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import tomllib
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "console", "toml", "json", "text", "diff"}  # diffs: tests/test_quickstart_example.py
SNIPPET_MARKER = re.compile(r"<!--\s*snippet:\s*(\S+)\s*-->")


@dataclass(frozen=True)
class Block:
    document: Path
    line: int
    language: str
    text: str
    quotes: str = ""  #: the file this block must equal, from a ``<!-- snippet: PATH -->`` just before it

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def guess_language(text: str) -> str:
    """An indented block's kind, from its first line (a fenced block names it)."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    word = first.split()[0] if first.split() else ""
    if word.startswith(("from", "import")) and not first.startswith("from="):
        return "python"
    if re.match(r"^(\.venv/bin/|deploy/|[A-Z_]+=\S*\s)?(fedmed|flwr|python3?|pip|docker-compose|tensorboard|mlflow|"
                r"flock|mkdir)\b", first) or word.startswith("deploy/"):
        return "bash"
    try:
        tomllib.loads(text)
        return "toml"
    except tomllib.TOMLDecodeError:
        return ""


@cache
def all_blocks() -> tuple[Block, ...]:
    parser = MarkdownIt("commonmark")
    blocks = []
    for document in DOCUMENTS:
        marker = ""
        for token in parser.parse(document.read_text()):
            if token.type == "html_block":
                found = SNIPPET_MARKER.search(token.content)
                marker = found.group(1) if found else ""
                continue
            if token.type in ("fence", "code_block"):
                language = token.info.strip().split()[0] if token.info.strip() else guess_language(token.content)
                blocks.append(Block(document, token.map[0] + 1, language, token.content, marker))
            if token.nesting >= 0:
                marker = ""  # a marker names only the block right after it
    return tuple(blocks)


def blocks_of(*languages: str) -> list[Block]:
    return [b for b in all_blocks() if b.language in languages]


def ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def test_the_docs_have_blocks_of_every_kind_checked_here():
    kinds = {b.language for b in all_blocks()}
    assert {"python", "bash", "toml", "json"} <= kinds, kinds
    readme = [b for b in all_blocks() if b.document.name == "README.md"]
    assert len(blocks_of("python")) >= 4 and len(readme) >= 4


def test_every_block_says_what_it_is():
    unclear = [f"{b.where}: {b.text.strip().splitlines()[0][:60]!r}" for b in all_blocks()
               if b.language not in LANGUAGES]
    assert not unclear, ("fence these blocks with their language (" + ", ".join(sorted(LANGUAGES)) + "):\n"
                         + "\n".join(unclear))


# --- Python --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", blocks_of("python"), ids=ids(blocks_of("python")))
def test_python_blocks_compile_and_define_every_name_they_use(block):
    compile(block.text, block.where, "exec")
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    done = subprocess.run([ruff, "check", "--no-cache", "--select", "F821", "--output-format", "concise",
                           "--stdin-filename", "snippet.py", "-"], input=block.text, capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0, f"{block.where} uses names it never defines:\n{done.stdout}"


QUOTING = [b for b in all_blocks() if b.quotes]


@pytest.mark.parametrize("block", QUOTING, ids=ids(QUOTING))
def test_a_block_marked_as_a_files_text_is_that_text(block):
    source = ROOT / block.quotes
    assert source.is_file(), f"{block.where} quotes {block.quotes}, which does not exist"
    assert block.text == source.read_text(), f"{block.where} is no longer the text of {block.quotes}: copy it again"


def test_the_own_clientapp_doc_quotes_the_example_clientapp():
    quoted = {b.quotes for b in all_blocks() if b.document.name == "own-clientapp.md"}
    assert "examples/own_model/client.py" in quoted
    text = (ROOT / "docs" / "own-clientapp.md").read_text()
    assert all(f"@app.{kind}()" in text for kind in ("query", "train", "evaluate"))


def readme_app(kind: str):
    """The README's ServerApp or ClientApp, executed from its block as a user would paste it."""
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    wanted = {"server": ServerApp, "client": ClientApp}[kind]
    for block in blocks_of("python"):
        if block.document.name != "README.md":
            continue
        namespace: dict = {"__name__": f"readme_{kind}"}
        exec(compile(block.text, block.where, "exec"), namespace)
        apps = [v for v in namespace.values() if isinstance(v, wanted)]
        if apps:
            return apps[0]
    raise AssertionError(f"the README has no Python block that makes a {wanted.__name__}")


def example_clientapp():
    import importlib.util

    spec = importlib.util.spec_from_file_location("own_model_client", ROOT / "examples" / "own_model" / "client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.app


TINY_RUN = {"model": "small-cnn", "image-size": 16, "synthetic-samples": 120, "batch-size": 16,
            "min-partition-size": 5, "num-server-rounds": 1, "run-name": "snippet"}


def run_a_round(tmp_path, client_app, hospitals: int = 4):
    """The README's ServerApp over ``hospitals`` nodes that answer with ``client_app``; an exception in the
    ClientApp becomes an error reply, as Flower's runtime makes it. Returns the grid (what was sent and replied)."""
    from flwr.app import Context, Error, Message, RecordDict

    from .fake_grid import FakeGrid

    run_config = {**TINY_RUN, "state-dir": str(tmp_path / "state"), "results-dir": str(tmp_path / "results")}

    def node(pid: int):
        context = Context(run_id=1, node_id=101 + pid, node_config={"partition-id": pid, "num-partitions": hospitals},
                          state=RecordDict(), run_config=dict(run_config))

        def answer(message: Message) -> Message:
            try:
                return client_app(message, context)
            except Exception as error:
                return Message(Error(code=0, reason=f"{type(error).__name__}: {error}"), reply_to=message)

        return answer

    grid = FakeGrid({101 + pid: node(pid) for pid in range(hospitals)})
    server_context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    readme_app("server")(grid, server_context)
    return grid


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("client", ["README", "examples/own_model/client.py"])
def test_the_readme_serverapp_and_a_documented_clientapp_run_a_round_together(tmp_path, client):
    from flwr.app import MessageType

    app = readme_app("client") if client == "README" else example_clientapp()
    grid = run_a_round(tmp_path, app)
    errors = [r.error.reason for r in grid.replies if r.has_error()]
    assert not errors, errors
    assert len(grid.sent_of_type(MessageType.QUERY)) >= 4  # every hospital said who it is
    trained = [r for r in grid.replies if r.metadata.message_type == MessageType.TRAIN]
    assert len(trained) == 2  # fraction_train=0.5 of 4 hospitals, min_train_nodes=2
    assert all(r.content["metrics"]["num-examples"] > 0 for r in trained)


def test_a_clientapp_without_a_query_handler_fails_the_round_with_flowers_reason(tmp_path):
    """What the README's snippet did before (train only): the check above would catch it."""
    from flwr.clientapp import ClientApp

    from client_app.api import Hospital

    train_only = ClientApp()

    @train_only.train()
    def train(message, context):
        return Hospital(context).answer(message)

    with pytest.raises(Exception) as raised:
        grid = run_a_round(tmp_path, train_only)
        raise AssertionError(f"the round went on: {[r.error.reason for r in grid.replies if r.has_error()]}")
    assert "No query function registered" in str(raised.value), raised.value


# --- shell ----------------------------------------------------------------------------------------------------------
def shell_commands(block: Block) -> list[list[str]]:
    """Each simple command of a block as its words: comments, continuations, redirections and ``&&``/``|``
    dealt with; a console block's commands are its ``$ `` lines."""
    text = block.text.replace("\\\n", " ")
    lines = text.splitlines()
    if block.language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        words: list[str] = []
        skip = False
        for word in shlex.split(line, comments=True):
            if skip:
                skip = False
            elif word in ("&&", "||", ";", "|"):
                commands.append(words)
                words = []
            elif word in (">", ">>", "<", "2>"):
                skip = True  # the redirection's file
            else:
                words.append(word)
        commands.append(words)
    return [c for c in commands if c]


def placeholders_filled(words: list[str]) -> list[str]:
    """``<run-id>``, ``<connection>``: what a reader fills in (a number stands for any of them)."""
    return ["1" if re.fullmatch(r"<[^<>]+>", w) else w for w in words]


def option_words(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if re.match(r"^--[a-z]", w)]


def check_run_config(text: str, where: str, app_keys: frozenset[str] | None = None) -> None:
    """Every key is fedmed's (or the app's own, for an app of one's own); fedmed's app: the values validate."""
    from cli.arguments import parse_overrides
    from common.config import _FLAT_KEYS, load_job_config

    values = parse_overrides(text)
    known = _FLAT_KEYS | (app_keys or frozenset())
    unknown = sorted(set(values) - known)
    assert not unknown, f"{where}: --run-config names keys that do not exist: {unknown}"
    if app_keys is None:
        load_job_config(values)  # ConfigError naming the key and value at fault


def check_fedmed(words: list[str], where: str) -> None:
    from cli.main import build_parser

    args = words[1:]
    if args[:1] in (["audit"], ["app-hash"], ["policy"], ["console"], ["key-fingerprint"]):  # their own parsers
        module = {"audit": "cli/audit.py", "console": "cli/console.py"}.get(args[0],
                                                                                 "cli/site.py")
        source = (ROOT / module).read_text()
        action = args[1:2] if args[0] in ("audit", "policy") else []  # app-hash, key-fingerprint take paths
        missing = [w for w in [*option_words(args), *action] if f'"{w}"' not in source]
        assert not missing, f"{where}: fedmed {' '.join(args[:2])}: {module} has no {missing}"
        return
    parser = build_parser()
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        raise AssertionError(f"{where}: `fedmed {' '.join(args)}` is refused by fedmed's own parser") from None
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    options = set(subcommands[parsed.command]._option_string_actions)
    abbreviated = [o for o in option_words(args) if o not in options]  # argparse takes --hospital for --hospitals
    assert not abbreviated, f"{where}: fedmed {parsed.command} has no options {abbreviated} (only abbreviations)"
    if getattr(parsed, "run_config", ""):
        check_run_config(parsed.run_config, where)


@cache
def flwr_command():
    import typer
    from flwr.cli.app import app

    return typer.main.get_command(app)


#: Flower 1.42's simulation settings a --federation-config may set (flwr/cli/constant.py
#: SuperLinkSimulationOptionsTomlKey, flwr/cli/federation/simulation_config.py)
FEDERATION_KEYS = {"num-supernodes", "backend", "verbose", "client-resources-num-cpus", "client-resources-num-gpus"}


def app_config_keys(app_dir: str) -> frozenset[str] | None:
    """None for fedmed's own app (the repository root), else the keys of that app's [tool.flwr.app.config]."""
    folder = (ROOT / app_dir).resolve()
    if folder == ROOT:
        return None
    pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
    return frozenset(pyproject["tool"]["flwr"]["app"].get("config", {}))


def check_flwr(words: list[str], where: str) -> None:
    import click

    from cli.arguments import parse_overrides

    command, args = flwr_command(), placeholders_filled(words[1:])
    context = None
    while isinstance(command, click.Group):
        name = args[0]
        sub = command.get_command(click.Context(command), name)
        assert sub is not None, f"{where}: `flwr ... {name}`: Flower has no such command"
        command, args = sub, args[1:]
    try:
        context = command.make_context(words[1], list(args))
    except click.ClickException as error:
        raise AssertionError(f"{where}: `{' '.join(words)}`: {error.format_message()}") from None
    params = context.params
    if params.get("run_config_overrides"):
        app_dir = str(params.get("app", "."))
        for text in params["run_config_overrides"]:
            check_run_config(text, where, app_config_keys(app_dir))
    if params.get("federation_config_overrides"):
        for text in params["federation_config_overrides"]:
            unknown = set(parse_overrides(text, "--federation-config")) - FEDERATION_KEYS
            assert not unknown, f"{where}: --federation-config names settings Flower lacks: {sorted(unknown)}"


def check_python(words: list[str], where: str) -> None:
    import importlib.util

    if words[1:3] == ["-m", "venv"] or words[1:3] == ["-m", "pip"]:
        return
    assert words[1] == "-m", f"{where}: run modules as `python -m package.module` ({words})"
    module = words[2]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{where}: python -m {module}: no such module"
    source = Path(spec.origin).read_text()
    missing = [o for o in option_words(words[3:]) if f'"{o}"' not in source]
    assert not missing, f"{where}: python -m {module} has no options {missing}"


def check_script(words: list[str], where: str) -> None:
    script = ROOT / words[0]
    assert script.is_file(), f"{where}: {words[0]} does not exist"
    source = script.read_text()
    missing = [o for o in option_words(words[1:]) if o not in source]
    assert not missing, f"{where}: {words[0]} has no options {missing}"


def check_flower_process(words: list[str], where: str) -> None:
    """``flower-supernode``/``flower-superlink``: Flower's own options; a node config names only our node keys."""
    from cli.arguments import parse_overrides
    from client_app.node_config import NodeConfig

    if words[0].endswith("flower-supernode"):
        from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode as flower_parser
    else:
        from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink as flower_parser
    options = set(flower_parser()._option_string_actions)
    unknown = [o for o in option_words(words[1:]) if o not in options]
    assert not unknown, f"{where}: {words[0]} has no options {unknown}"
    node_keys = {field.alias or name for name, field in NodeConfig.model_fields.items()}
    for i, word in enumerate(words[:-1]):
        if word == "--node-config":
            unknown = sorted(set(parse_overrides(words[i + 1], "--node-config")) - node_keys)
            assert not unknown, f"{where}: --node-config names keys a hospital does not read: {unknown}"


def check_pip(words: list[str], where: str) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for word in words:
        found = re.search(r"\[([a-z0-9,-]+)\]", word)
        if found and ("." in word.split("[")[0] or word.startswith("fedmed-hospitals")):
            unknown = set(found.group(1).split(",")) - set(extras)
            assert not unknown, f"{where}: pip install {word}: the package has no extras {sorted(unknown)}"


def check_docker_compose(words: list[str], where: str) -> None:
    files = [words[i + 1] for i, w in enumerate(words) if w == "-f"]
    assert all((ROOT / f).is_file() for f in files), f"{where}: docker-compose -f {files}: a file is missing"
    verbs = [w for w in words[1:] if not w.startswith("-") and w not in files]
    assert verbs and verbs[0] in {"build", "up", "down", "start", "stop", "restart", "logs", "ps", "config"}, \
        f"{where}: docker-compose {verbs[:1]}"


#: commands the docs may name that are not the project's: the shell's and tools that extras install
OTHER_TOOLS = {"mkdir", "printf", "cd", "cp", "ls", "flock", "ruff", "tensorboard", "mlflow", "docker"}


def check_command(words: list[str], where: str) -> None:
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value before the command
        words = words[1:]
    name = words[0].removeprefix(".venv/bin/")
    checks = {"fedmed": check_fedmed, "flwr": check_flwr, "python": check_python, "python3": check_python,
              "pip": check_pip, "docker-compose": check_docker_compose, "flower-supernode": check_flower_process,
              "flower-superlink": check_flower_process}
    if name in checks:
        checks[name](words, where)
    elif name.startswith("deploy/"):
        check_script(words, where)
    else:
        assert name in OTHER_TOOLS, f"{where}: `{name}` is neither fedmed's nor a tool this test knows"


SHELL = blocks_of("bash", "console")


@pytest.mark.parametrize("block", SHELL, ids=ids(SHELL))
def test_shell_blocks_name_only_commands_options_and_keys_that_exist(block):
    commands = shell_commands(block)
    assert commands, f"{block.where}: no command in a shell block"
    for words in commands:
        check_command(words, block.where)


@pytest.mark.parametrize("words", [
    ["fedmed", "simulate", "--hospital", "3"],
    ["fedmed", "simulate", "--run-config", "num-server-round=3"],
    ["fedmed", "simulate", "--run-config", "learning-rate=-1"],
    ["flwr", "run", ".", "local", "--run-confg", "a=1"],
    ["flwr", "run", ".", "local", "--run-config", "strategy='fedavgg'"],
    ["flwr", "run", "examples/own_model", "local", "--run-config", "results-file='x'"],
    ["flwr", "runn", "."],
    ["python", "-m", "benchmarks.fedproin.run", "--preset", "cpu", "--dataset-dir", "x"],
    ["python", "-m", "benchmarks.nothing"],
    ["deploy/start_superlink.sh", "certs", "--portt", "9200"],
    ["pip", "install", "-e", ".[tensorbord]"],
    ["fedmed", "audit", "check", "log"],
    ["fedmed", "policy", "verify", "policy.toml"],
    ["flower-supernode", "--node-config", "hospitl='x'"],
    ["flower-supernode", "--superlinkk", "x"],
    ["pdm", "install"],
])
def test_the_shell_checks_refuse_what_does_not_exist(words):
    from common.config import ConfigError

    with pytest.raises((AssertionError, ConfigError)):
        check_command(words, "test")


def test_the_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0].startswith("# fedmed")
    setup_demo, setup_tests = lines[2].strip(), lines[3].strip()
    assert setup_demo.endswith(".venv/bin/fedmed demo") and setup_demo.startswith("python3 -m venv .venv")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert setup_tests in ci, "the README's test command is not what .ci/run runs"
    assert ".venv/bin/python -m pytest -m slow" in ci[ci.index(setup_tests):], "CI runs the long tier after it"
    assert len(lines) <= 210, f"the README is an entry page: {len(lines)} lines (move detail to docs/)"


# --- TOML and JSON --------------------------------------------------------------------------------------------------
def flatten(table: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        flat.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return flat


def policy_keys() -> set[str]:
    from common.trust.policy import Policy

    return {field.alias or name for name, field in Policy.model_fields.items()}


def check_policy(text: str, suffix: str, where: str, tmp_path: Path) -> None:
    from common.trust.policy import read_policy

    path = tmp_path / f"policy{suffix}"
    path.write_text(text)
    read_policy(path)  # ConfigError naming the key at fault


TOML = blocks_of("toml")


@pytest.mark.parametrize("block", TOML, ids=ids(TOML))
def test_toml_blocks_parse_and_their_run_configs_and_policies_validate(block, tmp_path):
    from common.config import _FLAT_KEYS, load_job_config

    document = tomllib.loads(block.text)
    if "tool" in document:  # a pyproject's run config
        values = flatten(document["tool"]["flwr"]["app"]["config"])
        assert set(values) <= _FLAT_KEYS, f"{block.where}: unknown run-config keys {sorted(set(values) - _FLAT_KEYS)}"
        load_job_config(values)
    elif "superlink" in document:  # Flower's config.toml: connections
        for name, connection in document["superlink"].items():
            unknown = set(connection) - {"address", "root-certificates", "insecure", "federation", "options"}
            assert not unknown, f"{block.where}: [superlink.{name}] has keys Flower does not read: {unknown}"
    elif set(document) <= policy_keys():
        check_policy(block.text, ".toml", block.where, tmp_path)
    else:
        unknown = set(flatten(document)) - _FLAT_KEYS
        assert not unknown, f"{block.where}: neither a run config nor a policy: {sorted(unknown)}"


JSON = blocks_of("json")


@pytest.mark.parametrize("block", JSON, ids=ids(JSON))
def test_json_blocks_parse_and_policies_validate(block, tmp_path):
    try:
        documents = [json.loads(block.text)]
    except json.JSONDecodeError:  # JSON lines (an audit log)
        documents = [json.loads(line) for line in block.text.splitlines() if line.strip()]
    for document in documents:
        if isinstance(document, dict) and set(document) <= policy_keys():
            check_policy(block.text, ".json", block.where, tmp_path)


# --- links ---------------------------------------------------------------------------------------------------------
def anchors_of(document: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    parser = MarkdownIt("commonmark")
    tokens = parser.parse(document.read_text())
    anchors = set()
    for heading, inline in zip(tokens, tokens[1:]):
        if heading.type == "heading_open":
            text = re.sub(r"[^\w\- ]", "", inline.content.lower().replace("`", ""))
            anchors.add(text.replace(" ", "-"))
    return anchors


def links_of(document: Path) -> list[str]:
    links = []
    for token in MarkdownIt("commonmark").parse(document.read_text()):
        for child in token.children or []:
            if child.type == "link_open":
                links.append(child.attrs["href"])
    return links


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_relative_links_anchors_and_named_test_files_exist(document):
    broken = []
    for link in links_of(document):
        if re.match(r"^[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (document.parent / path).resolve() if path else document
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in anchors_of(target):
            broken.append(link)
    named_tests = set(re.findall(r"tests/test_\w+\.py", document.read_text()))
    broken += [t for t in sorted(named_tests) if not (ROOT / t).is_file()]
    assert not broken, f"{document.relative_to(ROOT)}: broken links or missing files: {broken}"
