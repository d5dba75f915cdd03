"""``fedmed audit verify LOG [--head HASH] [--peer OTHER_LOG --name NAME]``: check an audit log's chain
(``common/trust/audit.py``, docs/privacy.md). ``fedmed audit rebuild-ledger LOG STATE_FOLDER`` and ``fedmed audit
rebuild-secagg-memory LOG STATE_FOLDER``: a hospital operator's repair of a privacy ledger or a secure-aggregation
memory that no longer matches the audit log (the hospital refuses to train, or to take part in secure rounds, until
then).

Exit status 0 when the chain is intact (and the recorded hashes are found), 1 when a line was edited, inserted,
removed, reordered or cut short (each named by its line number), or when NAME is in no line of OTHER_LOG; 2 when
the file cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from cli.arguments import OneLineParser
from common.trust.audit import cross_check, verify


def main(argv: list[str] | None = None) -> int:
    """``argv``: the words after ``fedmed`` (a leading ``audit`` is skipped), e.g. ``["verify", "audit.jsonl"]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["audit"]:
        argv = argv[1:]
    parser = OneLineParser(prog="fedmed audit", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("verify", help="check an audit log's SHA-256 chain, line by line")
    check.add_argument("log", help="the audit log (a hospital's audit.jsonl, or the server's <run>/audit.jsonl)")
    check.add_argument("--head", default="", help="a hash of this log recorded elsewhere (the last one printed by an "
                       "earlier verify, a note): it must still be a line of the log, which shows lines removed from "
                       "its end")
    check.add_argument("--peer", default="", help="the other end's log, whose lines record this log's hashes "
                       "(peer-audit-head: the server's log records each hospital's); needs --name")
    check.add_argument("--name", default="", help="with --peer: the hospital whose log LOG is, as the server "
                       "names it (hospital-00)")
    memory = sub.add_parser("rebuild-secagg-memory", help="write a hospital's secure-aggregation memory (the rounds "
                            "and models it took part in) anew from its audit log")
    memory.add_argument("log", help="the hospital's audit log (its chain must verify)")
    memory.add_argument("folder", help="the hospital's state folder, where secure-aggregation.jsonl lives (the old one "
                        "is kept beside it)")
    rebuild = sub.add_parser("rebuild-ledger", help="write a hospital's privacy ledger anew from its audit log")
    rebuild.add_argument("log", help="the hospital's audit log (its chain must verify)")
    rebuild.add_argument("folder", help="the hospital's state folder, where privacy-ledger.json lives (the old one "
                         "is kept beside it)")
    args = parser.parse_args(argv)
    if args.command == "rebuild-ledger":
        from common.trust.ledger import rebuild_ledger
        from common.trust.policy import PolicyRefusal

        try:
            count = rebuild_ledger(args.log, args.folder)
        except (OSError, PolicyRefusal) as error:
            print(f"fedmed audit rebuild-ledger: {error}", file=sys.stderr)
            return 2
        print(f"{args.folder}: privacy ledger rebuilt from {args.log}: {count} training(s)")
        return 0
    if args.command == "rebuild-secagg-memory":
        from common.trust.secure_aggregation.hospital import SecureAggregationRefusal, rebuild_memory

        try:
            counts = rebuild_memory(args.log, args.folder)
        except (OSError, SecureAggregationRefusal) as error:
            print(f"fedmed audit rebuild-secagg-memory: {error}", file=sys.stderr)
            return 2
        print(f"{args.folder}: secure-aggregation memory rebuilt from {args.log}: {counts['rounds']} round(s), "
              f"{counts['revealed']} model(s) revealed")
        return 0
    if args.peer and not args.name:
        parser.error("--peer needs --name (the hospital whose log is checked, as the other log names it)")
    try:
        result = verify(args.log, args.head or None)
        peer_problems = cross_check(args.log, args.peer, args.name) if args.peer else []
    except OSError as error:
        print(f"fedmed audit: {error.filename or args.log}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(result.report())
    for number, what in peer_problems:
        print(f"  {args.peer} line {number}: {what}")
    if args.peer and not peer_problems:
        print(f"{args.peer}: every hash it recorded for {args.name} is a line of {args.log}")
    return 0 if result.ok and not peer_problems else 1


if __name__ == "__main__":
    sys.exit(main())
