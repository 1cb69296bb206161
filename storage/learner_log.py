"""The fleet's learning cursor and the log of committed learner rounds.

A round reads the events after the cursor, learns, and in ONE transaction (fenced by the leader's
lease, storage.leader) writes what it concluded, moves the cursor from where it found it to the last
event it read, and logs itself. The move is a compare-and-set: a round whose cursor someone else
moved in the meantime writes nothing. So each committed event is consumed by exactly one committed
round, whichever replica leads and however leadership changes hands.
"""
from __future__ import annotations

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from storage.events import EventCursor
from storage.models import LearnerCursor, LearnerRound, utcnow
from storage.retention import keep_newest

LEARNER = "learner"
# Rounds logged: a round every half second while events flow is ~170k a day; the newest 200k (about
# a day of continuous rounds, much longer at usual rates) are what an audit of the recent past reads.
KEEP_ROUNDS = 200_000
PRUNE_EVERY = 1_000  # rounds between prunes of the log


class CursorMovedError(RuntimeError):
    """The cursor was not where this round found it: another round (another leader) committed first."""

    def __init__(self, name: str, expected: EventCursor | None, found: EventCursor | None) -> None:
        self.expected, self.found = expected, found
        super().__init__(f"learner cursor {name!r} moved: this round read after {expected}, "
                         f"the database holds {found}; the round's writes are discarded")


def read_cursor(session: Session, name: str = LEARNER) -> EventCursor | None:
    """Where the fleet's learning stands; None before any learner placed it."""
    row = session.get(LearnerCursor, name, populate_existing=True)
    return None if row is None else EventCursor(row.txid, row.event_id)


def place_cursor(session: Session, at: EventCursor, *, epoch: int, holder: str, name: str = LEARNER) -> None:
    """Put a cursor where none is (the first learner starts at the end); CursorMovedError if one is."""
    found = read_cursor(session, name)
    if found is not None:
        raise CursorMovedError(name, None, found)
    session.execute(insert(LearnerCursor).values(name=name, txid=at.txid, event_id=at.id, events=0, epoch=epoch,
                                                 holder=holder, updated_at=utcnow()))


def advance_cursor(session: Session, before: EventCursor, after: EventCursor, events: int, *, epoch: int,
                   holder: str, name: str = LEARNER) -> None:
    """Move the cursor from `before` to `after` (compare-and-set) and log the round that consumed
    the `events` between them; CursorMovedError, writing nothing, if it was not at `before`."""
    if not after > before:
        raise ValueError(f"a round moves the cursor forward: {before} -> {after}")
    table = LearnerCursor.__table__
    moved = session.execute(
        update(table).where(table.c.name == name, table.c.txid == before.txid, table.c.event_id == before.id)
        .values(txid=after.txid, event_id=after.id, events=table.c.events + events, epoch=epoch, holder=holder,
                updated_at=utcnow()))
    if moved.rowcount != 1:
        raise CursorMovedError(name, before, read_cursor(session, name))
    session.execute(insert(LearnerRound).values(
        at=utcnow(), epoch=epoch, holder=holder, after_txid=before.txid, after_id=before.id, last_txid=after.txid,
        last_id=after.id, events=events))


def prune_rounds(session: Session, keep: int = KEEP_ROUNDS) -> int:
    return keep_newest(session, LearnerRound, keep)


def list_rounds(session: Session) -> list[LearnerRound]:
    """Every logged round in commit order of the cursor (what an exactly-once audit walks)."""
    return list(session.scalars(select(LearnerRound).order_by(LearnerRound.id)))
