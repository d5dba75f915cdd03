"""``fedmed console [--state FOLDER] [--results FOLDER] ...``: serve the read-only page (docs/privacy.md,
docs/tracking.md). A bad argument (a folder that is not there, a file that cannot be read, an address beyond this
machine without a token) is one line on stderr and exit status 2; nothing is started.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from cli.arguments import OneLineParser

TOKEN_VARIABLE = "FEDMED_CONSOLE_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="fedmed console", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", type=Path, default=None, help="a hospital's state folder (its audit.jsonl, "
                        "privacy-ledger.json, secure-aggregation.jsonl), or a folder of them (a simulation's state/)")
    parser.add_argument("--results", type=Path, default=None, help="a results folder (one run folder per run), or "
                        "one run's folder")
    parser.add_argument("--policy", action="append", default=[], metavar="[HOSPITAL=]FILE", help="the hospital's "
                        "policy file (its node config's policy-file): its limits, budget and approved code are shown; "
                        "with a folder of hospitals, HOSPITAL=FILE for each (repeat the option)")
    parser.add_argument("--node-config", default="", help="the hospital's SuperNode --node-config string, as for "
                        "`fedmed policy check`")
    parser.add_argument("--server-log", type=Path, default=None, help="the server's audit log of a run, to check the "
                        "hospital's log against (`fedmed audit verify --peer`); with --results each run's own is used")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine "
                        "only); any other needs --token")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    parser.add_argument("--token", default=None, help=f"a secret every request must carry (?token=... once, or "
                        f"Authorization: Bearer ...); default ${TOKEN_VARIABLE}. Required off 127.0.0.1")
    return parser


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def checked(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work (one line), or None."""
    if args.state is None and args.results is None:
        return "give --state (a hospital's state folder) and/or --results (a results folder)"
    for option in ("state", "results"):
        folder = getattr(args, option)
        if folder is not None and not folder.is_dir():
            return f"--{option} {folder}: not a folder"
    named = [("--policy", path) for _, path in policies(args.policy)]
    for option, path in named + [("--server-log", args.server_log)]:
        if path is not None:
            try:
                path.open("rb").close()
            except OSError as error:
                return f"{option} {path}: cannot be read ({error.strerror or error})"
    for _, path in policies(args.policy):  # a policy the page could not show is refused now, not on the page
        from common.settings import ConfigError
        from common.trust.policy import read_policy

        try:
            read_policy(path)
        except ConfigError as error:
            return f"--policy: {str(error).splitlines()[0]}"
    if not 0 < args.port < 65536:
        return f"--port {args.port}: not a port (1-65535)"
    if not is_loopback(args.host) and not args.token:
        return (f"--host {args.host} serves beyond this machine: give --token (or set ${TOKEN_VARIABLE}) so that only "
                "those who hold it can read these pages")
    if args.token is not None and len(args.token) < 16:
        return "--token: at least 16 characters (a guessable token protects nothing)"
    return cannot_listen(args.host, args.port)


def cannot_listen(host: str, port: int) -> str | None:
    """Why the address cannot be served on (taken, not this machine's), checked before anything starts."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        return f"cannot serve on {host}:{port}: {error.strerror or error}"
    return None


def policies(values: list[str]) -> list[tuple[str, Path]]:
    """``--policy`` values: ``FILE`` (every hospital shown) or ``HOSPITAL=FILE``."""
    pairs = []
    for value in values:
        name, _, path = value.partition("=") if "=" in value and not Path(value).exists() else ("", "", value)
        pairs.append((name, Path(path)))
    return pairs


def main(argv: list[str] | None = None) -> int:
    """``argv``: the words after ``fedmed`` (a leading ``console`` is skipped)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["console"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    if args.token is None:
        args.token = os.environ.get(TOKEN_VARIABLE) or None
    problem = checked(args)
    if problem:
        print(f"fedmed console: {problem}", file=sys.stderr)
        return 2
    import uvicorn

    from console.app import Sources, create_app

    sources = Sources(state=args.state.resolve() if args.state else None,
                      results=args.results.resolve() if args.results else None,
                      policies=tuple((name, path.resolve()) for name, path in policies(args.policy)),
                      node_config=args.node_config,
                      server_log=args.server_log.resolve() if args.server_log else None)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"fedmed console: http://{shown}:{args.port}/ (read-only; Ctrl-C stops it)", flush=True)
    try:
        uvicorn.run(create_app(sources, token=args.token), host=args.host, port=args.port, log_level="warning")
    except (OSError, SystemExit) as error:  # taken since it was checked
        print(f"fedmed console: cannot serve on {args.host}:{args.port} ({error})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
