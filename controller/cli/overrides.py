"""`hvd override set|clear|list`: operator overrides of tau per tenant (optionally per workload).

Errors are raised (OverrideError is a ValueError) for controller/cli/main.py's `main` to print as one
line on stderr with exit status 2.
"""
from __future__ import annotations

import argparse
import re
from datetime import datetime, timedelta, timezone

from storage.engine import session_scope
from storage.limits import MAX_OVERRIDE_LIFETIME
from storage.models import TauOverride, utcnow
from storage.overrides import (
    MAX_UTC_OFFSET,
    OverrideError,
    OverrideSpec,
    check_expiry,
    clear_override,
    list_overrides,
    override_state,
    set_override,
)
from storage.tenants import normalise_tenant
from storage.workloads import WORKLOADS

_DURATION = re.compile(r"^\s*(\d{1,15})\s*([smhdw])\s*$", re.ASCII)
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_EXPIRES_CHARS = 64  # longer than any ISO 8601 time with timezone
# Widest printed column, in characters: longer values end in an ellipsis, so one hostile or long
# tenant/reason cannot push every row off the screen.
COLUMN_CAPS = {"id": 10, "tenant": 32, "workload": 10, "mode": 10, "tau": 14, "expires": 20, "author": 24,
               "reason": 48, "state": 96}

DESCRIPTION = """Override tau (the gate's threshold: verify a cache draft iff predicted accepted length > tau)
for a tenant, or one workload of a tenant. A tenant+workload override beats a tenant override, which
beats the workload's automatic tau. Setting an override replaces the active one for the same key;
nothing is deleted: `hvd override list --all` shows the audit trail."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `override` with subcommands `set`, `clear` and `list` to the `hvd` subparsers."""
    o = subparsers.add_parser("override", help="set, clear or list operator overrides of tau per tenant",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    osub = o.add_subparsers(dest="override_command", required=True, metavar="ACTION")

    def key_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--tenant", required=True, help="tenant id")
        sp.add_argument("--workload", help=f"one workload of the tenant ({', '.join(WORKLOADS)}); default: all of them")

    def audit_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--author", required=True, help="who is making the change")
        sp.add_argument("--reason", required=True, help="why (kept in the audit trail)")

    s = osub.add_parser("set", help="set (or replace) an override",
                        description="Set an override, replacing the active one for the same tenant and workload.")
    key_args(s)
    how = s.add_mutually_exclusive_group(required=True)
    how.add_argument("--tau", type=float, metavar="X", help="fixed tau, in [-1, 24]")
    how.add_argument("--bounds", type=float, nargs=2, metavar=("MIN", "MAX"),
                     help="clip the automatic tau into [MIN, MAX]")
    how.add_argument("--off", choices=["model", "cache"],
                     help="turn the gate off: always the model drafter, or always the cache draft when there is one")
    s.add_argument("--expires", metavar="WHEN",
                   help="a duration from now (30m, 2h, 7d, 1w) or an ISO 8601 time with timezone "
                        "(2026-12-01T08:00:00Z); default: never")
    audit_args(s)

    c = osub.add_parser("clear", help="clear the active override for a tenant (and workload)")
    key_args(c)
    audit_args(c)

    ls = osub.add_parser("list", help="list active overrides (--all: also cleared and expired ones)")
    ls.add_argument("--all", action="store_true", help="include cleared and expired overrides (audit trail)")


def parse_expires(text: str, now: datetime) -> datetime:
    """A duration (``30m``, ``2h``, ``7d``, ``1w``, ``45s``) from ``now``, or an ISO 8601 time with
    timezone; at most MAX_OVERRIDE_LIFETIME (~10 years) ahead, refused with an error naming --expires."""
    shown = repr(text[:MAX_EXPIRES_CHARS]) + ("…" if len(text) > MAX_EXPIRES_CHARS else "")
    m = _DURATION.match(text)
    if m:
        seconds = int(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        if seconds > MAX_OVERRIDE_LIFETIME.total_seconds():
            raise OverrideError(f"--expires {shown} is more than {MAX_OVERRIDE_LIFETIME.days} days from now; "
                                "an override lasts at most ~10 years")
        when = now + timedelta(seconds=seconds)
    else:
        try:
            if len(text) > MAX_EXPIRES_CHARS:
                raise ValueError
            when = datetime.fromisoformat(text.strip())
        except ValueError:
            raise OverrideError(
                f"--expires {shown} is neither a duration (30m, 2h, 7d) nor an ISO 8601 time"
            ) from None
        offset = when.utcoffset()
        if offset is None:
            raise OverrideError(f"--expires {shown} has no timezone; add one, e.g. Z or +02:00")
        if abs(offset) > MAX_UTC_OFFSET:
            raise OverrideError(f"--expires {shown} has a UTC offset beyond +-14:00")
    check_expiry(when, now, field="--expires")
    return when.astimezone(timezone.utc)


def spec_from_args(args: argparse.Namespace, now: datetime) -> OverrideSpec:
    if args.tau is not None:
        mode, tau, bounds = "fixed", args.tau, (None, None)
    elif args.bounds is not None:
        mode, tau, bounds = "bounds", None, tuple(args.bounds)
    else:
        mode, tau, bounds = f"off_{args.off}", None, (None, None)
    return OverrideSpec(
        tenant=args.tenant,
        workload=args.workload,
        mode=mode,
        tau=tau,
        tau_min=bounds[0],
        tau_max=bounds[1],
        expires_at=None if args.expires is None else parse_expires(args.expires, now),
        author=args.author,
        reason=args.reason,
    )


def _fmt_time(t: datetime | None) -> str:
    return "never" if t is None else t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _fmt_value(row: TauOverride) -> str:
    if row.mode == "fixed":
        return f"{row.tau:g}"
    if row.mode == "bounds":
        return f"[{row.tau_min:g}, {row.tau_max:g}]"
    return "-"


def _fmt_state(row: TauOverride, now: datetime) -> str:
    state = override_state(row, now)
    if state == "cleared":
        return f"cleared {_fmt_time(row.cleared_at)} by {row.cleared_by}: {row.clear_reason}"
    return state


def escape(value: str) -> str:
    """``value`` with every non-printable character (control, escape, zero-width, separators) shown
    as its Python escape (``\\x1b``, ``\\n``, ``\\u200b``), so stored text cannot drive the terminal."""
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for ch in value)


def cell(value: str, cap: int) -> str:
    """``value`` escaped and cut to ``cap`` characters, the last one an ellipsis when cut."""
    text = escape(value)
    return text if len(text) <= cap else text[: cap - 1] + "…"


def format_table(rows: list[TauOverride], now: datetime) -> str:
    """One line per override, columns escaped and capped (COLUMN_CAPS), padded to the widest cell."""
    header = tuple(COLUMN_CAPS)
    table = [header] + [
        tuple(cell(v, cap) for v, cap in zip(
            (str(r.id), r.tenant, r.workload or "*", r.mode, _fmt_value(r), _fmt_time(r.expires_at), r.author,
             " ".join(r.reason.split()), _fmt_state(r, now)), COLUMN_CAPS.values()))
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + "  " + line[-1] for line in table
    )


def run(args: argparse.Namespace, engine, now: datetime | None = None) -> int:
    """Execute `hvd override ...`; raises OverrideError (a ValueError) on bad input."""
    now = utcnow() if now is None else now
    action = args.override_command
    if action == "set":
        spec = spec_from_args(args, now)
        with session_scope(engine) as session:
            row = set_override(session, spec, WORKLOADS, now=now)
            replaced = [r.id for r in list_overrides(session, include_inactive=True, now=now)
                        if r.clear_reason == f"replaced by #{row.id}"]
            print(f"override #{row.id} set for tenant {escape(row.tenant)} workload {row.workload or '*'}: "
                  f"{row.mode} {_fmt_value(row)}, expires {_fmt_time(row.expires_at)}"
                  + (f" (replaces #{', #'.join(map(str, replaced))})" if replaced else ""))
        return 0
    if action == "clear":
        if args.workload is not None and args.workload not in WORKLOADS:
            raise OverrideError(f"workload {args.workload!r:.60} is unknown; expected one of {', '.join(WORKLOADS)}")
        with session_scope(engine) as session:
            n = clear_override(session, args.tenant, args.workload, args.author, args.reason, now=now)
        print(f"cleared {n} override{'s' if n != 1 else ''} for tenant {escape(normalise_tenant(args.tenant))} "
              f"workload {args.workload or '*'}")
        return 0
    if action == "list":
        with session_scope(engine) as session:
            rows = list_overrides(session, include_inactive=args.all, now=now)
        if not rows:
            print("no overrides" if args.all else "no active overrides (--all shows cleared and expired ones)")
        else:
            print(format_table(rows, now))
        return 0
    raise OverrideError(f"unknown override action {action!r}")
