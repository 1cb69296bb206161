"""Exactly-once learning whatever the commit order: several writers whose chunks commit out of id
order on PostgreSQL, a reader going by the learner's cursor (storage.events.events_after), and the
cursor's compare-and-set when two learners read from the same place (storage.learner_log)."""
from __future__ import annotations

import random
import threading
import time

import pytest
from sqlalchemy import Engine, insert

from controller.core.events import LabelledEvent
from storage.engine import session_scope
from storage.events import EventCursor, events_after, events_end, insert_events
from storage.learner_log import CursorMovedError, advance_cursor, list_rounds, place_cursor, read_cursor
from storage.models import DecisionEvent

T0 = 1_767_000_000.0


def rows(tag: str, n: int) -> list[dict]:
    return [LabelledEvent(T0, "t", "code", tag, i, "cache", "cache", 8, i % 9, 0.5, 1.0, None, None, None).to_row()
            for i in range(n)]


def consume(engine: Engine, cursor: EventCursor, limit: int = 50) -> tuple[EventCursor, list[str]]:
    """One reader round: the settled events after `cursor` (as "request_id/position") and the new cursor."""
    with session_scope(engine) as s:
        got = events_after(s, cursor, limit)
        seen = [f"{e.request_id}/{e.position}" for e in got]
        return (EventCursor(got[-1].txid, got[-1].id) if got else cursor), seen


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_chunk_that_commits_after_a_later_one_is_still_read(db: Engine) -> None:
    """Ids are handed out at insert: chunk A takes the smaller ids but commits last. A reader by id
    alone would move past A's ids while A is invisible and never read it."""
    a = db.connect()
    ta = a.begin()
    a.execute(insert(DecisionEvent.__table__), rows("A", 5))
    with session_scope(db) as s:  # B inserts after A (larger ids) and commits first
        insert_events(s, rows("B", 5))
    cursor, seen = consume(db, EventCursor())
    assert seen == []  # B's rows wait behind A's open transaction: nothing is settled yet
    with session_scope(db) as s:
        assert events_end(s) == EventCursor()
    ta.commit()
    a.close()
    cursor, seen = consume(db, cursor)
    assert seen == [f"A/{i}" for i in range(5)] + [f"B/{i}" for i in range(5)]
    assert consume(db, cursor)[1] == []
    with session_scope(db) as s:
        assert events_end(s) == cursor


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_many_writers_out_of_order_each_event_read_exactly_once(db: Engine) -> None:
    """Four writers commit chunks after seeded random delays while a reader follows the cursor:
    every committed event is read, none twice, and the rolled-back chunks never."""
    rng = random.Random(20261204)
    plans = [[(rng.random() * 0.05, rng.random() < 0.15) for _ in range(25)] for _ in range(4)]
    committed: list[str] = []
    lock = threading.Lock()

    def writer(w: int) -> None:
        for c, (delay, roll_back) in enumerate(plans[w]):
            tag = f"w{w}c{c}"
            with db.connect() as conn:
                tx = conn.begin()
                conn.execute(insert(DecisionEvent.__table__), rows(tag, 7))
                time.sleep(delay)  # others insert (and commit) meanwhile
                if roll_back:
                    tx.rollback()
                    continue
                tx.commit()
            with lock:
                committed.extend(f"{tag}/{i}" for i in range(7))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    cursor, read = EventCursor(), []
    while any(t.is_alive() for t in threads):
        cursor, seen = consume(db, cursor, limit=rng.randint(1, 40))
        read += seen
    for t in threads:
        t.join()
    while True:
        cursor, seen = consume(db, cursor)
        if not seen:
            break
        read += seen
    assert len(read) == len(set(read))  # none twice
    assert sorted(read) == sorted(committed)  # every committed event, no rolled-back one
    assert len(committed) < 4 * 25 * 7  # some chunks were rolled back (the plan has ~15%)


def test_the_cursor_moves_by_compare_and_set(db: Engine) -> None:
    """Two learners that read from the same place: the first round to commit moves the cursor, the
    other's move (and with it the round's writes) is refused; the log holds each event once."""
    with session_scope(db) as s:
        insert_events(s, rows("r", 30))
    with session_scope(db) as s:
        assert read_cursor(s) is None
        place_cursor(s, EventCursor(), epoch=1, holder="a")
    with session_scope(db) as s:
        with pytest.raises(CursorMovedError):
            place_cursor(s, EventCursor(), epoch=2, holder="b")
    first, _ = consume(db, EventCursor(), limit=10)
    with session_scope(db) as s:
        advance_cursor(s, EventCursor(), first, 10, epoch=1, holder="a")
    with session_scope(db) as s:  # b read from the same start: refused, nothing written
        with pytest.raises(CursorMovedError, match="moved"):
            advance_cursor(s, EventCursor(), first, 10, epoch=1, holder="b")
    with session_scope(db) as s:
        with pytest.raises(ValueError, match="forward"):
            advance_cursor(s, first, first, 0, epoch=1, holder="a")
    second, _ = consume(db, first, limit=50)
    with session_scope(db) as s:
        advance_cursor(s, first, second, 20, epoch=2, holder="b")
    with session_scope(db) as s:
        log = list_rounds(s)
        assert [(r.holder, r.epoch, r.events) for r in log] == [("a", 1, 10), ("b", 2, 20)]
        assert (log[0].last_txid, log[0].last_id) == (log[1].after_txid, log[1].after_id)
        assert read_cursor(s) == second and sum(r.events for r in log) == 30
