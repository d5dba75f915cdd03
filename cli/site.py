"""A hospital operator's commands: what an app bundle holds before approving it, what the site's policy allows, and
the fingerprints of the consortium's keys it pins.

    fedmed app-hash [APP_DIR]                       # the SHA-256 a SuperNode sees for this app, and its files
    fedmed policy check [--node-config "..."] [POLICY_FILE]   # what the server may and may not make this site do
    fedmed key-fingerprint KEY.pub [KEY.pub ...]    # each key's SHA-256 fingerprint (--peers: as the policy's table)

``app-hash`` builds the bundle (FAB) as ``flwr run`` builds it (Flower's own builder, so the hash is the one the
SuperLink sends): add the hash to the policy's ``apps`` (or node config ``approved-apps``) once the files were
reviewed. ``policy check`` reads the policy and node config as the hospital does for every message and prints what
they allow (as NVIDIA FLARE's ``authz_preview`` does for its site policies). ``key-fingerprint`` prints what the
hospitals' officers read to each other (not through the coordinator) before pinning a key in their policy's
``peers``: OpenSSH's fingerprint, the same as ``ssh-keygen -l -f KEY.pub`` (a private key: its public half's).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import zipfile
from pathlib import Path

from cli.arguments import OneLineParser
from client_app.policy_rules import policy_rules


def app_hash(app_dir: Path) -> tuple[str, list[tuple[str, str, int]]]:
    """The FAB's SHA-256 and its files (path, SHA-256, bytes), from Flower's own builder."""
    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(app_dir)
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        files = [(info.filename, hashlib.sha256(archive.read(info)).hexdigest(), info.file_size)
                 for info in archive.infolist()]
    return hashlib.sha256(fab).hexdigest(), files


def app_hash_command(args: argparse.Namespace) -> int:
    from cli.arguments import usable_path
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


def key_fingerprint_command(args: argparse.Namespace) -> int:
    """Each key's fingerprint and the hospital it is named for (the file name without .pub); ``--peers``: the lines
    of a policy's ``[peers]`` table."""
    from common.trust.identity import key_fingerprint, own_fingerprint

    rows = []
    for path in args.keys:
        try:
            fingerprint = key_fingerprint(path)
        except ValueError:
            try:
                fingerprint = own_fingerprint(path)
            except ValueError:
                raise ValueError(f"{str(path)!r} is not an OpenSSH ECDSA public or private key (deploy/"
                                 "make_hospital_keys.sh makes them)") from None
        rows.append((path.name.removesuffix(".pub"), fingerprint, path))
    if args.peers:
        print("[peers]  # compared with each hospital's officer, not through the coordinator")
        print("\n".join(f'"{name}" = "{fingerprint}"' for name, fingerprint, _ in rows))
    else:
        print("\n".join(f"{fingerprint}  {name}  ({path})" for name, fingerprint, path in rows))
    return 0


def policy_check_command(args: argparse.Namespace) -> int:
    rows = policy_rules(args.node_config, args.policy)
    print("\n".join([" ".join(rows[0])] + [f"{what}: {value}" for what, value in rows[1:]]))
    return 0


def main(argv: list[str]) -> int:
    """``argv``: the words after ``fedmed``, starting with ``app-hash``, ``policy`` or ``key-fingerprint``."""
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
    keys = sub.add_parser("key-fingerprint", help="a hospital key's SHA-256 fingerprint, to compare with its "
                          "officer and pin in the policy's peers")
    keys.add_argument("keys", type=Path, nargs="+", help="public key files, <hospital>.pub (or a private key)")
    keys.add_argument("--peers", action="store_true", help="print them as a policy's [peers] table")
    args = parser.parse_args(argv)
    from common.config import ConfigError

    commands = {"app-hash": app_hash_command, "policy": policy_check_command,
                "key-fingerprint": key_fingerprint_command}
    try:
        return commands[args.command](args)
    except (ConfigError, ValueError, OSError) as error:
        print(f"fedmed {args.command}: {error}", file=sys.stderr)
        return 2
