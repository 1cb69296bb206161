"""Repository for per-minute engine step costs (storage.models.StepCostMinute): written by each
replica's step-cost writer, read by the dashboard's Health page.

A (replica, minute) row is only ever added to, with one ``INSERT ... ON CONFLICT (replica, minute)
DO UPDATE`` per chunk, the pattern of storage.stats.upsert_buckets: steps, sums and drafter steps
add, the means are weighted by steps, and p50/p90 are taken from whichever of the stored row and
the new summary has more steps. That last part is an approximation (the samples behind a quantile
are not stored): exact when a replica writes a minute once, which is the usual case; a minute is
written in two pieces only when the writer closed it before a late step arrived or the clock
stepped back, and then the larger piece's quantiles stand for the minute.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, Protocol

from sqlalchemy import case, select
from sqlalchemy.orm import Session

from storage.engine import upsert_insert
from storage.limits import text_problem
from storage.models import StepCostMinute
from storage.retention import keep_newest

# The parts of a step whose sum/p50/p90 are stored ("<part>_ms_sum" ...), in the order of a summary's
# sum_s / p50_s / p90_s (controller.core.step_costs.SUMMARY_PARTS, which a test holds to this).
STEP_PARTS = ("target", "hvd", "drafter", "rest", "total")
STATS = ("sum", "p50", "p90")
KEEP_STEP_COST_MINUTES = 100_000  # rows kept: ~69 days of one replica, a week of ten
UPSERT_CHUNK = 200  # rows per statement (22 columns: under SQLite's bound-parameter limit)
MEAN_COLUMNS = ("batch_mean", "query_tokens_mean")


class MinuteLike(Protocol):
    """A minute's summary (controller.core.step_costs.MinuteSummary): seconds per STEP_PARTS."""

    minute: int
    steps: int
    sum_s: Sequence[float]
    p50_s: Sequence[float]
    p90_s: Sequence[float]
    batch_mean: float
    query_tokens_mean: float
    drafter_steps: int


def column(part: str, stat: str) -> str:
    """The column holding one statistic (sum, p50, p90) of one part, in milliseconds."""
    return f"{part}_ms_{stat}"


def _row(replica: str, s: MinuteLike) -> dict[str, Any]:
    if s.minute % 60:
        raise ValueError(f"step cost minute must be a multiple of 60 s, got {s.minute}")
    if s.steps < 1 or not 0 <= s.drafter_steps <= s.steps:
        raise ValueError(f"step cost minute {s.minute}: steps {s.steps}, drafter_steps {s.drafter_steps}")
    row: dict[str, Any] = {"replica": replica, "minute": datetime.fromtimestamp(s.minute, timezone.utc),
                           "steps": int(s.steps), "drafter_steps": int(s.drafter_steps),
                           "batch_mean": float(s.batch_mean), "query_tokens_mean": float(s.query_tokens_mean)}
    for stat, values in zip(STATS, (s.sum_s, s.p50_s, s.p90_s)):
        if len(values) != len(STEP_PARTS):
            raise ValueError(f"step cost minute {s.minute}: {stat} has {len(values)} parts, not {len(STEP_PARTS)}")
        for part, seconds in zip(STEP_PARTS, values):
            row[column(part, stat)] = 1000.0 * float(seconds)
    bad = [k for k, v in row.items() if isinstance(v, float) and not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"step cost minute {s.minute}: {', '.join(bad)} must be finite and >= 0")
    return row


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two rows of one (replica, minute) as the upsert would combine them."""
    steps = a["steps"] + b["steps"]
    big = b if b["steps"] > a["steps"] else a
    out = dict(a, steps=steps, drafter_steps=a["drafter_steps"] + b["drafter_steps"])
    for name in MEAN_COLUMNS:
        out[name] = (a[name] * a["steps"] + b[name] * b["steps"]) / steps
    for part in STEP_PARTS:
        out[column(part, "sum")] = a[column(part, "sum")] + b[column(part, "sum")]
        for stat in ("p50", "p90"):
            out[column(part, stat)] = big[column(part, stat)]
    return out


def record_minutes(session: Session, replica: str, summaries: Iterable[MinuteLike]) -> int:
    """Add `summaries` (one replica's) to their rows, creating missing ones, in the session's
    transaction; two summaries of one minute are combined first. Returns the rows written. Atomic
    per row on SQLite and PostgreSQL, so a minute written in pieces never loses steps."""
    problem = text_problem("replica", replica, None)
    if problem:
        raise ValueError(problem)
    rows: dict[datetime, dict[str, Any]] = {}
    for s in summaries:
        row = _row(replica, s)
        key = row["minute"]
        rows[key] = _merge(rows[key], row) if key in rows else row
    if not rows:
        return 0
    insert = upsert_insert(session, "record_minutes")
    table = StepCostMinute.__table__
    ordered = [rows[k] for k in sorted(rows)]  # concurrent writers lock rows in the same order
    for i in range(0, len(ordered), UPSERT_CHUNK):
        stmt = insert(table).values(ordered[i:i + UPSERT_CHUNK])
        old, new = table.c, stmt.excluded
        steps = old.steps + new.steps
        bigger = new.steps > old.steps
        set_ = {"steps": steps, "drafter_steps": old.drafter_steps + new.drafter_steps}
        for name in MEAN_COLUMNS:
            set_[name] = (old[name] * old.steps + new[name] * new.steps) / steps
        for part in STEP_PARTS:
            set_[column(part, "sum")] = old[column(part, "sum")] + new[column(part, "sum")]
            for stat in ("p50", "p90"):
                name = column(part, stat)
                set_[name] = case((bigger, new[name]), else_=old[name])
        session.execute(stmt.on_conflict_do_update(index_elements=["replica", "minute"], set_=set_))
    return len(ordered)


def recent_minutes(session: Session, since: datetime, replica: str | None = None) -> list[StepCostMinute]:
    """The minutes starting at or after `since` (every replica's, or one's), by replica and minute."""
    stmt = select(StepCostMinute).where(StepCostMinute.minute >= since)
    if replica is not None:
        stmt = stmt.where(StepCostMinute.replica == replica)
    return list(session.scalars(stmt.order_by(StepCostMinute.replica, StepCostMinute.minute)))


def prune_step_cost_minutes(session: Session, keep_last: int = KEEP_STEP_COST_MINUTES) -> int:
    """Delete the oldest rows beyond the newest `keep_last` (by id: rows are made in about minute
    order, and adding to a row keeps its id); returns the count."""
    return keep_newest(session, StepCostMinute, keep_last)
