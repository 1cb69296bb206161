"""`hvd rollback`, `hvd pin` and `hvd unpin`: an operator's moves of the champion aliases (`champion`,
or with --workload W a workload's own `champion/W`, which decides W before `champion` does).

Every move goes through predictor.gate.registry.move_alias (the blob loads and scores, the alias
still names what was read, no pin holds it). A pin holds an alias against the learner until it is
lifted; while pinned, the alias moves only by another pin. Errors are raised (ValueError,
LookupError, StorageError) for controller/cli/main.py's `main` to print as one line, exit status 2.
"""
from __future__ import annotations

import argparse

from controller.cli.overrides import escape
from storage.workloads import WORKLOADS

WORKLOAD_HELP = (f"a workload's own champion, champion/WORKLOAD ({', '.join(WORKLOADS)}); "
                 "default: the global champion")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `rollback`, `pin` and `unpin` to the `hvd` subparsers."""
    rb = sub.add_parser("rollback", help="move a champion alias back (to its parent, or --to VERSION)",
                        description="Point `champion` at the current champion's parent, or with --workload W "
                                    "`champion/W` at the version it named before the learner's last move of it "
                                    "(or either at --to VERSION). Refused while the alias is pinned. Running "
                                    "controllers pick it up within seconds; the move is audited.")
    rb.add_argument("--workload", choices=WORKLOADS, help=WORKLOAD_HELP)
    rb.add_argument("--to", type=int, metavar="VERSION", help="version id to move the alias to")
    rb.add_argument("--author", required=True)
    rb.add_argument("--reason", required=True)

    pn = sub.add_parser("pin", help="hold a champion alias at a version against the learner (audited)",
                        description="Move `champion` (or with --workload W `champion/W`) to VERSION if it names "
                                    "another, and hold it there: the learner's promotions and rollbacks of it are "
                                    "refused until `hvd unpin`. Pinning another version replaces the pin.")
    pn.add_argument("--workload", choices=WORKLOADS, help=WORKLOAD_HELP)
    pn.add_argument("--version", type=int, required=True, metavar="VERSION", help="version id to hold")
    pn.add_argument("--author", required=True)
    pn.add_argument("--reason", required=True)

    up = sub.add_parser("unpin", help="lift the pin on a champion alias (audited)",
                        description="Lift the pin on `champion` (or with --workload W `champion/W`). The alias "
                                    "stays where it is; the learner may move it again from its next round.")
    up.add_argument("--workload", choices=WORKLOADS, help=WORKLOAD_HELP)
    up.add_argument("--author", required=True)
    up.add_argument("--reason", required=True)


def rollback(args: argparse.Namespace, engine) -> int:
    from predictor.gate.registry import alias_of, rollback_alias
    from storage.engine import session_scope

    name = alias_of(getattr(args, "workload", None))
    with session_scope(engine) as session:
        # refuses an unloadable blob, a pinned alias, and one someone moved since it was read in here
        before, after = rollback_alias(session, name, reason=args.reason, actor=args.author, to=args.to)
    print(f"{name}: {'no version' if before is None else f'v{before}'} -> v{after}")
    return 0


def pin(args: argparse.Namespace, engine) -> int:
    from predictor.gate.registry import alias_of, move_alias
    from storage.engine import session_scope
    from storage.versions import get_alias_version

    name = alias_of(args.workload)
    with session_scope(engine) as session:
        current = get_alias_version(session, name)
        before = None if current is None else current.id
        move_alias(session, name, args.version, reason=args.reason, actor=args.author, expected=before, pin=True)
    moved = "" if before == args.version else f" (moved from {'no version' if before is None else f'v{before}'})"
    print(f"{name}: pinned to v{args.version}{moved} by {escape(args.author)}")
    return 0


def unpin(args: argparse.Namespace, engine) -> int:
    from predictor.gate.registry import alias_of
    from storage.engine import session_scope
    from storage.pins import unpin_alias

    name = alias_of(args.workload)
    with session_scope(engine) as session:
        held = unpin_alias(session, name, reason=args.reason, actor=args.author)
    print(f"{name}: unpinned (it stays at v{held}; the learner may move it again)")
    return 0


COMMANDS = {"rollback": rollback, "pin": pin, "unpin": unpin}
