"""tau_history's retention: the learner appends a row per workload whose automatic tau changed, every
round with changes, forever otherwise (a row a round is ~170k rows a day at the learner's pace).

Rows older than KEEP_TAU_DAYS go, and beyond that the table keeps at most KEEP_TAU_ROWS (the newest):
the age bounds what the dashboard's history can show (the same 30 days as stat_buckets), the row cap
bounds the table when the learner changes tau unusually often. The learner prunes where it writes,
in the round's own transaction, at its first write and then every PRUNE_EVERY rows written: one
indexed delete now and then (ix_tau_history_at and the primary key), so a round stays as fast.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session

from storage.models import TauHistory
from storage.retention import keep_newest

KEEP_TAU_DAYS = 30
KEEP_TAU_ROWS = 200_000
PRUNE_EVERY = 500  # rows written between two prunes


def prune_tau_history(session: Session, now: datetime, keep_days: float = KEEP_TAU_DAYS,
                      keep_rows: int = KEEP_TAU_ROWS) -> int:
    """Delete the rows older than `keep_days` before `now`, then all but the newest `keep_rows`;
    returns how many went. `latest_corrections` reads each workload's newest row, so a workload
    whose tau has not changed for `keep_days` falls back to no correction, as on a fresh install."""
    if now.tzinfo is None:
        raise ValueError(f"now {now.isoformat()} is naive; a timezone-aware datetime is required")
    old = session.execute(delete(TauHistory).where(TauHistory.at < now - timedelta(days=keep_days))).rowcount or 0
    return int(old) + keep_newest(session, TauHistory, keep_rows)


class TauRetention:
    """When the learner prunes: at its first write (a restarted leader finds what the last one left)
    and every `every` rows written after. Counts what it deleted (`pruned`)."""

    def __init__(self, every: int = PRUNE_EVERY, keep_days: float = KEEP_TAU_DAYS,
                 keep_rows: int = KEEP_TAU_ROWS) -> None:
        if every < 1 or keep_rows < 0 or keep_days <= 0:
            raise ValueError(f"every >= 1, keep_rows >= 0 and keep_days > 0 required, got {every}, {keep_rows}, "
                             f"{keep_days}")
        self.every, self.keep_days, self.keep_rows = every, keep_days, keep_rows
        self.pruned = 0
        self._since = every  # rows written since the last prune: the first write prunes

    def wrote(self, session: Session, now: datetime, rows: int) -> int:
        """`rows` tau_history rows were just added in `session`: prune when due; returns the rows deleted."""
        if rows <= 0:
            return 0
        self._since += rows
        if self._since < self.every:
            return 0
        self._since = 0
        n = prune_tau_history(session, now, self.keep_days, self.keep_rows)
        self.pruned += n
        return n
