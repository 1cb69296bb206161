"""Repository for decision events: bulk insert (one transaction per batch) and simple reads."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, text, true, tuple_
from sqlalchemy.orm import Session

from storage.limits import MAX_TENANT_LEN, MAX_WORKLOAD_LEN, text_problem
from storage.models import DecisionEvent

# The dead-letter table's cap, every replica's letters together: the newest are kept, pruned by each
# replica's event writer (at its first retention pass and after it sets more aside). A letter is
# about 1 KB (the event as JSON, its features in hex, the reason): ~100 MB at most.
KEEP_DEAD_LETTERS = 100_000
EVENT_COLUMNS = ("at", "tenant", "workload", "request_id", "position", "drafter", "decision", "draft_len",
                 "accepted", "predicted", "tau", "predictor_version_id", "features")
# String columns and their limits (None: TEXT); the short internal ones are VARCHAR(16).
_TEXT_LIMITS = {"tenant": MAX_TENANT_LEN, "workload": MAX_WORKLOAD_LEN, "request_id": None, "drafter": 16,
                "decision": 16}


def event_row_problem(row: dict[str, Any]) -> str | None:
    """Why the database would refuse ``row`` (naming the field), or None if it can be stored.

    Cheap enough for every row of a batch: an over-long tenant, NUL or a lone surrogate fails a
    whole executemany on PostgreSQL (SQLite would store it), so a writer checks rows first and
    sets aside only the ones that can never be written.
    """
    for field, limit in _TEXT_LIMITS.items():
        problem = text_problem(field, row.get(field), limit)
        if problem is not None:
            return problem
    return None


def split_storable(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
    """``rows`` split into those the database can store and (row, reason) for those it never will."""
    good: list[dict[str, Any]] = []
    bad: list[tuple[dict[str, Any], str]] = []
    for row in rows:
        problem = event_row_problem(row)
        if problem is None:
            good.append(row)
        else:
            bad.append((row, problem))
    return good, bad


def insert_events(session: Session, rows: Sequence[dict[str, Any]]) -> int:
    """Insert plain dict rows (keys: EVENT_COLUMNS) in one executemany; returns the count."""
    if rows:
        # Core executemany: several times faster than the ORM's bulk path for plain rows.
        session.connection().execute(insert(DecisionEvent.__table__), list(rows))
    return len(rows)


def record_receipt(session: Session, writer: str, first_seq: int, rows: int) -> None:
    """Note, in the transaction that inserts them, that `writer`'s chunk starting at `first_seq` is
    stored (one row per writer, replaced each time)."""
    from storage.models import EventReceipt, utcnow

    table = EventReceipt.__table__
    values = {"first_seq": first_seq, "rows": rows, "at": utcnow()}
    updated = session.connection().execute(table.update().where(table.c.writer == writer).values(**values))
    if not updated.rowcount:
        session.connection().execute(insert(table).values(writer=writer, **values))


def chunk_committed(session: Session, writer: str, first_seq: int) -> bool:
    """Whether `writer`'s last committed chunk is the one starting at `first_seq`: the answer to a
    commit whose outcome the connection took with it (a writer has one chunk in flight at a time)."""
    from storage.models import EventReceipt

    return session.scalar(select(EventReceipt.first_seq).where(EventReceipt.writer == writer)) == first_seq


def event_json(row: dict[str, Any]) -> str:
    """``row`` as ASCII-only JSON (NUL and lone surrogates escaped, bytes as hex, times ISO):
    text any database and any file can hold, whatever the row contained."""
    import json

    def plain(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value).hex()
        if hasattr(value, "isoformat"):
            return value.isoformat()
        return value

    return json.dumps({k: plain(v) for k, v in row.items()}, ensure_ascii=True, sort_keys=True, default=repr)


def insert_dead_letters(session: Session, letters: Sequence[tuple[dict[str, Any], str]],
                        replica: str | None = None) -> int:
    """Set aside (row, reason) pairs the database refused as decision events; returns the count."""
    from storage.models import DeadLetterEvent, utcnow

    if letters:
        now = utcnow()
        session.connection().execute(insert(DeadLetterEvent.__table__), [
            {"at": now, "replica": None if replica is None else _ascii(replica), "reason": _ascii(reason),
             "event": event_json(row)} for row, reason in letters])
    return len(letters)


def prune_dead_letters(session: Session, keep_last: int = KEEP_DEAD_LETTERS) -> int:
    """Delete all but the newest `keep_last` dead letters (every replica's: the table is shared);
    returns the count deleted."""
    from storage.models import DeadLetterEvent
    from storage.retention import keep_newest

    return keep_newest(session, DeadLetterEvent, keep_last)


def _ascii(text: str) -> str:
    # NUL and lone surrogates become escapes (NUL is ASCII, so it needs its own)
    return text.encode("ascii", "backslashreplace").decode().replace("\x00", "\\x00")


def count_cache_drafts_since(session: Session, workload: str, since: datetime) -> int:
    """Labelled cache drafts of `workload` stored after `since` (what a rollback watch counts)."""
    stmt = select(func.count()).select_from(DecisionEvent).where(
        DecisionEvent.workload == workload, DecisionEvent.drafter == "cache", DecisionEvent.at > since)
    return int(session.scalar(stmt) or 0)


def list_events(session: Session, limit: int | None = None, **filters: Any) -> list[DecisionEvent]:
    stmt = select(DecisionEvent).order_by(DecisionEvent.id)
    for name, value in filters.items():
        stmt = stmt.where(getattr(DecisionEvent, name) == value)
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(session.scalars(stmt))


@dataclass(frozen=True, order=True)
class EventCursor:
    """A place in the event log's commit order: (inserting transaction, id). On SQLite every txid
    is 0 and writers take turns, so it is id order, which there is commit order too."""

    txid: int = 0
    id: int = 0


def _committed_below(dialect: str):
    """Rows whose transaction is older than every transaction still running (PostgreSQL): they are
    all committed or gone, so nothing can later appear before them in (txid, id) order."""
    if dialect == "postgresql":
        return DecisionEvent.txid < text("pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
    return true()


def events_after(session: Session, after: EventCursor, limit: int) -> list[DecisionEvent]:
    """The next `limit` settled events after `after`, in (txid, id) order (the learner's cursor):
    a chunk that commits after a later one was read is still ahead of the cursor when it shows."""
    stmt = (select(DecisionEvent)
            .where(tuple_(DecisionEvent.txid, DecisionEvent.id) > tuple_(after.txid, after.id),
                   _committed_below(session.get_bind().dialect.name))
            .order_by(DecisionEvent.txid, DecisionEvent.id).limit(limit))
    return list(session.scalars(stmt))


def events_end(session: Session) -> EventCursor:
    """The cursor past every settled event (a learner that starts at the end starts here)."""
    row = session.execute(select(DecisionEvent.txid, DecisionEvent.id)
                          .where(_committed_below(session.get_bind().dialect.name))
                          .order_by(DecisionEvent.txid.desc(), DecisionEvent.id.desc()).limit(1)).first()
    return EventCursor() if row is None else EventCursor(int(row[0]), int(row[1]))


def last_event_id(session: Session) -> int:
    return int(session.scalar(select(func.max(DecisionEvent.id))) or 0)


def record_health(session: Session, *, replica: str, queue_depth: int, events_written: int, events_dropped: int,
                  flush_ms: float, events_dead_lettered: int = 0, services: str | None = None,
                  dead_letters_pruned: int = 0) -> None:
    """Upsert this replica's heartbeat row (one row per replica, overwritten); `services` is JSON.
    `dead_letters_pruned`: dead letters its writer deleted to keep the table within KEEP_DEAD_LETTERS."""
    from storage.models import ReplicaHealth, utcnow

    session.merge(ReplicaHealth(replica=replica, updated_at=utcnow(), queue_depth=queue_depth,
                                events_written=events_written, events_dropped=events_dropped, flush_ms=flush_ms,
                                events_dead_lettered=events_dead_lettered, services=services,
                                dead_letters_pruned=dead_letters_pruned))


def replica_health(session: Session) -> list:
    from storage.models import ReplicaHealth

    return list(session.scalars(select(ReplicaHealth).order_by(ReplicaHealth.replica)))
