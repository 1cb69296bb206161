"""Storage tests, run against SQLite and a real PostgreSQL.

PostgreSQL is skipped only when HVD_SKIP_POSTGRES=1; otherwise an unreachable
server fails the test, so CI cannot silently lose half its coverage.
Each PostgreSQL test gets its own throwaway schema (via search_path).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from datetime import timezone
from pathlib import Path

import pytest
from conftest import PG_URL
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, update
from sqlalchemy.exc import IntegrityError

from storage import CorruptBlobError, StorageError
from storage.engine import make_engine, session_scope
from storage.migrate import alembic_config, current_revision, downgrade, upgrade
from storage.models import Alias, AliasEvent, Base, PredictorVersion
from storage.settings import DEFAULT_DATABASE_URL, database_url
from storage.versions import (
    create_version,
    get_alias_version,
    get_version,
    list_alias_events,
    list_versions,
    set_alias,
    verify_blob,
)

TABLES = {"predictor_versions", "aliases", "alias_events", "decision_events", "tau_overrides", "tau_history", "learner_checks", "learning_room",
          "stat_buckets", "stat_hours", "learner_cursor", "learner_rounds", "step_cost_minutes", "drift_events", "leases", "replica_health", "dead_letter_events", "event_receipts", "survival_calibrations"}
SCHEMA_HASH = "a" * 64


def _head_revision() -> str | None:
    """The newest migration shipped with the code."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def db(engine: Engine) -> Engine:
    upgrade(engine)
    return engine


def _new_version(session, blob: bytes = b"weights", **overrides) -> PredictorVersion:
    kwargs = dict(
        blob=blob,
        kind="mlp",
        feature_schema_hash=SCHEMA_HASH,
        metrics={"val": {"loss": 0.25, "acc": 0.9}},
        training_summary={"epochs": 3, "lr": 0.001, "history": [1.0, 0.5]},
        reason="test",
        created_by="pytest",
    )
    kwargs.update(overrides)
    return create_version(session, **kwargs)


# --- migrations ---------------------------------------------------------------


def test_upgrade_creates_tables_matching_models(engine: Engine) -> None:
    assert current_revision(engine) is None
    upgrade(engine)
    assert current_revision(engine) == _head_revision() == "0018"
    assert TABLES <= set(inspect(engine).get_table_names())
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == []


def test_upgrade_is_idempotent(engine: Engine) -> None:
    upgrade(engine)
    upgrade(engine)
    assert current_revision(engine) == "0018"


def test_downgrade_one_step_keeps_earlier_data(engine: Engine) -> None:
    """Down to 0001 drops the later tables only; stored predictor versions survive."""
    upgrade(engine)
    with session_scope(engine) as s:
        v = create_version(s, blob=b"abc", kind="mlp", feature_schema_hash="h", metrics={}, training_summary={},
                           reason="r", created_by="t")
        vid = v.id
    downgrade(engine, "0001")
    assert current_revision(engine) == "0001"
    assert not (TABLES - {"predictor_versions", "aliases", "alias_events"}) & set(inspect(engine).get_table_names())
    with session_scope(engine) as s:
        assert get_version(s, vid).blob == b"abc"
    upgrade(engine)
    assert "decision_events" in set(inspect(engine).get_table_names())


def test_migrations_keep_a_champion_and_its_history(engine: Engine) -> None:
    """A database in use (a champion, its alias history) goes up and down through every revision that
    recreates tables: on SQLite that means dropping tables other rows reference."""
    upgrade(engine, "0004")
    with session_scope(engine) as s:
        v1, v2 = _new_version(s, blob=b"one"), _new_version(s, blob=b"two")
        # rows as 0004's code wrote them (set_alias now also reads alias_pins, from 0015)
        s.add(Alias(name="champion", version_id=v2.id))
        s.add_all([AliasEvent(alias_name="champion", from_version_id=None, to_version_id=v1.id, reason="first",
                              actor="trainer"),
                   AliasEvent(alias_name="champion", from_version_id=v1.id, to_version_id=v2.id, reason="second",
                              actor="learner")])
        ids = (v1.id, v2.id)
    for revision in ("head", "0004", "head"):
        (upgrade if revision == "head" else downgrade)(engine, revision)
        with session_scope(engine) as s:
            assert get_alias_version(s, "champion").id == ids[1]
            assert [(e.from_version_id, e.to_version_id) for e in list_alias_events(s, "champion")] == \
                [(None, ids[0]), (ids[0], ids[1])]
    assert current_revision(engine) == _head_revision()
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_downgrade_to_base_removes_tables(engine: Engine) -> None:
    upgrade(engine)
    downgrade(engine, "base")
    assert current_revision(engine) is None
    assert not TABLES & set(inspect(engine).get_table_names())
    upgrade(engine)  # and it can come back
    assert TABLES <= set(inspect(engine).get_table_names())


def test_upgrade_accepts_url(db_url: str) -> None:
    upgrade(db_url)
    eng = make_engine(db_url)
    try:
        assert current_revision(eng) == "0018"
    finally:
        eng.dispose()


def test_cli_alembic_ini(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'cli' / 'hvd.db'}"
    monkeypatch.setenv("HVD_DATABASE_URL", url)
    ini = Path(__file__).resolve().parents[1] / "storage" / "alembic.ini"
    command.upgrade(Config(str(ini)), "head")
    eng = make_engine(url)
    try:
        assert current_revision(eng) == "0018"
    finally:
        eng.dispose()


# --- versions -----------------------------------------------------------------


def test_version_round_trip(db: Engine) -> None:
    blob = bytes(range(256)) * 64 + b"\x00tail"
    with session_scope(db) as s:
        parent = _new_version(s, blob=b"parent")
        child = _new_version(s, blob=blob, parent_id=parent.id, metrics={"mse": 1.5e-3})
        parent_id, child_id = parent.id, child.id

    with session_scope(db) as s:
        got = get_version(s, child_id)
        assert got.blob == blob
        assert verify_blob(got) == blob
        assert got.blob_sha256 == hashlib.sha256(blob).hexdigest()
        assert got.parent_id == parent_id
        assert got.kind == "mlp"
        assert got.feature_schema_hash == SCHEMA_HASH
        assert got.metrics == {"mse": 1.5e-3}
        assert got.training_summary == {"epochs": 3, "lr": 0.001, "history": [1.0, 0.5]}
        assert got.reason == "test" and got.created_by == "pytest"
        assert got.created_at.tzinfo is not None
        assert got.created_at.utcoffset() == timezone.utc.utcoffset(None)
        assert [v.id for v in list_versions(s)] == [parent_id, child_id]


def test_alias_move_recorded(db: Engine) -> None:
    with session_scope(db) as s:
        v1, v2 = _new_version(s, blob=b"one"), _new_version(s, blob=b"two")
        assert get_alias_version(s, "champion") is None
        set_alias(s, "champion", v1.id, reason="first", actor="trainer")
    with session_scope(db) as s:
        set_alias(s, "champion", v2.id, reason="better val loss", actor="controller")
    with session_scope(db) as s:
        current = get_alias_version(s, "champion")
        assert current is not None and current.id == v2.id
        events = [
            (e.alias_name, e.from_version_id, e.to_version_id, e.reason, e.actor)
            for e in list_alias_events(s, "champion")
        ]
        assert events == [
            ("champion", None, v1.id, "first", "trainer"),
            ("champion", v1.id, v2.id, "better val loss", "controller"),
        ]
        assert all(e.at.tzinfo is not None for e in list_alias_events(s))
        assert s.get(Alias, "champion").version_id == v2.id


def test_set_alias_unknown_version(db: Engine) -> None:
    with pytest.raises(StorageError, match=r"unknown predictor version id 4242"):
        with session_scope(db) as s:
            set_alias(s, "champion", 4242, reason="x", actor="y")
    with session_scope(db) as s:
        assert get_alias_version(s, "champion") is None
        assert list_alias_events(s) == []


def test_get_version_unknown_id(db: Engine) -> None:
    with session_scope(db) as s:
        with pytest.raises(StorageError) as info:
            get_version(s, 999)
    assert str(info.value) == "unknown predictor version id 999"


def test_unknown_parent_rejected(db: Engine) -> None:
    with session_scope(db) as s:
        with pytest.raises(StorageError, match="unknown predictor version id 77"):
            _new_version(s, parent_id=77)


def test_corrupt_blob_detected(db: Engine) -> None:
    with session_scope(db) as s:
        vid = _new_version(s, blob=b"good bytes").id
    with session_scope(db) as s:
        s.execute(update(PredictorVersion).where(PredictorVersion.id == vid).values(blob=b"bad bytes"))
    with session_scope(db) as s:
        version = get_version(s, vid)
        with pytest.raises(CorruptBlobError) as info:
            verify_blob(version)
    assert isinstance(info.value, StorageError)
    assert info.value.version_id == vid
    assert f"predictor version {vid}" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("metrics", {"val": {"loss": math.nan}}, "metrics.val.loss"),
        ("metrics", {"mse": math.inf}, "metrics.mse"),
        ("training_summary", {"history": [0.1, -math.inf]}, "training_summary.history[1]"),
    ],
)
def test_non_finite_json_rejected(db: Engine, field: str, value: dict, path: str) -> None:
    with session_scope(db) as s:
        with pytest.raises(StorageError, match=r"NaN/Infinity") as info:
            _new_version(s, **{field: value})
        assert path in str(info.value)
        assert list_versions(s) == []


def test_non_plain_json_rejected(db: Engine) -> None:
    with session_scope(db) as s:
        with pytest.raises(StorageError, match=r"metrics\.shape has type tuple"):
            _new_version(s, metrics={"shape": (1, 2)})
        with pytest.raises(StorageError, match=r"non-string key 3"):
            _new_version(s, metrics={3: 1.0})


def test_foreign_keys_enforced(db: Engine) -> None:
    with pytest.raises(IntegrityError):
        with session_scope(db) as s:
            s.add(Alias(name="ghost", version_id=12345))


# --- engine / settings --------------------------------------------------------


def test_unreachable_postgres_masks_password() -> None:
    url = "postgresql+psycopg2://hvd:s3cretpw@127.0.0.1:1/nope"
    with pytest.raises(StorageError) as info:
        make_engine(url)
    msg = str(info.value)
    assert "s3cretpw" not in msg
    assert "postgresql+psycopg2://hvd:***@127.0.0.1:1/nope" in msg
    assert msg.startswith("cannot reach database")


def test_unreachable_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'missing-dir' / 'hvd.db'}"
    with pytest.raises(StorageError, match="cannot reach database sqlite:///.*missing-dir"):
        make_engine(url)


def test_sqlite_pragmas(tmp_path: Path) -> None:
    eng = make_engine(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        with eng.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    finally:
        eng.dispose()


def test_database_url_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HVD_DATABASE_URL", raising=False)
    assert database_url() == DEFAULT_DATABASE_URL == "sqlite:///var/hvd.db"
    assert (tmp_path / "var").is_dir()

    env_url = f"sqlite:///{tmp_path / 'env' / 'e.db'}"
    monkeypatch.setenv("HVD_DATABASE_URL", env_url)
    assert database_url() == env_url
    assert (tmp_path / "env").is_dir()

    explicit = f"sqlite:///{tmp_path / 'x' / 'y' / 'z.db'}"
    assert database_url(explicit) == explicit
    assert (tmp_path / "x" / "y").is_dir()
    assert database_url(PG_URL) == PG_URL


# --- learner checks ---------------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("subject", "tau", "learner check subject 'tau' is not one of ('promotion', 'calibration')"),
    ("outcome", "lost", "learner check outcome 'lost' is not one of"),
    ("workload", "w" * 33, "learner check workload is 33 characters; at most 32"),
    ("drafts", -1, "learner check drafts must be >= 0, got -1"),
])
def test_learner_checks_refuse_what_the_table_cannot_hold_and_keep_what_is_stored(
        db: Engine, field: str, value: object, message: str) -> None:
    from datetime import datetime

    from storage.learner_checks import add_learner_check, list_learner_checks

    check = dict(at=datetime(2026, 12, 2, tzinfo=timezone.utc), workload="sql", tenant=None, subject="promotion",
                 outcome="won", gain=0.0125, drafts=3000, predictor_version_id=1, reason="won", replica="r1")
    with session_scope(db) as s:
        add_learner_check(s, **check)
        add_learner_check(s, **{**check, "subject": "calibration", "outcome": "on trial", "tenant": "acme"})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with session_scope(db) as s:
            add_learner_check(s, **{**check, field: value})
    with session_scope(db) as s:
        stored = [(c.subject, c.outcome, c.tenant, c.gain, c.drafts, c.at) for c in list_learner_checks(s)]
        assert [c.id for c in list_learner_checks(s, limit=1)] == [max(c.id for c in list_learner_checks(s))]
    assert stored == [("calibration", "on trial", "acme", 0.0125, 3000, check["at"]),
                      ("promotion", "won", "", 0.0125, 3000, check["at"])]  # newest first; nothing lost


@pytest.mark.parametrize("field, value, message", [
    ("workload", "w" * 33, "learning room workload is 33 characters; at most 32"),
    ("drafts", -1, "learning room drafts must be >= 0, got -1"),
    ("headroom", float("nan"), "learning room headroom must be a finite number, got nan"),
    ("challenger_gain", float("inf"), "learning room challenger_gain must be a finite number, got inf"),
])
def test_learning_room_refuses_what_the_table_cannot_hold_and_keeps_what_is_stored(
        db: Engine, field: str, value: object, message: str) -> None:
    from datetime import datetime

    from storage.learning_room import add_learning_room, latest_learning_room, prune_learning_room
    from support import rows as readback

    room = dict(at=datetime(2026, 12, 3, tzinfo=timezone.utc), workload="sql", predictor_version_id=1, drafts=3000,
                headroom=0.0512, challenger_gain=-0.002, replica="r1")
    with session_scope(db) as s:
        add_learning_room(s, **room)
        add_learning_room(s, **{**room, "workload": "chat", "headroom": 0.031})
        add_learning_room(s, **{**room, "headroom": 0.047, "challenger_gain": None, "predictor_version_id": 2})
    with pytest.raises(ValueError, match=message):
        with session_scope(db) as s:
            add_learning_room(s, **{**room, field: value})
    with session_scope(db) as s:
        stored = [(r.workload, r.predictor_version_id, r.headroom, r.challenger_gain, r.at) for r in readback.learning_room(s)]
        latest = [(r.workload, r.headroom) for r in latest_learning_room(s)]
    assert stored == [("sql", 2, 0.047, None, room["at"]), ("chat", 1, 0.031, -0.002, room["at"]),
                      ("sql", 1, 0.0512, -0.002, room["at"])]  # newest first; nothing lost
    assert latest == [("chat", 0.031), ("sql", 0.047)]
    with session_scope(db) as s:
        assert prune_learning_room(s, 1) == 2 and prune_learning_room(s, 1) == 0
        assert [(r.workload, r.headroom) for r in readback.learning_room(s)] == [("sql", 0.047)]  # the newest kept


def test_migration_0018_adds_the_promises_and_keeps_what_is_stored(engine: Engine) -> None:
    """Events and statistics stored before the plan's promises were: kept as they were, with no
    promise (NULL, 0); new sums add onto the old rows; and down again, the rows stay."""
    from datetime import datetime, timezone

    import sqlalchemy as sa

    from storage.stats import BucketDelta, HIST_BINS, upsert_buckets

    upgrade(engine, "0017")
    start = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)
    typed = {"at": sa.DateTime(timezone=True), "bucket_start": sa.DateTime(timezone=True), "accepted_hist": sa.JSON()}
    events = sa.table("decision_events", *(sa.column(c, typed.get(c)) for c in (
        "at", "tenant", "workload", "request_id", "position", "drafter", "decision", "draft_len", "accepted",
        "predicted", "tau", "predictor_version_id", "features", "verified_len", "txid")))
    buckets = sa.table("stat_buckets", *(sa.column(c, typed.get(c)) for c in (
        "bucket_start", "tenant", "workload", "predictor_version_id", "cache_drafts", "cache_verified", "model_drafts",
        "draft_tokens", "accepted_tokens", "accepted_hist", "tp", "fp", "fn", "tn", "tokens", "cycles",
        "dropped_events")))
    with engine.begin() as c:
        c.execute(sa.insert(events).values(at=start, tenant="t", workload="sql", request_id="r", position=3,
                                           drafter="cache", decision="cache", draft_len=8, accepted=5, predicted=4.5,
                                           tau=1.0, predictor_version_id=None, features=None, verified_len=6, txid=0))
        c.execute(sa.insert(buckets).values(dict(  # a dict: `fn` is also the name of values()'s own argument
            bucket_start=start, tenant="t", workload="sql", predictor_version_id=0, cache_drafts=1, cache_verified=1,
            model_drafts=0, draft_tokens=6, accepted_tokens=5, accepted_hist=[0] * HIST_BINS, tp=0, fp=0, fn=0, tn=1,
            tokens=6, cycles=1, dropped_events=0)))
    upgrade(engine)
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT accepted, verified_len, promised FROM decision_events")).one() == (5, 6, None)
        assert tuple(c.execute(sa.text("SELECT draft_tokens, accepted_tokens, cache_promised_milli, cache_promise_kept, "
                                       "model_promised_milli, model_promise_kept FROM stat_buckets")).one()) \
            == (6, 5, 0, 0, 0, 0)
    with session_scope(engine) as s:
        upsert_buckets(s, {(start, "t", "sql", 0): BucketDelta(cache_drafts=1, cache_promised_milli=2_500,
                                                               cache_promise_kept=2)})
    with engine.connect() as c:
        assert tuple(c.execute(sa.text("SELECT cache_drafts, cache_promised_milli, cache_promise_kept "
                                       "FROM stat_buckets")).one()) == (2, 2_500, 2)
    downgrade(engine, "0017")
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT accepted, verified_len FROM decision_events")).one() == (5, 6)
        assert c.execute(sa.text("SELECT cache_drafts FROM stat_buckets")).scalar_one() == 2
    assert "promised" not in {col["name"] for col in inspect(engine).get_columns("decision_events")}
