"""The lengths storage holds, in one place, for the edges (CLI, plugin, dashboard) to check against.

Values from outside with no natural bound (request ids, replica and holder names built from
hostnames, actors derived from them) are stored as unbounded TEXT. Names an operator or a client
chooses (tenants, authors) have a stated limit, enforced at the edge with an error naming the field
(storage.tenants) and backed by the column type. Values the code itself chooses (workloads, modes,
hashes, alias names) keep their short columns.
"""
from __future__ import annotations

from datetime import timedelta

MAX_TENANT_LEN = 128  # decision_events / stat_buckets / tau_overrides.tenant: VARCHAR(128)
MAX_AUTHOR_LEN = 128  # tau_overrides.author / cleared_by: VARCHAR(128)
MAX_WORKLOAD_LEN = 32  # workload columns: VARCHAR(32); workloads come from a fixed list
MAX_REASON_LEN = 4000  # free text (TEXT); bounded so one audit row stays readable
MAX_OVERRIDE_LIFETIME = timedelta(days=3653)  # an override may expire at most ~10 years from now


def text_problem(field: str, value: object, limit: int | None) -> str | None:
    """Why a string column cannot hold ``value`` on every backend (naming ``field``), or None.

    PostgreSQL refuses NUL, lone surrogates (not UTF-8) and values over a VARCHAR's length, each
    failing the whole statement; SQLite stores them all, so the check is ours, before SQL.
    """
    if not isinstance(value, str):
        return f"{field} must be a string, got {type(value).__name__}"
    if limit is not None and len(value) > limit:
        return f"{field} is {len(value)} characters long; at most {limit} allowed"
    if "\x00" in value:
        return f"{field} contains NUL, which PostgreSQL cannot store"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{field} contains a lone surrogate, which UTF-8 cannot hold"
    return None
