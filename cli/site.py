"""A hospital operator's commands: what an app bundle holds before approving it, and what the site's policy allows.

    fedmed app-hash [APP_DIR]                       # the SHA-256 a SuperNode sees for this app, and its files
    fedmed policy check [--node-config "..."] [POLICY_FILE]   # what the server may and may not make this site do

``app-hash`` builds the bundle (FAB) as ``flwr run`` builds it (Flower's own builder, so the hash is the one the
SuperLink sends): add the hash to the policy's ``apps`` (or node config ``approved-apps``) once the files were
reviewed. ``policy check`` reads the policy and node config as the hospital does for every message and prints what
they allow (as NVIDIA FLARE's ``authz_preview`` does for its site policies).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import zipfile
from pathlib import Path

from cli.main import OneLineParser


def app_hash(app_dir: Path) -> tuple[str, list[tuple[str, str, int]]]:
    """The FAB's SHA-256 and its files (path, SHA-256, bytes), from Flower's own builder."""
    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(app_dir)
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        files = [(info.filename, hashlib.sha256(archive.read(info)).hexdigest(), info.file_size)
                 for info in archive.infolist()]
    return hashlib.sha256(fab).hexdigest(), files


def app_hash_command(args: argparse.Namespace) -> int:
    from cli.main import usable_path
    from common.config import ConfigError

    folder = usable_path("app-hash APP_DIR", args.app)
    if not (folder / "pyproject.toml").is_file():
        raise ConfigError(f"app-hash: {str(args.app)!r} is not an app's folder (it holds no pyproject.toml)")
    digest, files = app_hash(args.app)
    if args.hash_only:  # for scripts (deploy/start_supernode.sh, deploy/compose_env.sh)
        print(digest)
        return 0
    print(f"{digest}  {args.app.resolve()}")
    for path, file_hash, size in files:
        print(f"  {file_hash[:16]}  {size:>9}  {path}")
    print(f"\nto approve it: apps = [\"{digest}\"] in the hospital's policy, or node config approved-apps='{digest}'")
    return 0


def policy_rules(node_config: str = "", policy_file: Path | str | None = None) -> list[tuple[str, str]]:
    """What a site's policy and node config allow, as (what, value) rows, read as the hospital reads them for every
    message: what ``fedmed policy check`` prints and ``fedmed console`` shows. The first row names the hospital and
    its policy file. ConfigError (or ValueError, OSError) when they cannot be read."""
    from flwr.common.config import parse_config_args

    from client_app.hospital import code_gate
    from client_app.node_config import SIMULATION_ENGINE_FIELDS, load_node_config
    from common.config import ConfigError, server_settable_keys
    from common.trust.argument_gate import DEFAULT_JOB_LIMITS
    from common.trust.code_gate import wide_patterns

    try:
        raw = parse_config_args([node_config]) if node_config else {"hospital": "site", "data-dir": "."}
    except Exception as error:  # Flower's parser raises click's exception, with its own message
        raise ConfigError(f"--node-config {node_config!r}: {getattr(error, 'message', error)}") from None
    if policy_file:
        raw = {**raw, "policy-file": str(policy_file)}
    node = load_node_config(raw)
    enforcer = None
    if node.policy_file:
        from client_app.hospital import hospital_audit
        from common.trust.policy import enforcer_for

        enforcer = enforcer_for(node.policy_file, None, hospital_audit(node, "state"))
    policy = enforcer.policy if enforcer is not None else None
    gate = code_gate(node, enforcer)
    rows = [("hospital", f"{node.name}" + (f", policy {node.policy_file} (sha256 {enforcer.policy_sha256})"
                                           if enforcer else ", no policy file"))]
    if policy is not None:
        rows += [("tasks", ", ".join(policy.tasks) or "any"), ("methods", ", ".join(policy.methods) or "any"),
                 ("min-samples", str(policy.min_samples)), ("release-metrics", policy.metrics_released),
                 ("max-rounds-per-run", str(policy.max_rounds_per_run or "no limit")),
                 ("max-trainings-per-day", str(policy.max_trainings_per_day or "no limit")),
                 ("local-dp", ", ".join(f"{k}={v:g}" for k, v in policy.local_dp.model_dump(by_alias=True).items())
                  if policy.local_dp else "none")]
    apps = sorted(set(filter(None, node.approved_apps.replace(",", " ").split())) | set(policy.apps if policy else []))
    engine_only = node.model_fields_set == SIMULATION_ENGINE_FIELDS
    limits = policy.limits if policy is not None else DEFAULT_JOB_LIMITS
    rows += [("apps it runs", ", ".join(apps) if apps else "none (fedmed-supernode refuses to start without "
              "approved-apps or the policy's apps)"),
             ("networks it runs", "built in" + (" (inside Flower's simulation engine, where one operator runs every "
                                                "hospital, also the run config's)" if engine_only else "")
              + "".join(f", {m}" for m in gate.models)),
             ("data loaders it runs", "built in" + "".join(f", {d}" for d in gate.datasets)),
             ("pretrained weights", "from its own cache (allow-pretrained)" if policy is not None
              and policy.allow_pretrained else "refused"),
             ("paths in model-args, dataset-args, encoder-weights", "only inside data-dir, state-dir"
              + "".join(f", {folder}" for folder in (policy.argument_folders if policy is not None else ()))),
             ("job limits", ", ".join(f"{key} <= {most}" for key, most in sorted(limits.items()))),
             ("set by the hospital only", f"state-dir{', ' + ', '.join(node.pinned_keys()) if node.dataset else ''}"),
             ("the server may set", ", ".join(k for k in server_settable_keys() if k not in node.pinned_keys()))]
    for pattern in wide_patterns(gate.models + gate.datasets):
        rows.append(("WARNING", f"{pattern!r} approves every module it matches, helpers included: list the modules "
                                "(or the networks and loaders) one by one"))
    return rows


def policy_check_command(args: argparse.Namespace) -> int:
    rows = policy_rules(args.node_config, args.policy)
    print("\n".join([" ".join(rows[0])] + [f"{what}: {value}" for what, value in rows[1:]]))
    return 0


def main(argv: list[str]) -> int:
    """``argv``: the words after ``fedmed``, starting with ``app-hash`` or ``policy``."""
    parser = OneLineParser(prog="fedmed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    fab = sub.add_parser("app-hash", help="an app bundle's SHA-256 and files, for a hospital to review and approve")
    fab.add_argument("app", type=Path, nargs="?", default=Path("."), help="the app's folder (its pyproject.toml)")
    fab.add_argument("--hash-only", action="store_true", help="print the hash alone (for scripts)")
    policy = sub.add_parser("policy", help="a hospital's policy").add_subparsers(dest="action", required=True)
    check = policy.add_parser("check", help="read a policy and node config as the hospital does; print what they "
                              "allow")
    check.add_argument("policy", type=Path, nargs="?", default=None, help="the policy file (TOML, JSON or YAML)")
    check.add_argument("--node-config", default="", help="the SuperNode's --node-config string")
    args = parser.parse_args(argv)
    from common.config import ConfigError

    try:
        return app_hash_command(args) if args.command == "app-hash" else policy_check_command(args)
    except (ConfigError, ValueError, OSError) as error:
        print(f"fedmed {args.command}: {error}", file=sys.stderr)
        return 2
