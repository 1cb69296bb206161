"""Migration 0013: 64-bit ids and counters, on a filled table. PostgreSQL's serial ids stop at 2^31-1
(the column and its sequence, both `integer`); after 0013 both are bigint and the stored rows are
untouched. SQLite's INTEGER PRIMARY KEY is the 64-bit rowid already: it must stay the rowid alias."""
from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.exc import DBAPIError

from storage.engine import make_engine, session_scope
from storage.events import insert_events, record_health
from storage.migrate import current_revision, downgrade, upgrade
from storage.models import DecisionEvent, ReplicaHealth

NOW = datetime(2026, 12, 4, 8, 0, tzinfo=timezone.utc)
INT_MAX = 2**31 - 1
ABOVE = 2**31 + 12_345  # a counter a 32-bit column cannot hold
SERIAL_IDS = ("decision_events", "dead_letter_events", "stat_buckets")

# An event as revision 0012 stores it (plain SQL: the models describe head, not 0012).
INSERT_0012 = text(
    "INSERT INTO decision_events (at, tenant, workload, request_id, position, drafter, decision, draft_len, "
    "accepted, predicted, tau, predictor_version_id, features) VALUES "
    "(:at, 'acme', 'chat', :request_id, :position, 'cache', 'cache', 4, 2, 1.5, 2.0, NULL, NULL)")


def _event(position: int) -> dict:
    return dict(at=NOW, tenant="acme", workload="chat", request_id=f"new-{position}", position=position,
                drafter="cache", decision="cache", draft_len=4, accepted=2, predicted=1.5, tau=2.0,
                predictor_version_id=None, features=None)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    try:
        yield eng
    finally:
        eng.dispose()


def _pg(engine: Engine) -> None:
    if engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL's serial sequences; SQLite's rowid is 64-bit already")


def _sequences(engine: Engine) -> dict[str, tuple[str, int]]:
    """Each table's id sequence: (data type, max value)."""
    out = {}
    with engine.connect() as conn:
        for table in SERIAL_IDS:
            out[table] = tuple(conn.execute(text(
                "SELECT data_type::text, max_value FROM pg_sequences "
                "WHERE schemaname || '.' || sequencename = pg_get_serial_sequence(:t, 'id') "
                "   OR sequencename = pg_get_serial_sequence(:t, 'id')"), {"t": table}).one())
    return out


def _filled_near_the_limit(engine: Engine, rows: int = 3) -> list[tuple[int, str]]:
    """decision_events at 0012 with `rows` events stored just below 2^31 (the sequence set to
    2^31 - 5 first, as after days of traffic); their (id, request_id)."""
    upgrade(engine, "0012")
    with engine.begin() as conn:
        conn.execute(text("SELECT setval(pg_get_serial_sequence('decision_events', 'id'), :v)"), {"v": 2**31 - 5})
        for i in range(rows):
            conn.execute(INSERT_0012, {"at": NOW, "request_id": f"old-{i}", "position": i})
        return [tuple(r) for r in conn.execute(text("SELECT id, request_id FROM decision_events ORDER BY id"))]


def test_before_0013_postgresql_stops_at_2_31(engine: Engine) -> None:
    """The failure 0013 removes: at 0012 the sequence ends at 2^31-1 (SQLSTATE 2200H past it)."""
    _pg(engine)
    old = _filled_near_the_limit(engine, rows=4)
    assert [i for i, _ in old] == [2**31 - 4, 2**31 - 3, 2**31 - 2, 2**31 - 1]
    with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
        conn.execute(INSERT_0012, {"at": NOW, "request_id": "one-too-many", "position": 9})
    assert caught.value.orig.pgcode == "2200H"


def test_upgrade_on_a_filled_table_goes_past_2_31_and_keeps_every_row(engine: Engine) -> None:
    _pg(engine)
    old = _filled_near_the_limit(engine, rows=3)
    assert [i for i, _ in old] == [2**31 - 4, 2**31 - 3, 2**31 - 2]
    assert set(_sequences(engine).values()) == {("integer", INT_MAX)}
    upgrade(engine)
    assert _sequences(engine) == {t: ("bigint", 2**63 - 1) for t in SERIAL_IDS}
    with session_scope(engine) as s:
        insert_events(s, [_event(p) for p in range(5)])
    with session_scope(engine) as s:
        stored = [(e.id, e.request_id, e.at, e.position) for e in s.scalars(select(DecisionEvent).order_by(DecisionEvent.id))]
    assert [(i, r) for i, r, _, _ in stored[:3]] == old  # the old rows, ids and values intact
    assert all(at == NOW for _, _, at, _ in stored)
    assert [i for i, _, _, _ in stored[3:]] == list(range(2**31 - 1, 2**31 + 4))  # past 2^31
    assert [r for _, r, _, _ in stored[3:]] == [f"new-{p}" for p in range(5)]


def test_replica_health_counters_above_2_31_round_trip(engine: Engine) -> None:
    upgrade(engine)
    with session_scope(engine) as s:
        record_health(s, replica="r1", queue_depth=3, events_written=ABOVE, events_dropped=ABOVE + 1,
                      events_dead_lettered=ABOVE + 2, dead_letters_pruned=ABOVE + 3, flush_ms=1.0)
    with session_scope(engine) as s:
        row = s.get(ReplicaHealth, "r1")
        got = (row.events_written, row.events_dropped, row.events_dead_lettered, row.dead_letters_pruned)
    assert got == (ABOVE, ABOVE + 1, ABOVE + 2, ABOVE + 3)


def test_sqlite_ids_stay_the_rowid_and_count_on(engine: Engine) -> None:
    """0012 -> head on SQLite: the stored rows keep their ids, new ones follow them, and an id past
    2^31 is taken (INTEGER PRIMARY KEY is the 64-bit rowid; a BIGINT one would be a plain column)."""
    if engine.dialect.name != "sqlite":
        pytest.skip("SQLite's rowid")
    upgrade(engine, "0012")
    with engine.begin() as conn:
        conn.execute(INSERT_0012, {"at": NOW, "request_id": "old-0", "position": 0})
        conn.execute(text("UPDATE decision_events SET id = :id"), {"id": 2**31 - 2})
    upgrade(engine)
    with session_scope(engine) as s:
        insert_events(s, [_event(p) for p in range(3)])
    with engine.connect() as conn:
        ids = [r[0] for r in conn.execute(text("SELECT id FROM decision_events ORDER BY id"))]
        rowids = [r[0] for r in conn.execute(text("SELECT rowid FROM decision_events ORDER BY rowid"))]
        ddl = conn.execute(text("SELECT sql FROM sqlite_master WHERE name = 'decision_events'")).scalar_one()
    assert ids == rowids == [2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1]
    assert "id INTEGER NOT NULL" in ddl


def test_downgrade_narrows_back_while_every_value_fits(engine: Engine) -> None:
    upgrade(engine, "0013")
    with session_scope(engine) as s:
        insert_events(s, [_event(0)])
        record_health(s, replica="r1", queue_depth=0, events_written=7, events_dropped=1, flush_ms=1.0)
    downgrade(engine, "0012")
    assert current_revision(engine) == "0012"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT request_id FROM decision_events")).scalar_one() == "new-0"
        assert tuple(conn.execute(text("SELECT events_written, events_dropped FROM replica_health")).one()) == (7, 1)
    if engine.dialect.name == "postgresql":
        assert set(_sequences(engine).values()) == {("integer", INT_MAX)}
    upgrade(engine, "0013")
    assert current_revision(engine) == "0013"


def test_downgrade_is_refused_once_an_id_passed_2_31(engine: Engine) -> None:
    """Narrowing would lose rows: PostgreSQL refuses, the migration's transaction rolls back, and
    the schema stays at 0013 with every row."""
    _pg(engine)
    _filled_near_the_limit(engine, rows=1)
    upgrade(engine, "0013")
    with session_scope(engine) as s:
        insert_events(s, [_event(p) for p in range(8)])  # ids up to 2^31 + 4
    with pytest.raises(DBAPIError):
        downgrade(engine, "0012")
    assert current_revision(engine) == "0013"
    assert _sequences(engine)["decision_events"] == ("bigint", 2**63 - 1)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*), max(id) FROM decision_events")).one() == (9, 2**31 + 4)
