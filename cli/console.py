"""``fedmed console [--state FOLDER] [--results FOLDER] ...``: serve the read-only page (docs/privacy.md,
docs/tracking.md); ``--report FILE`` writes one hospital's participation over a period as one static HTML page to
sign and archive, and serves nothing. A bad argument (a folder that is not there, a file that cannot be read, an
address beyond this machine without a token or TLS) is one line on stderr and exit status 2; nothing is started.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
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
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME", help="a Host name the pages "
                        "are served under (repeat it); others are refused, so a name rebound to this address reads "
                        "nothing. Default: the --host address, and localhost on 127.0.0.1, or this machine's names")
    parser.add_argument("--tls-cert", type=Path, default=None, help="a PEM certificate: serve HTTPS (with --tls-key); "
                        "required off 127.0.0.1, unless a TLS reverse proxy on this machine serves it from 127.0.0.1")
    parser.add_argument("--tls-key", type=Path, default=None, help="the PEM private key of --tls-cert")
    parser.add_argument("--report", type=Path, default=None, metavar="FILE", help="write one hospital's "
                        "participation (runs, what left, epsilon against its budget, refusals, its audit chain and "
                        "head hashes) as one self-contained HTML page to FILE, and exit")
    parser.add_argument("--hospital", default="", help="with --report and a folder of hospitals: which one")
    parser.add_argument("--since", default="", metavar="YYYY-MM-DD", help="with --report: from this day (UTC)")
    parser.add_argument("--until", default="", metavar="YYYY-MM-DD", help="with --report: to this day, included")
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
    for option, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not path.is_file():
            return f"{option} {path}: not a file"
    if (args.tls_cert is None) != (args.tls_key is None):
        return "--tls-cert and --tls-key go together"
    for option in ("since", "until"):
        value = getattr(args, option)
        if value and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
            return f"--{option} {value}: not a day (YYYY-MM-DD)"
    if args.report is not None:
        return None
    if not 0 < args.port < 65536:
        return f"--port {args.port}: not a port (1-65535)"
    if not is_loopback(args.host) and not args.token:
        return (f"--host {args.host} serves beyond this machine: give --token (or set ${TOKEN_VARIABLE}) so that only "
                "those who hold it can read these pages")
    if args.token is not None and len(args.token) < 16:
        return "--token: at least 16 characters (a guessable token protects nothing)"
    if not is_loopback(args.host) and args.tls_cert is None:
        return (f"--host {args.host} serves beyond this machine: give --tls-cert and --tls-key so that the token "
                "does not cross the network in clear (or serve on 127.0.0.1 behind a TLS reverse proxy)")
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


def allowed_hosts(args: argparse.Namespace) -> list[str]:
    """The Host names served: those named, else the address served on and this machine's own names for it."""
    if args.allowed_host:
        return list(args.allowed_host)
    names = [args.host]
    if is_loopback(args.host):
        names += ["localhost", "127.0.0.1"]
    elif args.host in ("0.0.0.0", "::"):
        names += [socket.gethostname(), socket.getfqdn()]
    return sorted(set(names))


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
    if args.report is not None:
        from console.report import ReportError, write_report

        try:
            written = write_report(sources, args.report, hospital=args.hospital, since=args.since, until=args.until)
        except (ReportError, OSError) as error:
            print(f"fedmed console --report: {error}", file=sys.stderr)
            return 2
        print(f"fedmed console: {written}")
        return 0
    shown = f"[{args.host}]" if ":" in args.host else args.host
    scheme = "https" if args.tls_cert else "http"
    app = create_app(sources, token=args.token, allowed_hosts=allowed_hosts(args),
                     secure_cookie=not is_loopback(args.host) or args.tls_cert is not None)
    app.state.views.warm()  # every hospital's log verified and read before the first page is asked for
    print(f"fedmed console: {scheme}://{shown}:{args.port}/ (read-only; Ctrl-C stops it)", flush=True)
    tls = {"ssl_certfile": str(args.tls_cert), "ssl_keyfile": str(args.tls_key)} if args.tls_cert else {}
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **tls)
    except (OSError, SystemExit) as error:  # taken since it was checked
        print(f"fedmed console: cannot serve on {args.host}:{args.port} ({error})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
