"""Database fixtures shared by the storage tests: every test runs on SQLite and on the real
PostgreSQL server, each PostgreSQL test in a throwaway schema; for `db`, a copy of a database migrated
once per session (SQLite: the file copied; PostgreSQL: the migrations' SQL, made once, replayed). And the markers that let
`make test-fast` leave out what needs vLLM, the PostgreSQL server or Chromium."""
from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

# Property tests check values, not speed: a per-example deadline fails them on a busy shared machine.
settings.register_profile("hvd", deadline=None)
settings.load_profile("hvd")

# Test files (or file::test) that need each heavy dependency; db_url's postgresql param adds `postgres`.
MARKED = {
    "vllm": ("test_vllm_plugin.py", "test_vllm_boundary.py", "test_vllm_server.py", "test_vllm_server_drain.py", "test_eagle3_training.py::test_tiny_pipeline_end_to_end"),
    "postgres": ("test_replicas.py",),
    "browser": ("test_dashboard_browser.py",),
}
PG_URL = os.environ.get("HVD_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


def postgres_schema_url() -> Iterator[str]:
    """A URL into a fresh schema, dropped afterwards. A server that is down fails the test, unless
    HVD_SKIP_POSTGRES=1 says to skip PostgreSQL."""
    if os.environ.get("HVD_SKIP_POSTGRES") == "1":
        pytest.skip("HVD_SKIP_POSTGRES=1")
    schema = f"hvd_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, pool_pre_ping=True)  # the fleet soak restarts the server
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except OperationalError as exc:
        admin.dispose()
        pytest.fail(f"PostgreSQL test server unreachable at {make_url(PG_URL).render_as_string()}: {exc.orig}. "
                    "Start it, or set HVD_SKIP_POSTGRES=1 to skip PostgreSQL tests.", pytrace=False)
    try:
        url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


# A schema's definition, names of the schema left out: what the migrations made, to compare two schemas.
_SCHEMA_DEFINITION = text("""
    SELECT 'column', table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable || ' '
                     || coalesce(character_maximum_length::text, '') || ' ' || coalesce(column_default, '')
      FROM information_schema.columns WHERE table_schema = current_schema()
    UNION ALL
    SELECT 'constraint', conrelid::regclass::text || ' ' || conname || ' ' || pg_get_constraintdef(oid)
      FROM pg_constraint WHERE connamespace = current_schema()::regnamespace
    UNION ALL
    SELECT 'index', replace(indexdef, current_schema() || '.', '')
      FROM pg_indexes WHERE schemaname = current_schema()
    UNION ALL
    SELECT 'revision', version_num FROM alembic_version
    ORDER BY 1, 2""")


@pytest.fixture(scope="session")
def _migrated_postgres_sql() -> str:
    """The migrations to head as one SQL script (Alembic's offline mode), made once per session: a
    fresh schema plus this script is a copy of a migrated one, in about half the migrations' time.
    Checked once per session against a schema migrated for real (same tables, columns, constraints,
    indexes and revision), so a migration the script cannot replay fails here, not silently."""
    import io

    from alembic import command

    from storage.engine import make_engine
    from storage.migrate import alembic_config, upgrade

    config = alembic_config()
    config.output_buffer = io.StringIO()
    config.set_main_option("sqlalchemy.url", PG_URL)
    command.upgrade(config, "head", sql=True)
    script = config.output_buffer.getvalue()
    definitions = []
    for migrate in (lambda url: upgrade(url), lambda url: _run_script(url, script)):
        urls = postgres_schema_url()
        url = next(urls)
        try:
            migrate(url)
            engine = make_engine(url)
            try:
                with engine.connect() as conn:
                    definitions.append(conn.execute(_SCHEMA_DEFINITION).all())
            finally:
                engine.dispose()
        finally:
            urls.close()
    assert definitions[0] == definitions[1], "the offline migration script does not make the migrated schema"
    return script


def _run_script(url: str, script: str) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(script)  # its own BEGIN ... COMMIT
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def _migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head once per session; every SQLite `db` is a copy of it."""
    from storage.engine import make_engine
    from storage.migrate import upgrade

    path = tmp_path_factory.mktemp("migrated") / "hvd.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        upgrade(engine)
    finally:
        engine.dispose()  # the last connection closed checkpoints the WAL into the file and removes it
    assert not path.with_name("hvd.db-wal").exists(), "the migrated template still has a WAL: copy would miss it"
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of the test's own on SQLite or PostgreSQL. Empty, unless the test also uses `db`:
    then a fresh copy of a database migrated to head once per session (so a test that checks the
    migrations themselves asks for db_url alone and still runs them)."""
    migrated = "db" in request.fixturenames
    if request.param == "sqlite":
        path = tmp_path / "hvd.db"
        if migrated:
            shutil.copy(request.getfixturevalue("_migrated_sqlite"), path)
        yield f"sqlite:///{path}"
    else:
        urls = postgres_schema_url()
        url = next(urls)
        try:
            if migrated:
                _run_script(url, request.getfixturevalue("_migrated_postgres_sql"))
            yield url
        finally:
            urls.close()  # drops the schema


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    """An engine on db_url, whose database is a copy of one at head (see db_url)."""
    from storage.engine import make_engine

    engine = make_engine(db_url)
    try:
        yield engine
    finally:
        engine.dispose()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = f"{item.path.name}::{item.name}"
        for marker, prefixes in MARKED.items():
            if name.startswith(prefixes):
                item.add_marker(marker)
        if getattr(item, "callspec", None) and item.callspec.params.get("db_url") == "postgresql":
            item.add_marker("postgres")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The in-process vLLM engines' hybrids live in this process, and its exit drain logs their
    tally through the handlers vLLM set up at import, on the streams pytest captured then; they are
    closed when the process exits ("--- Logging error ---" after the summary). Drain while they
    are open."""
    plugin = sys.modules.get("controller.engines.vllm_plugin")
    if plugin is not None:
        plugin.drain_process()


@pytest.fixture(autouse=True)
def _keep_main_module() -> Iterator[None]:
    """Streamlit's AppTest runs page scripts as `__main__` and leaves them there; multiprocessing's
    'spawn' children re-import whatever `__main__` is, so later multi-process tests would start by
    running a dashboard page. Put the real one back after every test."""
    main = sys.modules.get("__main__")
    yield
    if main is not None:
        sys.modules["__main__"] = main


@pytest.fixture(scope="module")
def tokenizer():
    from predictor.data.tokens import TraceTokenizer

    return TraceTokenizer()


@pytest.fixture(scope="session")
def records():
    """Three bundled traces of every source: each source's prompts and outputs. Loaded once per
    session (the modules using it share the list: TraceRecords are frozen, and no test mutates the
    list). All 10,351 are read: the first three of a source in arrival order (load_traces sorts by
    session) are only known at the end (the last source's third record is line 10,302 of 10,351)."""
    from predictor.data.traces import bundled_traces_path, load_traces

    recs, _ = load_traces([bundled_traces_path()])
    seen: dict[str, int] = {}
    out = []
    for r in recs:
        if seen.get(r.source, 0) < 3:
            seen[r.source] = seen.get(r.source, 0) + 1
            out.append(r)
    return out


@pytest.fixture
def record_drafts(monkeypatch):
    """Spy on the suffix cache: `record_drafts(runtime)` returns a dict, filled as the runtime
    drafts, of every non-empty cache draft by (request id, output position)."""
    from predictor.drafting.cache_drafter import CacheDrafter

    def start(runtime) -> dict[tuple[str, int], list[int]]:
        drafts: dict[tuple[str, int], list[int]] = {}
        original = CacheDrafter.draft

        def spy(self, req_id, context):
            d = original(self, req_id, context)
            if d.length:
                drafts[(req_id, len(context) - runtime.requests[req_id].hindsight.prompt_len)] = d.token_ids
            return d

        monkeypatch.setattr(CacheDrafter, "draft", spy)
        return drafts

    return start
