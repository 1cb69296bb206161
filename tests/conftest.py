"""Database fixtures shared by the storage tests: every test runs on SQLite and on the real
PostgreSQL server, each PostgreSQL test in a throwaway schema. And the markers that let
`make test-fast` leave out what needs vLLM, the PostgreSQL server or Chromium."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError

# Property tests check values, not speed: a per-example deadline fails them on a busy shared machine.
settings.register_profile("hvd", deadline=None)
settings.load_profile("hvd")

# Test files (or file::test) that need each heavy dependency; db_url's postgresql param adds `postgres`.
MARKED = {
    "vllm": ("test_vllm_plugin.py", "test_vllm_server.py", "test_eagle3_training.py::test_tiny_pipeline_end_to_end"),
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
    admin = create_engine(PG_URL)
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


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'hvd.db'}"
    else:
        yield from postgres_schema_url()


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    """An engine on db_url with the schema at head."""
    from storage.engine import make_engine
    from storage.migrate import upgrade

    engine = make_engine(db_url)
    try:
        upgrade(engine)
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


@pytest.fixture(autouse=True)
def _keep_main_module() -> Iterator[None]:
    """Streamlit's AppTest runs page scripts as `__main__` and leaves them there; multiprocessing's
    'spawn' children re-import whatever `__main__` is, so later multi-process tests would start by
    running a dashboard page. Put the real one back after every test."""
    import sys

    main = sys.modules.get("__main__")
    yield
    if main is not None:
        sys.modules["__main__"] = main


@pytest.fixture(scope="module")
def tokenizer():
    from predictor.tokens import TraceTokenizer

    return TraceTokenizer()


@pytest.fixture(scope="module")
def records():
    """Three bundled traces of every source: each source's prompts and outputs, quickly."""
    from predictor.traces import bundled_traces_path, load_traces

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
    from predictor.cache_drafter import CacheDrafter

    def start(runtime) -> dict[tuple[str, int], list[int]]:
        drafts: dict[tuple[str, int], list[int]] = {}
        original = CacheDrafter.draft

        def spy(self, req_id, context, max_spec_tokens=None):
            d = original(self, req_id, context, max_spec_tokens)
            if d.length:
                drafts[(req_id, len(context) - runtime.requests[req_id].hindsight.prompt_len)] = d.token_ids
            return d

        monkeypatch.setattr(CacheDrafter, "draft", spy)
        return drafts

    return start
