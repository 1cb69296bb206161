"""What storage holds and refuses, the same on SQLite and PostgreSQL: unbounded ids round-trip,
stated limits are enforced before SQL with an error naming the field, tenant names have one
spelling, database URLs are refused in one line, and every connection has timeouts."""
from __future__ import annotations

import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, insert, make_url, select, text
from sqlalchemy.exc import DBAPIError

from controller.cli import overrides as cli_overrides
from storage.engine import connect_args, make_engine, session_scope
from storage.errors import FieldError, StorageError
from storage.events import event_row_problem, insert_events, list_events, record_health, replica_health, split_storable
from storage.leader import LeaseLeaderLock
from storage.limits import MAX_AUTHOR_LEN, MAX_TENANT_LEN, MAX_WORKLOAD_LEN
from storage.migrate import alembic_config, current_revision, downgrade, upgrade
from storage.models import Base, DecisionEvent, TauHistory, TauOverride
from storage.overrides import OverrideError, OverrideSpec, list_overrides, set_override
from storage.settings import DatabaseUrlError, Timeouts, check_database_url, database_url
from storage.tenants import normalise_tenant
from storage.versions import add_tau_history, create_version, list_alias_events, set_alias
from storage.workloads import WORKLOADS

NOW = datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)
LONG_ID = "can-ai-code/" + "x" * 177  # 189 characters, as long as the bundled can-ai-code trace ids
LONG_NAME = "replica-" + "h" * 300


def _event(**kw) -> dict:
    row = dict(at=NOW, tenant="acme", workload="chat", request_id="r1", position=0, drafter="cache",
               decision="cache", draft_len=4, accepted=2, predicted=1.5, tau=2.0, predictor_version_id=None,
               features=None)
    row.update(kw)
    return row


# --- unbounded values round-trip on both databases -------------------------------------------------


def test_long_request_id_round_trips(db: Engine) -> None:
    assert len(LONG_ID) == 189
    huge = "r" * 10_000
    with session_scope(db) as s:
        assert insert_events(s, [_event(request_id=LONG_ID), _event(request_id=huge, position=1)]) == 2
    with session_scope(db) as s:
        assert [e.request_id for e in list_events(s)] == [LONG_ID, huge]


def test_long_replica_holder_and_actor_names_round_trip(db: Engine) -> None:
    with session_scope(db) as s:
        record_health(s, replica=LONG_NAME, queue_depth=1, events_written=2, events_dropped=0, flush_ms=1.0)
        add_tau_history(s, at=NOW, workload="chat", tau=2.0, rule_tau=2.0, correction=0.0, model_mean_accepted=1.0,
                        reason="test", replica=LONG_NAME)
        v = create_version(s, blob=b"w", kind="mlp", feature_schema_hash="h", metrics={}, training_summary={},
                           reason="r", created_by=f"learner@{LONG_NAME}")
        set_alias(s, "champion", v.id, reason="promotion", actor=f"learner@{LONG_NAME}")
    lock = LeaseLeaderLock(db, "learner", holder=LONG_NAME)
    assert lock.try_acquire()
    lock.release()
    with session_scope(db) as s:
        assert [h.replica for h in replica_health(s)] == [LONG_NAME]
        assert s.scalars(select(TauHistory.replica)).one() == LONG_NAME
        assert list_alias_events(s, "champion")[0].actor == f"learner@{LONG_NAME}"


# --- stated limits: refused before SQL, naming the field, on both databases ---------------------


def test_over_long_tenant_and_author_refused_before_sql(db: Engine) -> None:
    spec = OverrideSpec(tenant="t" * (MAX_TENANT_LEN + 1), workload=None, mode="fixed", tau=3.0, author="a",
                        reason="r")
    with pytest.raises(OverrideError, match=f"tenant is {MAX_TENANT_LEN + 1} characters long; at most {MAX_TENANT_LEN}"):
        with session_scope(db) as s:
            set_override(s, spec, WORKLOADS, now=NOW)
    with pytest.raises(OverrideError, match=f"author is {MAX_AUTHOR_LEN + 1} characters long"):
        with session_scope(db) as s:
            set_override(s, OverrideSpec("acme", None, "fixed", 3.0, author="a" * (MAX_AUTHOR_LEN + 1), reason="r"),
                         WORKLOADS, now=NOW)
    with session_scope(db) as s:
        assert list_overrides(s, include_inactive=True, now=NOW) == []
        # at the limit it is stored, on both backends
        set_override(s, OverrideSpec("t" * MAX_TENANT_LEN, None, "fixed", 3.0, author="a" * MAX_AUTHOR_LEN,
                                     reason="r"), WORKLOADS, now=NOW)
    with session_scope(db) as s:
        assert [len(r.tenant) for r in list_overrides(s, now=NOW)] == [MAX_TENANT_LEN]


def test_tenant_column_backs_the_limit_on_postgresql(db: Engine) -> None:
    """Why the edge check matters: PostgreSQL refuses a whole batch for one long tenant; SQLite keeps it."""
    rows = [_event(), _event(tenant="t" * (MAX_TENANT_LEN + 1), position=1)]
    assert split_storable(rows) == ([rows[0]], [(rows[1], f"tenant is {MAX_TENANT_LEN + 1} characters long; "
                                                           f"at most {MAX_TENANT_LEN} allowed")])
    if db.dialect.name == "postgresql":
        with pytest.raises(DBAPIError, match="too long"):
            with session_scope(db) as s:
                s.connection().execute(insert(DecisionEvent.__table__), rows)
    with session_scope(db) as s:
        assert insert_events(s, split_storable(rows)[0]) == 1


@pytest.mark.parametrize(("change", "problem"), [
    (dict(tenant="t" * (MAX_TENANT_LEN + 1)), "tenant is 129 characters long; at most 128 allowed"),
    (dict(workload="w" * (MAX_WORKLOAD_LEN + 1)), "workload is 33 characters long; at most 32 allowed"),
    (dict(request_id="a\x00b"), "request_id contains NUL"),
    (dict(tenant="a\ud800"), "tenant contains a lone surrogate"),
    (dict(request_id=None), "request_id must be a string, got NoneType"),
    (dict(drafter="x" * 17), "drafter is 17 characters long"),
    (dict(request_id=LONG_ID * 50), None),
    (dict(tenant="é" * MAX_TENANT_LEN), None),  # characters, not bytes
])
def test_event_row_problem(change: dict, problem: str | None) -> None:
    found = event_row_problem(_event(**change))
    assert found == problem if problem is None else found.startswith(problem)


# --- tenant names: one spelling ------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "canonical"), [
    (" acme ", "acme"), ("acme", "acme"), ("\tacme\n", "acme"), ("e\u0301cole", "\u00e9cole"),
    ("acme corp", "acme corp"), ("t" * MAX_TENANT_LEN, "t" * MAX_TENANT_LEN), ("租户", "租户"),
])
def test_normalise_tenant(raw: str, canonical: str) -> None:
    assert normalise_tenant(raw) == canonical


@pytest.mark.parametrize(("raw", "message"), [
    ("acme\u200b", "tenant contains an invisible (format) character (U+200B ZERO WIDTH SPACE) at position 4"),
    ("a\nb", "tenant contains a control character (U+000A) at position 1"),
    ("a\x1b[31mb", "tenant contains a control character (U+001B)"),
    ("a\u00a0b", "tenant contains whitespace other than a plain space (U+00A0 NO-BREAK SPACE)"),
    ("a\u2028b", "tenant contains a line separator"),
    ("\u202eacme", "tenant contains an invisible (format) character (U+202E"),
    ("a\ud800", "tenant contains a surrogate (U+D800) at position 1"),
    ("", "tenant must not be empty"), (" \u3000 ", "tenant must not be empty"),
    ("t" * (MAX_TENANT_LEN + 1), "tenant is 129 characters long; at most 128 allowed"),
    (7, "tenant must be a string, got int"),
])
def test_normalise_tenant_refuses(raw: object, message: str) -> None:
    with pytest.raises(FieldError) as info:
        normalise_tenant(raw)
    assert str(info.value).startswith(message)
    assert info.value.field == "tenant" and isinstance(info.value, ValueError)


def test_spellings_of_one_tenant_are_one_override(db: Engine) -> None:
    """ " acme " replaces the "acme" override instead of becoming a second tenant."""
    with session_scope(db) as s:
        first = set_override(s, OverrideSpec("acme", None, "fixed", 3.0, author="alice", reason="r"), WORKLOADS,
                             now=NOW)
        second = set_override(s, OverrideSpec(" acme ", None, "fixed", 4.0, author=" bob ", reason=" why "),
                              WORKLOADS, now=NOW)
    with session_scope(db) as s:
        rows = {r.id: r for r in list_overrides(s, include_inactive=True, now=NOW)}
    assert (rows[second.id].tenant, rows[second.id].author, rows[second.id].reason) == ("acme", "bob", "why")
    assert rows[first.id].clear_reason == f"replaced by #{second.id}"


# --- migration 0005 down and up, with data ----------------------------------------------------------


def test_migration_0005_down_and_up(db: Engine) -> None:
    with session_scope(db) as s:
        insert_events(s, [_event(request_id="short")])
    downgrade(db, "0004")
    assert current_revision(db) == "0004"
    columns = {c["name"]: c["type"] for c in inspect(db).get_columns("decision_events")}
    assert getattr(columns["request_id"], "length", None) == 128
    upgrade(db)
    assert current_revision(db) == ScriptDirectory.from_config(alembic_config()).get_current_head()
    with db.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata) == []
    with session_scope(db) as s:
        insert_events(s, [_event(request_id=LONG_ID, position=1)])
        assert [e.request_id for e in list_events(s)] == ["short", LONG_ID]


# --- database URLs: one clear line -----------------------------------------------------------------


@pytest.mark.parametrize(("url", "message"), [
    ("", "database URL is empty"),
    ("   ", "database URL is empty"),
    ("not-a-url", "database URL 'not-a-url' is not a SQLAlchemy URL"),
    ("foo://x/y", "database URL foo://x/y: unknown database dialect 'foo'"),
    ("postgresql+nosuchdriver://u@h/d", "database URL postgresql+nosuchdriver://u@h/d: unknown database dialect"),
    ("sqlite:////proc/hvd-no/x.db", "database URL sqlite:////proc/hvd-no/x.db: cannot create directory /proc/hvd-no"),
])
def test_check_database_url_refuses(url: str, message: str) -> None:
    with pytest.raises(DatabaseUrlError) as info:
        check_database_url(url)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_database_url_refuses_unusable_sqlite_paths(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DatabaseUrlError, match="afile is not a directory"):
        check_database_url(f"sqlite:///{tmp_path}/afile/sub/hvd.db")
    with pytest.raises(DatabaseUrlError, match="is a directory, not a database file"):
        check_database_url(f"sqlite:///{tmp_path}")
    ok = f"sqlite:///{tmp_path}/new/dir/hvd.db"
    assert check_database_url(ok) == ok and (tmp_path / "new" / "dir").is_dir()
    assert check_database_url("sqlite://") == "sqlite://"  # in memory


def test_explicit_empty_url_is_not_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HVD_DATABASE_URL", raising=False)
    with pytest.raises(DatabaseUrlError, match="database URL is empty"):
        database_url("")
    monkeypatch.setenv("HVD_DATABASE_URL", "")  # an empty variable is unset, as for every HVD_* variable
    assert database_url() == "sqlite:///var/hvd.db"
    monkeypatch.setenv("HVD_DATABASE_URL", "nope")
    with pytest.raises(DatabaseUrlError, match=r"^\$HVD_DATABASE_URL 'nope' is not a SQLAlchemy URL"):
        database_url()


@pytest.mark.parametrize(("db_arg", "message"), [
    ("not-a-url", "hvd migrate: error: database URL 'not-a-url' is not a SQLAlchemy URL"),
    ("", "hvd migrate: error: database URL is empty"),
    ("sqlite:////proc/hvd-no/x.db", "hvd migrate: error: database URL sqlite:////proc/hvd-no/x.db: cannot create"),
])
def test_cli_bad_db_is_one_line_exit_2(db_arg: str, message: str, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from controller.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["--db", db_arg, "migrate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "var").exists()  # the default database was not used instead


# --- timeouts ------------------------------------------------------------------------------------------


KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3,
              "tcp_user_timeout": 60000}


def test_connect_args() -> None:
    t = Timeouts(connect_s=3.2, statement_s=1.5)
    assert connect_args(make_url("sqlite:///x.db"), t) == {"timeout": 5.0}
    assert connect_args(make_url("postgresql+psycopg2://u@h/d"), t) == {
        "connect_timeout": 4, "options": "-c statement_timeout=1500", **KEEPALIVES}
    # the URL's own options are kept; its own timeouts win
    assert connect_args(make_url("postgresql+psycopg2://u@h/d?options=-csearch_path%3Ds&connect_timeout=9"), t) == {
        "options": "-csearch_path=s -c statement_timeout=1500", **KEEPALIVES}
    assert connect_args(make_url("postgresql+psycopg2://u@h/d?options=-c%20statement_timeout%3D5&keepalives=0"),
                        t) == {"connect_timeout": 4, **{k: v for k, v in KEEPALIVES.items() if k != "keepalives"}}
    assert connect_args(make_url("postgresql+psycopg2://u@h/d"), Timeouts(1, 0)) == {"connect_timeout": 2,
                                                                                  **KEEPALIVES}
    assert connect_args(make_url("postgresql+pg8000://u@h/d"), t) == {}  # only libpq drivers take these


def test_timeouts_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HVD_DB_CONNECT_TIMEOUT", raising=False)
    monkeypatch.setenv("HVD_DB_STATEMENT_TIMEOUT", "2.5")
    assert Timeouts.from_env() == Timeouts(10.0, 2.5)
    for bad in ("soon", "nan", "-1", "1e9"):
        monkeypatch.setenv("HVD_DB_CONNECT_TIMEOUT", bad)
        with pytest.raises(StorageError, match=rf"^HVD_DB_CONNECT_TIMEOUT={bad!r} is not valid: expected a number "
                                               r"of seconds between 1 and 86400$"):
            Timeouts.from_env()


def test_postgres_statement_timeout(db: Engine, db_url: str) -> None:
    if db.dialect.name != "postgresql":
        pytest.skip("statement timeouts are PostgreSQL's")
    with db.connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "2min"
        assert conn.execute(text("SELECT current_schema()")).scalar().startswith("hvd_test_")  # options kept
    quick = make_engine(db_url, Timeouts(connect_s=5, statement_s=0.2))
    try:
        start = time.monotonic()
        with pytest.raises(DBAPIError, match="statement timeout"):
            with quick.connect() as conn:
                conn.execute(text("SELECT pg_sleep(5)"))
        assert time.monotonic() - start < 3
    finally:
        quick.dispose()


def test_frozen_postgres_times_out_on_connect() -> None:
    """A server that accepts TCP but never answers (frozen) fails the connect within the timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(StorageError, match="cannot reach database .*timeout"):
            make_engine(f"postgresql+psycopg2://u@127.0.0.1:{server.getsockname()[1]}/d", Timeouts(connect_s=2))
        assert time.monotonic() - start < 8
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


# --- the override list cannot drive the terminal ------------------------------------------------------


def test_override_list_escapes_and_caps_stored_values(db: Engine) -> None:
    """Rows written before tenant names were checked (or by hand) still print as one safe line each."""
    hostile = "\x1b]0;pwned\x07\x1b[2J" + "t" * 100
    with session_scope(db) as s:
        s.add(TauOverride(tenant=hostile[:MAX_TENANT_LEN], workload=None, mode="fixed", tau=3.0, author="a\u202eb",
                          reason="line1\nline2\r\x1b[31mred " + "r" * 500, created_at=NOW))
    with session_scope(db) as s:
        table = cli_overrides.format_table(list_overrides(s, now=NOW), NOW)
    lines = table.split("\n")
    assert len(lines) == 2
    assert not any(ord(ch) < 0x20 or ch in "\x7f\u202e" for ch in table.replace("\n", ""))
    assert "\\x1b]0;pwned\\x07" in lines[1] and "a\\u202eb" in lines[1] and "line1 line2 \\x1b[31mred" in lines[1]
    assert len(lines[1]) <= sum(cli_overrides.COLUMN_CAPS.values()) + 2 * len(cli_overrides.COLUMN_CAPS)
    assert "…" in lines[1]


def test_stats_with_unstorable_names_are_kept_under_one_visible_key(db: Engine) -> None:
    """A tenant the database cannot hold must not make every stats upsert fail: its counts land
    under UNSTORABLE, merged (one statement may not touch a row twice on PostgreSQL)."""
    from storage.stats import UNSTORABLE, BucketDelta, upsert_buckets
    from support import rows as readback

    start = datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)
    deltas = {(start, "acme", "chat", 0): BucketDelta(tokens=1),
              (start, "t" * (MAX_TENANT_LEN + 1), "chat", 0): BucketDelta(tokens=10),
              (start, "a\x00b", "chat", 0): BucketDelta(tokens=100),
              (start, "acme", "w" * (MAX_WORKLOAD_LEN + 1), 0): BucketDelta(tokens=1000)}
    with session_scope(db) as s:
        assert upsert_buckets(s, deltas) == 3
    with session_scope(db) as s:
        assert {(b.tenant, b.workload): b.tokens for b in readback.buckets(s)} == {
            ("acme", "chat"): 1, (UNSTORABLE, "chat"): 110, ("acme", UNSTORABLE): 1000}
